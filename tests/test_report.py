"""`mpprof report`: one offline HTML file, opened in headless Chromium."""

import html
import json
import re
import shutil

import numpy as np
import pytest
from browser import load_page
from diagnosis_runs import (
    A100,
    HOSTILE_NAME,
    HOSTILE_RUN,
    gpu_samples,
    logdir,
    write_gpu_run,
)

from mpprof import cli, diagnosis, report
from mpprof.display import downsample
from mpprof.records import reader
from mpprof.report import page, plots


@pytest.fixture(scope="module")
def report_logdir(tmp_path_factory):
    """Runs with every part a report can draw, hostile names included."""
    root = tmp_path_factory.mktemp("report_logdir")
    for name in ("healthy_float32", "storm", "forward_overflow"):
        shutil.copytree(logdir(name), root / name)
    shutil.copytree(logdir("hostile") / HOSTILE_RUN, root / HOSTILE_RUN)
    write_gpu_run(
        root,
        "healthy_mixed",
        [A100],
        name="gpu",
        samples=gpu_samples(tensor_util=30.0, gpu_util=90.0),
    )
    return root


@pytest.fixture(scope="module")
def report_file(report_logdir, tmp_path_factory):
    output = tmp_path_factory.mktemp("report") / "report.html"
    assert cli.main(["report", str(report_logdir), "-o", str(output)]) == 0
    return output


def test_report_cli_shows_progress(report_logdir, tmp_path, capsys):
    output = tmp_path / "sub" / "r.html"
    assert cli.main(["report", str(report_logdir), "-o", str(output)]) == 0
    err = capsys.readouterr().err
    assert "reading run storm/train (" in err
    assert f"wrote {output}" in err
    assert output.stat().st_size > 1_000_000  # plotly.js is inside


def test_report_is_self_contained(report_file):
    page = report_file.read_text()
    # No external script, stylesheet or image: it must open offline.
    assert not re.search(r"<(script|link|img|iframe)[^>]*\b(src|href)=", page)
    assert "Plotly" in page


def test_hostile_names_are_escaped_in_the_html(report_file):
    page = report_file.read_text()
    assert HOSTILE_NAME not in page.replace(_json_escaped(HOSTILE_NAME), "")
    assert html.escape(HOSTILE_NAME) in page  # the tables and findings
    assert html.escape(HOSTILE_RUN) in page  # the run's heading


def _json_escaped(text: str) -> str:
    # The plot labels inside the embedded JSON are entity-escaped already.
    return json.dumps(html.escape(text, quote=False))[1:-1]


def test_summary_lists_every_run_most_severe_first_with_links(report_logdir):
    page = report.build_report(report_logdir)
    runs = reader.read_logdir(report_logdir)
    results = {name: diagnosis.evaluate(run) for name, run in runs.items()}

    def key(name):
        return [-sum(f.severity == s for f in results[name].findings)
                for s in diagnosis.SEVERITIES]

    expected = sorted(runs, key=key)  # stable: the listing's order on a tie
    summary = page[page.index('<section class="summary">') : page.index('<section class="run"')]
    # Each run once in the summary, in that order, and its sections in that order.
    positions = [summary.index(f">{html.escape(name)}</a>") for name in expected]
    assert positions == sorted(positions)
    headings = [page.index(f"<h2>Run {html.escape(name)}</h2>") for name in expected]
    assert headings == sorted(headings)
    worst = expected[0]
    assert results[worst].findings[0].severity == "critical"
    # The worst finding of the worst run links to it.
    first = results[worst].findings[0]
    assert f'href="#run-0-finding-0"><span class="code">{first.code}</span>' in summary
    assert 'id="run-0-finding-0"' in page
    # What could not be checked is listed under each run's findings.
    for name, result in results.items():
        for check in result.checks:
            if check.status != "checked":
                assert html.escape(check.reason) in page, (name, check.code)


def test_run_context_is_a_table_not_json(report_logdir):
    page = report.build_report(report_logdir, run="storm/train")
    context = page[page.index("<h3>Run context</h3>") : page.index("<h3 id=")]
    assert '<table class="nested">' in context
    assert "{&quot;" not in context and '{"' not in context


def test_embedded_json_cannot_close_its_script_element():
    text = page.script_json({"name": "</script><script>alert(3)</script><!--"})
    assert "</" not in text and "<!--" not in text
    assert json.loads(text) == {"name": "</script><script>alert(3)</script><!--"}


def test_report_of_one_run_and_unknown_run(report_logdir, tmp_path):
    page = report.build_report(report_logdir, run="storm/train")
    assert "Run storm/train" in page and "Run forward_overflow/train" not in page
    with pytest.raises(reader.NoMpprofDataError, match="No mpprof run 'nope'"):
        report.build_report(report_logdir, run="nope")


def test_missing_and_empty_logdirs(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path / "absent"), "-o", str(tmp_path / "a")]) == 2
    assert cli.main(["report", str(tmp_path), "-o", str(tmp_path / "b.html")]) == 2
    assert "MixedPrecisionProfiler" in capsys.readouterr().err


def test_loss_scale_timeline_downsamples_but_keeps_extremes():
    steps = np.arange(1_000_000)
    scales = np.full(len(steps), 2.0**15)
    scales[123_457] = 1.0  # one dip must survive downsampling
    scales[987_654] = 2.0**24
    index = downsample.envelope(steps, scales, plots.MAX_TIMELINE_POINTS)
    kept_steps, kept = steps[index], scales[index]
    assert len(kept) <= plots.MAX_TIMELINE_POINTS + 2
    assert kept.min() == 1.0 and kept.max() == 2.0**24
    assert kept_steps[0] == 0 and kept_steps[-1] == steps[-1]


