"""End to end: `tensorboard --logdir` with the installed plugin, in headless Chromium.

A real TensorBoard server (started here, on 127.0.0.1, a free port) finds
the plugin through its entry point; Chromium loads the mpprof tab, every view
draws, plotly charts render, no JavaScript error is logged, and a run named
with HTML shows as text. Screenshots land in test-artifacts/.

Without Chromium these tests skip with the reason; with
MPPROF_REQUIRE_BROWSER=1 (CI) they fail instead.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys
import threading

import pytest
from browser import load_page, require_chromium
from dashboard_logdirs import BFLOAT16_RUN, FLOAT16_RUN, HOSTILE_NAME, dashboard_logdir

from mpprof import reader, schema
from mpprof.writer import RecordWriter

pytestmark = pytest.mark.browser

_SERVING = re.compile(r"TensorBoard \S+ at (http://127\.0\.0\.1:\d+/)")
# Loading plugin_entry.html on its own (not inside TensorBoard's page) makes
# Chromium ask for /favicon.ico, which TensorBoard does not serve: not an
# error of the page.
_NOT_PAGE_ERRORS = re.compile(r"/favicon\.ico$")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base URL, logdir) of `tensorboard --logdir <copy of the dashboard logdir>`.

    A copy, so that a test may write into it as training would.
    """
    require_chromium()  # skip (or fail in CI) before training and serving
    logdir = tmp_path_factory.mktemp("served") / "logs"
    shutil.copytree(dashboard_logdir(tmp_path_factory), logdir)
    tensorboard = pathlib.Path(sys.executable).with_name("tensorboard")
    process = subprocess.Popen(
        [
            str(tensorboard),
            "--logdir",
            str(logdir),
            "--port",
            "0",
            "--host",
            "127.0.0.1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    found = threading.Event()
    lines: list[str] = []
    url: list[str] = []

    def read_stderr():
        for line in process.stderr:
            lines.append(line)
            match = _SERVING.search(line)
            if match and not url:
                url.append(match.group(1))
                found.set()

    threading.Thread(target=read_stderr, daemon=True).start()
    try:
        if not found.wait(timeout=120):
            pytest.fail("tensorboard did not start:\n" + "".join(lines[-30:]))
        yield url[0], logdir
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def show_view(view: str) -> str:
    """JS: click a view's tab, wait until it has drawn, describe what it shows."""
    return f"""(async () => {{
      document.querySelector('.tabs [data-view="{view}"]').click();
      const main = document.querySelector('main.view');
      for (let i = 0; i < 600; i++) {{
        if (main.dataset.view === "{view}" && main.dataset.state !== "loading") break;
        await new Promise((resolve) => setTimeout(resolve, 100));
      }}
      return {{
        state: main.dataset.state,
        plots: main.querySelectorAll('.js-plotly-plot .main-svg').length,
        heatmaps: main.querySelectorAll('.js-plotly-plot .hm').length,
        notMeasured: [...main.querySelectorAll('.not-measured')]
          .map((e) => e.textContent),
        rows: main.querySelectorAll('table.inventory tbody tr').length,
        findings: main.querySelectorAll('.findings > li').length,
        allClear: main.querySelectorAll('.all-clear').length,
        legend: [...main.querySelectorAll('.legendtext')].map((e) => e.textContent),
        text: main.innerText,
      }};
    }})()"""


# A real mouse click (move, down, up) in the top left of the first heatmap:
# plotly turns it into plotly_click, the page fetches that layer's history.
CLICK_HEATMAP = """(async () => {
  const chart = document.querySelector('main .heatmap.js-plotly-plot');
  if (!chart) return null;
  const area = chart.querySelector('.nsewdrag').getBoundingClientRect();
  const x = area.left + area.width * 0.1, y = area.top + area.height * 0.1;
  const target = document.elementFromPoint(x, y);
  const options = { bubbles: true, cancelable: true, clientX: x, clientY: y, view: window };
  for (const type of ['mousemove', 'mousedown', 'mouseup', 'click'])
    target.dispatchEvent(new MouseEvent(type, options));
  const plots = '.layer-history .js-plotly-plot .main-svg';
  for (let i = 0; i < 300 && !document.querySelector(plots); i++)
    await new Promise((resolve) => setTimeout(resolve, 100));
  return {
    layer: document.querySelector('.layer-history .layer-name')?.textContent,
    plots: document.querySelectorAll('.layer-history .js-plotly-plot').length,
  };
})()"""

# On the overview, follow the first finding's "Show evidence" link.
FOLLOW_FIRST_FINDING = """(async () => {
  const finding = document.querySelector('.findings > li');
  finding.querySelector('.evidence-link').click();
  const main = document.querySelector('main.view');
  for (let i = 0; i < 300 && main.dataset.state !== 'ready'; i++)
    await new Promise((resolve) => setTimeout(resolve, 100));
  return { code: finding.querySelector('.code').textContent, view: main.dataset.view };
})()"""

# Filter the inventory table by typing, then sort it by parameters.
FILTER_AND_SORT = """(async () => {
  document.querySelector('.tabs [data-view="inventory"]').click();
  for (let i = 0; i < 300 && document.querySelector('main.view').dataset.state !== 'ready'; i++)
    await new Promise((resolve) => setTimeout(resolve, 100));
  const names = () => [...document.querySelectorAll('table.inventory tbody .col-name')]
    .map((cell) => cell.textContent);
  const search = document.querySelector('.filters input[type=search]');
  search.value = 'head';
  search.dispatchEvent(new Event('input'));
  const filtered = names();
  search.value = '';
  search.dispatchEvent(new Event('input'));
  const header = document.querySelector('th[data-key=params]');
  header.click();
  const ascending = names();
  header.click();
  return { filtered, ascending, descending: names() };
})()"""


def page_errors(page) -> list[str]:
    return [e for e in page.errors if not _NOT_PAGE_ERRORS.search(e)]


def test_every_view_draws_without_errors(server):
    url, logdir = server
    runs = reader.read_logdir(logdir)
    page = load_page(
        url + "data/plugin_entry.html?name=mpprof",
        wait_for="document.querySelector('main.view[data-state=ready]')",
        evaluate={
            "overview": show_view("overview"),
            "evidence": FOLLOW_FIRST_FINDING,
            "inventory": show_view("inventory"),
            "loss_scale": show_view("loss_scale"),
            "gpu": show_view("gpu"),
            "table": FILTER_AND_SORT,
            "numerics": show_view("numerics"),
            "history": CLICK_HEATMAP,  # last: the screenshot shows it
            "runs": "[...document.querySelectorAll('.run-picker option')]"
            ".map((o) => o.textContent)",
            "images": "document.querySelectorAll('img').length",
        },
        screenshot="dashboard_numerics_view.png",
    )
    assert page_errors(page) == []
    views = page.values
    for name in ("overview", "inventory", "loss_scale", "numerics", "gpu"):
        assert views[name]["state"] == "ready", (name, views[name]["text"])

    # The overflow storm gives findings; each links to a view with its evidence.
    assert views["overview"]["findings"] > 0
    assert views["evidence"]["code"].startswith("MP")
    assert views["evidence"]["view"] in ("loss_scale", "numerics", "inventory", "gpu")
    focus = sorted(runs)[0]
    leaf_and_containers = runs[focus].inventory["layers"]
    assert views["inventory"]["rows"] == len(leaf_and_containers)

    assert views["loss_scale"]["plots"] >= 1
    assert any("overflow" in text for text in views["loss_scale"]["legend"])
    assert any("not a LossScaleOptimizer" in t for t in views["loss_scale"]["notMeasured"])

    numerics = runs[focus].numerics
    assert numerics is not None  # the callback samples numerics by default
    assert views["numerics"]["heatmaps"] >= 2
    assert views["history"] == {"layer": numerics.layers[0], "plots": 2}

    layers = runs[focus].inventory["layers"]
    assert views["table"]["filtered"] == [x["name"] for x in layers if "head" in x["name"]]
    by_params = [x["name"] for x in sorted(layers, key=lambda x: x["params"])]
    assert views["table"]["ascending"] == by_params
    assert views["table"]["descending"] == by_params[::-1]

    gpu = runs[focus].gpu
    if gpu is None or gpu.mode == "unavailable":
        assert views["gpu"]["notMeasured"]
    else:
        assert "Tensor utilization source" in views["gpu"]["text"]

    assert sorted(views["runs"]) == sorted(
        f"{name} ({run.context['model_policy']})" for name, run in runs.items()
    )


def test_hostile_run_name_shows_as_text(server):
    url, _ = server
    page = load_page(
        url + "data/plugin_entry.html?name=mpprof",
        wait_for="document.querySelector('main.view[data-state=ready]')",
        evaluate={
            "loss_scale": show_view("loss_scale"),
            "images": "document.querySelectorAll('img, image[href=x]').length",
            "options": "[...document.querySelectorAll('option')].map((o) => o.textContent)",
            "body": "document.body.innerText",
        },
    )
    assert page_errors(page) == []
    assert page.values["images"] == 0
    assert f"{FLOAT16_RUN} (mixed_float16)" in page.values["options"]
    assert HOSTILE_NAME in page.values["body"]
    # plotly renders legend text as markup: the run name must be escaped.
    assert any(HOSTILE_NAME in text for text in page.values["loss_scale"]["legend"])
    assert f"{BFLOAT16_RUN} (mixed_bfloat16)" in page.values["options"]


def test_tensorboard_ui_shows_the_mpprof_tab(server):
    in_frame = (
        "[...document.querySelectorAll('iframe')].map((f) => f.contentDocument)"
        ".find((d) => d && d.querySelector('main.view[data-state=ready]'))"
    )
    url, _ = server
    page = load_page(
        url + "#mpprof",
        wait_for=in_frame,
        evaluate={
            "tab": "document.body.innerText.includes('MPPROF') || "
            "document.body.innerText.toLowerCase().includes('mpprof')",
            "listing": "fetch('data/plugins_listing').then((r) => r.json())",
            "loss_scale": f"""(async () => {{
                const doc = {in_frame};
                doc.querySelector('.tabs [data-view="loss_scale"]').click();
                const plot = '.js-plotly-plot .main-svg';
                for (let i = 0; i < 300 && !doc.querySelector(plot); i++)
                  await new Promise((resolve) => setTimeout(resolve, 100));
                return doc.querySelectorAll('.js-plotly-plot .main-svg').length;
            }})()""",
        },
        screenshot="dashboard_tensorboard_ui.png",
    )
    assert page.values["tab"] is True
    assert page.values["listing"]["mpprof"]["enabled"] is True
    assert page.values["loss_scale"] >= 1
    assert page_errors(page) == [], json.dumps(page.errors, indent=1)
    assert page.screenshot is not None and page.screenshot.stat().st_size > 0


def reload_until_legend_has(text: str) -> str:
    """JS: click Reload until the loss-scale legend shows `text`; its legend."""
    return f"""(async () => {{
      const legend = () => [...document.querySelectorAll('main .legendtext')]
        .map((e) => e.textContent);
      const main = document.querySelector('main.view');
      for (let attempt = 0; attempt < 60; attempt++) {{
        if (legend().some((t) => t.includes({json.dumps(text)}))) break;
        await new Promise((resolve) => setTimeout(resolve, 250));
        document.querySelector('.toolbar button').click();
        while (main.dataset.state === "loading")
          await new Promise((resolve) => setTimeout(resolve, 50));
      }}
      return legend();
    }})()"""


def test_reload_shows_what_training_wrote_since_the_page_opened(server):
    url, logdir = server
    loss_scale = reader.read_run(logdir, FLOAT16_RUN).loss_scale
    overflows, step = loss_scale.skipped_steps, loss_scale.steps_run + 10

    def write_an_overflow():
        # What the callback writes when a later step overflows.
        writer = RecordWriter(logdir / FLOAT16_RUN)
        event = [[step, 64.0, 32.0, schema.EVENT_OVERFLOW]]
        writer.write_array(schema.LOSS_SCALE_EVENTS, event, step=step)
        writer.close()
        return True

    page = load_page(
        url + "data/plugin_entry.html?name=mpprof",
        wait_for="document.querySelector('main.view[data-state=ready]')",
        evaluate={
            "before": show_view("loss_scale"),
            "written": write_an_overflow,
            "after": reload_until_legend_has(f"overflow ({overflows + 1})"),
        },
    )
    assert page_errors(page) == []
    assert any(f"overflow ({overflows})" in t for t in page.values["before"]["legend"])
    assert any(f"overflow ({overflows + 1})" in t for t in page.values["after"])
