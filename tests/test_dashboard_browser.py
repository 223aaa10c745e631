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
import subprocess
import sys
import threading

import pytest
from browser import load_page, require_chromium
from dashboard_logdirs import BFLOAT16_RUN, FLOAT16_RUN, HOSTILE_NAME, dashboard_logdir

from mpprof import reader

pytestmark = pytest.mark.browser

_SERVING = re.compile(r"TensorBoard \S+ at (http://127\.0\.0\.1:\d+/)")
# Loading plugin_entry.html on its own (not inside TensorBoard's page) makes
# Chromium ask for /favicon.ico, which TensorBoard does not serve: not an
# error of the page.
_NOT_PAGE_ERRORS = re.compile(r"/favicon\.ico$")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Base URL of `tensorboard --logdir <dashboard logdir> --port 0`."""
    require_chromium()  # skip (or fail in CI) before training and serving
    logdir = dashboard_logdir(tmp_path_factory)
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
        yield url[0]
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


def page_errors(page) -> list[str]:
    return [e for e in page.errors if not _NOT_PAGE_ERRORS.search(e)]


def test_every_view_draws_without_errors(server, tmp_path_factory):
    logdir = dashboard_logdir(tmp_path_factory)
    runs = reader.read_logdir(logdir)
    page = load_page(
        server + "data/plugin_entry.html?name=mpprof",
        wait_for="document.querySelector('main.view[data-state=ready]')",
        evaluate={
            "overview": show_view("overview"),
            "inventory": show_view("inventory"),
            "loss_scale": show_view("loss_scale"),
            "gpu": show_view("gpu"),
            "numerics": show_view("numerics"),  # last: the screenshot shows it
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

    assert views["overview"]["findings"] + views["overview"]["allClear"] > 0
    focus = sorted(runs)[0]
    leaf_and_containers = runs[focus].inventory["layers"]
    assert views["inventory"]["rows"] == len(leaf_and_containers)

    assert views["loss_scale"]["plots"] >= 1
    assert any("overflow" in text for text in views["loss_scale"]["legend"])
    assert any(
        "not a LossScaleOptimizer" in t for t in views["loss_scale"]["notMeasured"]
    )

    if getattr(runs[focus], "numerics", None) is None:
        assert views["numerics"]["notMeasured"]
    else:
        assert views["numerics"]["heatmaps"] >= 2

    gpu = getattr(runs[focus], "gpu", None)
    if gpu is None or gpu.mode == "unavailable":
        assert views["gpu"]["notMeasured"]
    else:
        assert "Tensor utilization source" in views["gpu"]["text"]

    assert sorted(views["runs"]) == sorted(
        f"{name} ({run.context['model_policy']})" for name, run in runs.items()
    )


def test_hostile_run_name_shows_as_text(server):
    page = load_page(
        server + "data/plugin_entry.html?name=mpprof",
        wait_for="document.querySelector('main.view[data-state=ready]')",
        evaluate={
            "loss_scale": show_view("loss_scale"),
            "images": "document.querySelectorAll('img, image[href=x]').length",
            "options": "[...document.querySelectorAll('option')]"
            ".map((o) => o.textContent)",
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
    page = load_page(
        server + "#mpprof",
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