def test_event_markers_are_bucketed_with_counts():
    steps = np.arange(0, 500_000, 10)
    markers = plots.event_markers(steps, np.full(len(steps), 4.0))
    assert len(markers["steps"]) <= plots.MAX_EVENT_MARKERS
    assert sum(markers["counts"]) == len(steps)


@pytest.mark.browser
def test_report_opens_in_chromium_draws_plots_and_shows_names_as_text(report_file):
    page = load_page(
        report_file,
        wait_for="Array.from(document.querySelectorAll('div.plot'))"
        ".every(d => d.querySelector('.main-svg'))",
        evaluate={
            "plots": "document.querySelectorAll('div.plot').length",
            "drawn": "Array.from(document.querySelectorAll('div.plot'))"
            ".filter(d => d.querySelector('.main-svg')).length",
            "images": "document.querySelectorAll('img').length",
            "text": "document.body.innerText",
            "tick_labels": "Array.from(document.querySelectorAll('div.heatmap .ytick text'))"
            ".map(t => t.textContent)",
            "gpu_plots": "document.querySelectorAll('div.plot.gpu .main-svg').length",
            "heatmap_axis": "document.querySelector('div.heatmap')._fullLayout.xaxis.type",
        },
        screenshot="report.png",
    )
    assert page.errors == []
    values = page.values
    assert values["heatmap_axis"] == "linear"  # steps as numbers, not categories
    # loss scale x3, numerics 4 maps x2, GPU tracks x2 (Tensor Core, utilisation).
    assert values["plots"] >= 3 + 8 + 2
    assert values["drawn"] == values["plots"]
    assert values["gpu_plots"] >= 2
    # The hostile layer name is text: in the findings, the tables and as a
    # heatmap label; it never became an element.
    assert values["images"] == 0
    assert HOSTILE_NAME in values["text"]
    assert HOSTILE_RUN in values["text"]
    assert HOSTILE_NAME in values["tick_labels"]
    assert page.screenshot.stat().st_size > 10_000


@pytest.mark.browser
def test_report_follows_a_dark_colour_scheme_and_prints(report_file):
    page = load_page(
        report_file,
        wait_for="Array.from(document.querySelectorAll('div.plot'))"
        ".every(d => d.querySelector('.main-svg'))",
        evaluate={
            "body": "getComputedStyle(document.body).backgroundColor",
            "paper": "document.querySelector('div.plot')._fullLayout.paper_bgcolor",
            "print": "[...document.styleSheets].flatMap((s) => [...s.cssRules])"
            ".filter((r) => r.media && r.media.mediaText === 'print').length",
        },
        color_scheme="dark",
        screenshot="report_dark.png",
    )
    assert page.errors == []
    assert page.values["body"] == "rgb(30, 31, 34)"
    assert page.values["paper"] == "#1e1f22"
    assert page.values["print"] == 1


def test_browser_helper_skips_without_chromium_unless_required(monkeypatch):
    import browser

    monkeypatch.setenv("CHROMIUM", "/nonexistent/chromium")
    monkeypatch.delenv("MPPROF_REQUIRE_BROWSER", raising=False)
    with pytest.raises(pytest.skip.Exception, match="Chromium not found"):
        browser.require_chromium()
    monkeypatch.setenv("MPPROF_REQUIRE_BROWSER", "1")
    with pytest.raises(pytest.fail.Exception, match="MPPROF_REQUIRE_BROWSER=1"):
        browser.require_chromium()


def test_truncated_event_file_is_reported_not_fatal(tmp_path):
    shutil.copytree(logdir("storm"), tmp_path, dirs_exist_ok=True)
    (event_file,) = (tmp_path / "train").glob("*tfevents*")
    event_file.write_bytes(event_file.read_bytes()[:-40])
    page = report.build_report(tmp_path)
    assert "Could not read everything" in page and "incomplete record" in page
    assert "MP002" in page  # what was readable is still diagnosed


@pytest.mark.browser
def test_report_fix_and_evidence_blocks_render_their_lines(report_file):
    """A fix block reads as the fix's lines, as the tab shows them: no literal
    `\\n` (the printable filter must not run over the newlines of a block)."""
    page = load_page(
        report_file,
        wait_for="document.querySelector('.finding .fix pre')",
        evaluate={
            "fixes": "[...document.querySelectorAll('.finding .fix pre')].map(p => p.innerText)",
            "evidence": "[...document.querySelectorAll('.finding details pre')]"
            ".map(p => p.textContent)",
            "replays": "[...document.querySelectorAll('.replay pre')].map(p => p.innerText)",
        },
    )
    assert page.errors == []
    fixes = page.values["fixes"]
    assert fixes, "the report shows no fix block"
    for block in fixes + page.values["evidence"] + page.values["replays"]:
        assert "\\n" not in block, block
    multiline = [fix for fix in fixes if "\n" in fix]
    assert multiline, "no fix of several lines: the test would check nothing"
    # The evidence is indented JSON, one key a line, as json.dumps wrote it.
    assert all(text.startswith("{\n") for text in page.values["evidence"] if text != "{}")


def test_report_blocks_keep_newlines_and_escape_other_controls():
    from mpprof.report import sections

    assert sections.escape_block("a\nb\x1b[2J<i>") == "a\nb\\x1b[2J&lt;i&gt;"
    assert sections.escape_block("tab\there\r\n") == "tab\\there\\r\n"
