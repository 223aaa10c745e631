"""End to end: `tensorboard --logdir` with the installed plugin, in headless Chromium.

A real TensorBoard server (started here, on 127.0.0.1, a free port, one per
module) finds the plugin through its entry point; Chromium loads the mpprof
tab: it opens on the most severe run, every view draws, plotly charts
render, the state survives a reload, views link to each other, the theme
follows TensorBoard's, no JavaScript error is logged, and run and layer
names written as HTML show as text. Screenshots land in test-artifacts/.

Without Chromium these tests skip with the reason; with
MPPROF_REQUIRE_BROWSER=1 (CI) they fail instead.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import urllib.parse

import diagnosis_runs
import pytest
from browser import load_page, require_chromium, serve_tensorboard
from dashboard_logdirs import (
    BFLOAT16_RUN,
    FIRST_LAYER,
    FLOAT16_RUN,
    HOSTILE_NAME,
    dashboard_logdir,
)

from mpprof import diagnosis
from mpprof.records import reader, schema
from mpprof.records.writer import RecordWriter

pytestmark = pytest.mark.browser

# Sorts before every other run but has no findings: the dashboard must not
# open on it.
HEALTHY_RUN = "0_healthy/train"
# A float16 run whose layer named like HTML overflows (MP003, critical).
OVERFLOW_RUN = diagnosis_runs.HOSTILE_RUN
OVERFLOW_LAYER = diagnosis_runs.HOSTILE_NAME
SEVERITIES = ("critical", "warning", "info")
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
    shutil.copytree(diagnosis_runs.logdir("healthy_float32") / "train", logdir / HEALTHY_RUN)
    shutil.copytree(diagnosis_runs.logdir("hostile") / OVERFLOW_RUN, logdir / OVERFLOW_RUN)
    with serve_tensorboard(logdir) as url:
        yield url, logdir


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
  chart.scrollIntoView({ block: 'center' });
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


def entry_url(url: str, **state) -> str:
    """The mpprof tab on its own, with `state` (view, run, layer...) in its hash."""
    hash_ = "#" + urllib.parse.urlencode(state) if state else ""
    return url + "data/plugin_entry.html?name=mpprof" + hash_


READY = "document.querySelector('main.view[data-state=ready]')"

# The state the page shows: view, focus run, layer history, URL hash.
PAGE_STATE = """(async () => {
  const ready = () => document.querySelector('main.view[data-state=ready]');
  for (let i = 0; i < 600 && !ready(); i++)
    await new Promise((resolve) => setTimeout(resolve, 100));
  const history = '.layer-history .js-plotly-plot .main-svg';
  if (ready().dataset.view === 'numerics')
    for (let i = 0; i < 300 && !document.querySelector(history); i++)
      await new Promise((resolve) => setTimeout(resolve, 100));
  return {
    view: ready().dataset.view,
    run: document.querySelector('.run-picker select').value,
    layer: document.querySelector('.layer-history .layer-name')?.textContent ?? null,
    hash: decodeURIComponent(location.hash.replaceAll('+', ' ')),
    navigation: performance.getEntriesByType('navigation')[0].type,
  };
})()"""


def worst_run(runs: dict) -> str:
    """The run the dashboard opens on: most criticals, then warnings, infos;
    the first listed on a tie."""
    order = sorted(runs)  # as /runs lists them

    def key(name):
        findings = diagnosis.diagnose(runs[name])
        counts = [sum(f.severity == s for f in findings) for s in SEVERITIES]
        return [-c for c in counts] + [order.index(name)]

    return min(runs, key=key)


def test_every_view_draws_without_errors(server):
    url, logdir = server
    runs = reader.read_logdir(logdir)
    focus = worst_run(runs)
    # The most severe run is not the first alphabetically: it is opened anyway.
    assert sorted(runs)[0] == HEALTHY_RUN and not diagnosis.diagnose(runs[HEALTHY_RUN])
    assert any(f.severity == "critical" for f in diagnosis.diagnose(runs[focus]))
    page = load_page(
        entry_url(url),
        wait_for=READY,
        evaluate={
            "opened": "document.querySelector('.run-picker select').value",
            "options": "[...document.querySelectorAll('.run-picker option')]"
            ".map((o) => o.textContent)",
            "overview": show_view("overview"),
            "evidence": FOLLOW_FIRST_FINDING,
            "inventory": show_view("inventory"),
            "inventory_diff": "[...document.querySelectorAll('.inventory-diff tbody tr')]"
            ".map((row) => row.firstChild.textContent)",
            "loss_scale": show_view("loss_scale"),
            "gpu": show_view("gpu"),
            "histograms": show_view("histograms"),
            # (A layer whose values were all non-finite has no cells to draw.)
            "histogram_traces": "document.querySelector('.histogram-chart').data"
            ".map((trace) => trace.type)",
            "histogram_lines": "[...document.querySelectorAll('main .annotation-text')]"
            ".map((e) => e.textContent)",
            "table": FILTER_AND_SORT,
            "numerics": show_view("numerics"),
            "compared_heatmaps": "document.querySelectorAll('.compared-heatmaps .hm').length",
            "history": CLICK_HEATMAP,  # last: the screenshot shows it
            "images": "document.querySelectorAll('img, [onerror], [onload]').length",
        },
        screenshot="dashboard_numerics_view.png",
    )
    assert page_errors(page) == []
    views = page.values
    for name in ("overview", "inventory", "loss_scale", "numerics", "histograms", "gpu"):
        assert views[name]["state"] == "ready", (name, views[name]["text"])
    assert views["images"] == 0

    # Item 1: opened on the most severe run; every run's counts in the picker.
    assert views["opened"] == focus
    for name, run in runs.items():
        findings = diagnosis.diagnose(run)
        counts = [f"{sum(f.severity == s for f in findings)} {s}" for s in SEVERITIES]
        label = next(o for o in views["options"] if o.startswith(f"{name} ("))
        shown = [c for c in counts if not c.startswith("0 ")]
        assert label == (
            f"{name} ({run.context['model_policy']}) — {', '.join(shown) or 'no findings'}"
        )

    # The findings of the worst run; each links to a view with its evidence;
    # what could not be checked is listed under them.
    assert views["overview"]["findings"] == len(diagnosis.diagnose(runs[focus]))
    assert "Runs (most severe first)" in views["overview"]["text"]
    for check in diagnosis.evaluate(runs[focus]).not_measured:
        assert check.reason in views["overview"]["text"]
    assert views["evidence"]["code"] == diagnosis.diagnose(runs[focus])[0].code
    assert views["evidence"]["view"] in ("loss_scale", "numerics", "inventory", "gpu")
    assert views["inventory"]["rows"] == len(runs[focus].inventory["layers"])

    # Item 7: the compared runs' layers whose dtypes differ, and their headroom.
    described = {
        name: {
            layer["name"]: (layer["compute_dtype"], tuple(layer["output_dtypes"]))
            for layer in run.inventory["layers"]
            if layer["is_leaf"]
        }
        for name, run in runs.items()
    }
    differing = {
        layer
        for layers in described.values()
        for layer in layers
        if len({layers_.get(layer) for layers_ in described.values()}) > 1
    }
    assert sorted(views["inventory_diff"]) == sorted(differing)
    with_numerics = [n for n, run in runs.items() if run.numerics is not None and n != focus]
    assert views["compared_heatmaps"] == len(with_numerics)

    assert views["loss_scale"]["plots"] >= 1
    assert any("overflow" in text for text in views["loss_scale"]["legend"])
    assert any("not a LossScaleOptimizer" in t for t in views["loss_scale"]["notMeasured"])

    numerics = runs[focus].numerics
    assert views["numerics"]["heatmaps"] >= 2
    assert "computed in float16" in views["numerics"]["text"]
    assert views["history"] == {"layer": numerics.layers[0], "plots": 2}

    # Item 9: the recorded histograms, with float16's limits as lines.
    assert views["histograms"]["plots"] >= 1
    assert views["histogram_traces"] == ["heatmap"]
    assert any(t.startswith("float16 max") for t in views["histogram_lines"])
    assert any(t.startswith("float16 smallest subnormal") for t in views["histogram_lines"])

    layers = runs[focus].inventory["layers"]
    assert views["table"]["filtered"] == [x["name"] for x in layers if "head" in x["name"]]
    by_params = [x["name"] for x in sorted(layers, key=lambda x: x["params"])]
    assert views["table"]["ascending"] == by_params
    assert views["table"]["descending"] == by_params[::-1]

    # Item 10: no run sampled a GPU: one line for all runs, and what to do.
    assert all(run.gpu is None or run.gpu.mode == "unavailable" for run in runs.values())
    assert views["gpu"]["text"].count("No GPU was sampled") == 1
    assert "gpu_interval" in views["gpu"]["text"]


def test_overview_is_usable_without_plotly(server):
    """Item 11: the overview never waits for plotly.js (1.6 MB): with the
    script failing to load it still draws; a chart view says why it cannot."""
    url, _ = server
    page = load_page(
        entry_url(url),
        wait_for=READY,
        evaluate={
            "overview": "document.querySelector('main.view').innerText",
            "loss_scale": show_view("loss_scale"),
        },
        blocked_urls=("*plotly.min.js",),
        screenshot="dashboard_overview.png",
    )
    # The only failure is the blocked script (Chromium may log it).
    assert all("plotly.min.js" in e for e in page_errors(page)), page_errors(page)
    assert "Findings for" in page.values["overview"]
    assert page.values["loss_scale"]["state"] == "failed"
    assert "plotly.min.js could not be loaded" in page.values["loss_scale"]["text"]


def test_state_in_the_url_survives_a_reload(server):
    url, _ = server
    page = load_page(
        entry_url(url, view="numerics", run=FLOAT16_RUN, layer=FIRST_LAYER),
        wait_for=READY,
        evaluate={
            "linked": PAGE_STATE,
            # Another view; then the page reloads: it comes back there.
            "moved": """(async () => {
              document.querySelector('.tabs [data-view="loss_scale"]').click();
              const main = document.querySelector('main.view');
              while (!(main.dataset.view === 'loss_scale' && main.dataset.state === 'ready'))
                await new Promise((resolve) => setTimeout(resolve, 50));
              setTimeout(() => location.reload(), 0);
              return location.hash;
            })()""",
            "reloading": lambda: time.sleep(2),  # the old page is gone by then
            "reloaded": PAGE_STATE,
        },
    )
    assert page_errors(page) == []
    linked = page.values["linked"]
    assert linked["view"] == "numerics"
    assert linked["run"] == FLOAT16_RUN
    assert linked["layer"] == FIRST_LAYER
    reloaded = page.values["reloaded"]
    assert reloaded["navigation"] == "reload"
    assert reloaded["view"] == "loss_scale" and reloaded["run"] == FLOAT16_RUN
    assert f"run={FLOAT16_RUN}" in reloaded["hash"]


# Item 7: a real click on the focus run's first overflow marker.
CLICK_OVERFLOW_MARKER = """(async () => {
  document.querySelector('.tabs [data-view="loss_scale"]').click();
  const main = document.querySelector('main.view');
  while (!(main.dataset.view === 'loss_scale' && main.dataset.state === 'ready'))
    await new Promise((resolve) => setTimeout(resolve, 50));
  const chart = document.querySelector('.loss-scale-chart');
  chart.scrollIntoView({ block: 'center' });
  const trace = chart.data.find((t) => t.meta?.kind === 'overflow');
  const xa = chart._fullLayout.xaxis, ya = chart._fullLayout.yaxis;
  const box = chart.querySelector('.nsewdrag').getBoundingClientRect();
  const x = box.left + xa.l2p(trace.x[0]), y = box.top + ya.l2p(Math.log10(trace.y[0]));
  const target = document.elementFromPoint(x, y);
  const options = { bubbles: true, cancelable: true, clientX: x, clientY: y, view: window };
  for (const type of ['mousemove', 'mousedown', 'mouseup', 'click'])
    target.dispatchEvent(new MouseEvent(type, options));
  const numerics = () => main.dataset.view === 'numerics' && main.dataset.state === 'ready';
  for (let i = 0; i < 300 && !numerics(); i++)
    await new Promise((resolve) => setTimeout(resolve, 100));
  return {
    step: trace.x[0], view: main.dataset.view, hash: location.hash,
    // Item 6: the step is marked and labelled on the heatmaps.
    labels: [...document.querySelectorAll('.heatmap.headroom .annotation-text')]
      .map((e) => e.textContent),
  };
})()"""

# Item 7: a click on an inventory row opens the layer's history.
CLICK_INVENTORY_ROW = """(async (layer) => {
  document.querySelector('.tabs [data-view="inventory"]').click();
  const main = document.querySelector('main.view');
  while (!(main.dataset.view === 'inventory' && main.dataset.state === 'ready'))
    await new Promise((resolve) => setTimeout(resolve, 50));
  const row = [...document.querySelectorAll('table.inventory tbody tr')]
    .find((r) => r.dataset.layer === layer);
  const marked = { classes: row.className, badges: row.querySelector('.col-findings').textContent };
  row.click();
  const history = '.layer-history .js-plotly-plot .main-svg';
  for (let i = 0; i < 300 && !document.querySelector(history); i++)
    await new Promise((resolve) => setTimeout(resolve, 100));
  return { ...marked, view: main.dataset.view,
           layer: document.querySelector('.layer-history .layer-name')?.textContent };
})"""

# Item 2: the history of a layer whose outputs were all non-finite marks them.
OVERFLOW_MARKERS = """(() => {
  const chart = document.querySelector('.history-chart.magnitudes');
  const trace = chart.data.find((t) => t.name === 'overflowed output');
  const heatmap = document.querySelector('.heatmap.headroom').data[0];
  return { y: trace?.y, text: trace?.text, cells: heatmap.text.flat() };
})()"""


def test_views_link_to_each_other(server):
    url, logdir = server
    run = reader.read_run(logdir, OVERFLOW_RUN)
    numerics = run.numerics
    index = list(numerics.layers).index(OVERFLOW_LAYER)
    overflowed = diagnosis.forward_overflow_mask(run)[:, index]
    page = load_page(
        entry_url(url, run=OVERFLOW_RUN),
        wait_for=READY,
        evaluate={
            "marker": CLICK_OVERFLOW_MARKER,
            "marker_state": PAGE_STATE,
            "row": f"{CLICK_INVENTORY_ROW}({json.dumps(OVERFLOW_LAYER)})",
            "overflow": OVERFLOW_MARKERS,
            "screenshot": "window.scrollTo(0, 0)",
            # The layer opened last is the histograms view's layer too.
            "histograms": show_view("histograms"),
            "histogram_title": "document.querySelector('.histogram-chart .gtitle').textContent",
            "elements": "document.querySelectorAll('img, [onerror], [onload]').length",
        },
        screenshot="dashboard_histograms_hostile_layer.png",
    )
    assert page_errors(page) == []
    marker = page.values["marker"]
    assert marker["view"] == "numerics" and f"step={marker['step']}" in marker["hash"]
    assert f"step {marker['step']}" in marker["labels"]
    # The first layer that overflowed at (or after) that step opens.
    assert page.values["marker_state"]["layer"] == OVERFLOW_LAYER
    row = page.values["row"]
    assert "offender-critical" in row["classes"] and "MP003" in row["badges"]
    assert row["view"] == "numerics" and row["layer"] == OVERFLOW_LAYER
    overflow = page.values["overflow"]
    assert overflow["y"] == [numerics.policy_max] * int(overflowed.sum())
    share = numerics.forward["nonfinite_frac"][overflowed, index]
    assert overflow["text"] == [f"{100 * s:.1f}% non-finite" for s in share]
    assert any(c.startswith("overflowed: ") and "non-finite" in c for c in overflow["cells"])
    assert not any("-1.0 bits" in c for c in overflow["cells"])
    assert page.values["histograms"]["state"] == "ready"
    assert page.values["histogram_title"].startswith(f"{OVERFLOW_LAYER}: log2 |value|")
    assert page.values["elements"] == 0


def test_download_saves_the_views_data(server):
    url, _ = server
    capture = """(async (format) => {
      let saved = null;
      URL.createObjectURL = (blob) => { saved = blob; return 'blob:captured'; };
      HTMLAnchorElement.prototype.click = function () { window.savedName = this.download; };
      document.querySelector(`.download-${format}`).click();
      return { name: window.savedName, text: saved ? await saved.text() : null };
    })"""
    page = load_page(
        entry_url(url, view="loss_scale", run=FLOAT16_RUN),
        wait_for=READY,
        evaluate={"json": f"{capture}('json')", "csv": f"{capture}('csv')"},
    )
    assert page_errors(page) == []
    saved = json.loads(page.values["json"]["text"])
    assert page.values["json"]["name"].endswith(".json")
    assert any(key.startswith("loss_scale?") for key in saved)
    csv = page.values["csv"]["text"].splitlines()
    assert csv[0] == "run,step,loss scale"
    # The hostile run name stays a quoted-free text cell.
    assert any(line.startswith(f"{FLOAT16_RUN},") for line in csv[1:])


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
    options = page.values["options"]
    assert any(o.startswith(f"{FLOAT16_RUN} (mixed_float16) — ") for o in options)
    assert HOSTILE_NAME in page.values["body"]
    # plotly renders legend text as markup: the run name must be escaped.
    assert any(HOSTILE_NAME in text for text in page.values["loss_scale"]["legend"])
    assert any(o.startswith(f"{BFLOAT16_RUN} (mixed_bfloat16) — ") for o in options)


def test_tensorboard_ui_shows_the_mpprof_tab(server):
    in_frame = (
        "[...document.querySelectorAll('iframe')].map((f) => f.contentDocument)"
        ".find((d) => d && d.querySelector('main.view[data-state=ready]'))"
    )
    url, _ = server
    shared = urllib.parse.urlencode(
        {"p.mpprof.view": "inventory", "p.mpprof.run": FLOAT16_RUN}, quote_via=urllib.parse.quote
    )
    page = load_page(
        f"{url}#mpprof&{shared}",
        wait_for=in_frame,
        evaluate={
            "tab": "document.body.innerText.includes('MPPROF') || "
            "document.body.innerText.toLowerCase().includes('mpprof')",
            "listing": "fetch('data/plugins_listing').then((r) => r.json())",
            # Item 4: a TensorBoard link with the tab's state opens that state.
            "opened": f"""(() => {{
                const doc = {in_frame};
                return {{ view: doc.querySelector('main.view').dataset.view,
                          run: doc.querySelector('.run-picker select').value }};
            }})()""",
            "loss_scale": f"""(async () => {{
                const doc = {in_frame};
                doc.querySelector('.tabs [data-view="loss_scale"]').click();
                const plot = '.js-plotly-plot .main-svg';
                for (let i = 0; i < 300 && !doc.querySelector(plot); i++)
                  await new Promise((resolve) => setTimeout(resolve, 100));
                return doc.querySelectorAll('.js-plotly-plot .main-svg').length;
            }})()""",
            "host_hash": "decodeURIComponent(location.hash)",
            "light": f"getComputedStyle({in_frame}.body).backgroundColor",
            # Item 4: TensorBoard's reload button re-reads the runs in the tab.
            "host_reload": f"""(async () => {{
                const doc = {in_frame};
                const runsFetched = () => doc.defaultView.performance
                  .getEntriesByType('resource').filter((e) => e.name.includes('/runs?')).length;
                const before = runsFetched();
                document.querySelector('.reload-button').click();
                for (let i = 0; i < 100 && runsFetched() === before; i++)
                  await new Promise((resolve) => setTimeout(resolve, 50));
                const after = runsFetched();
                const main = doc.querySelector('main.view');
                for (let i = 0; i < 300 && main.dataset.state !== 'ready'; i++)
                  await new Promise((resolve) => setTimeout(resolve, 50));
                return {{ before, after }};
            }})()""",
            # TensorBoard's dark mode sets this class on its body.
            "dark": f"""(async () => {{
                // TensorBoard may rebuild the tab's frame after its reload.
                for (let i = 0; i < 300 && !({in_frame}); i++)
                  await new Promise((resolve) => setTimeout(resolve, 100));
                const doc = {in_frame};
                document.body.classList.add('dark-mode');
                for (let i = 0; i < 100 && !doc.body.classList.contains('dark'); i++)
                  await new Promise((resolve) => setTimeout(resolve, 50));
                const main = doc.querySelector('main.view');
                for (let i = 0; i < 300 && main.dataset.state !== 'ready'; i++)
                  await new Promise((resolve) => setTimeout(resolve, 50));
                return {{
                  body: getComputedStyle(doc.body).backgroundColor,
                  chart: doc.querySelector('.main-svg .bg')?.style.fill
                    ?? getComputedStyle(doc.querySelector('.main-svg')).backgroundColor,
                }};
            }})()""",
        },
        screenshot="dashboard_tensorboard_ui_dark.png",
    )
    assert page.values["tab"] is True
    assert page.values["listing"]["mpprof"]["enabled"] is True
    assert page.values["loss_scale"] >= 1
    assert page.values["opened"] == {"view": "inventory", "run": FLOAT16_RUN}
    # ...and the state shown goes back into TensorBoard's URL.
    assert page.values["host_hash"].startswith("#mpprof&")
    assert "p.mpprof.view=loss_scale" in page.values["host_hash"]
    assert f"p.mpprof.run={FLOAT16_RUN}" in page.values["host_hash"]
    assert page.values["host_reload"]["after"] > page.values["host_reload"]["before"]
    # Item 5: the tab follows TensorBoard's theme, charts included.
    assert page.values["light"] == "rgb(255, 255, 255)"
    assert page.values["dark"]["body"] == "rgb(32, 33, 36)"
    assert page.values["dark"]["chart"] != "rgb(255, 255, 255)"
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
