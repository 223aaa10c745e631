"""The float8 view: in the dashboard (a real `tensorboard` on 127.0.0.1 in
headless Chromium) and in the HTML report: share heatmaps, each layer's
scales and amax, links from the MP015-MP017 findings, and a run without
float8 layers saying so."""

from __future__ import annotations

import json
import re
import urllib.parse
import urllib.request

import keras
import numpy as np
import pytest
from browser import load_page, require_chromium, serve_tensorboard
from float8_runs import fit_float8, float8_data, float8_model

from mpprof import diagnosis
from mpprof.records import reader
from mpprof.report import write_report

pytestmark = pytest.mark.browser

SATURATING_RUN = "f8_saturating/train"
PLAIN_RUN = "plain/train"
READY = "document.querySelector('main.view[data-state=ready]')"
# JS: wait until the float8 view has drawn.
WAIT_FOR_FLOAT8 = """
  const main = document.querySelector('main.view');
  const drawn = () => main.dataset.view === 'float8' && main.dataset.state === 'ready';
  for (let i = 0; i < 600 && !drawn(); i++)
    await new Promise((resolve) => setTimeout(resolve, 100));
"""

# What the float8 view shows once drawn.
FLOAT8_VIEW = """(async () => {""" + WAIT_FOR_FLOAT8 + """
  return {
    state: main.dataset.state,
    heatmaps: main.querySelectorAll('.js-plotly-plot .hm').length,
    historyPlots: main.querySelectorAll('.float8-history .js-plotly-plot').length,
    layer: main.querySelector('.float8-history .layer-name')?.textContent ?? null,
    picked: main.querySelector('select.float8-layer')?.value ?? null,
    notMeasured: [...main.querySelectorAll('.not-measured')].map((e) => e.textContent),
    text: main.innerText,
  };
})()"""

# On the overview, follow the MP015 finding's "Show evidence" link.
FOLLOW_MP015 = """(async () => {
  [...document.querySelectorAll('.findings > li')]
    .find((li) => li.querySelector('.code').textContent === 'MP015')
    .querySelector('.evidence-link').click();""" + WAIT_FOR_FLOAT8 + """
  return {
    view: main.dataset.view,
    layer: main.querySelector('.float8-history .layer-name')?.textContent ?? null,
    hash: decodeURIComponent(location.hash),
  };
})()"""


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    """A float8 run whose first layer saturates (every step sampled) and a
    plain float32 run beside it."""
    root = tmp_path_factory.mktemp("float8_view")
    x, y = float8_data(growth=4.0)
    fit_float8(root / "f8_saturating", float8_model(), x, y, numerics_every=1)
    plain = keras.Sequential([keras.layers.Input((8,)), keras.layers.Dense(1, name="dense")])
    plain.compile(optimizer="sgd", loss="mse")
    fit_float8(root / "plain", plain, x, y)
    return root


@pytest.fixture(scope="module")
def server(logdir):
    require_chromium()
    with serve_tensorboard(logdir) as url:
        yield url


def _entry(url: str, **state) -> str:
    return url + "data/plugin_entry.html?name=mpprof#" + urllib.parse.urlencode(state)


def _route(url: str, **params) -> tuple[int, dict | str]:
    query = urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(f"{url}data/plugin/mpprof/float8?{query}") as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_float8_route_shapes_the_view_and_refuses_unknown_layers(server, logdir):
    run = reader.read_run(logdir / "f8_saturating", "train")
    status, payload = _route(server, run=SATURATING_RUN, columns=2)
    assert status == 200 and payload["available"]
    assert payload["layers"] == run.float8.layers == ["f8/hidden", "f8/head"]
    shares = payload["shares"]
    assert shares["rows"][0] == "f8/hidden · inputs (e4m3)"
    assert shares["rows"][5] == "f8/head · outputs_grad (e5m2)"
    # Five sampled steps merged into two columns, each the worst it covers.
    assert shares["samples_total"] == 5 and len(shares["column_steps"]) == 2
    worst = np.nanmax(run.float8.shares["saturated"][:2, 0, 0])
    assert shares["values"]["saturated"][0][0] == pytest.approx(worst, abs=1e-5)
    history = payload["history"]["tensors"]["inputs"]
    assert payload["layer"] == "f8/hidden"
    np.testing.assert_allclose(history["scale"], run.float8.state["scale"][:, 0, 0], rtol=1e-12)
    np.testing.assert_allclose(history["scale_range"],
                               run.float8.state["scale"][:, 0, 0] * 448.0, rtol=1e-12)
    status, payload = _route(server, run=SATURATING_RUN, layer="f8/head")
    assert status == 200 and payload["layer"] == "f8/head"
    status, body = _route(server, run=SATURATING_RUN, layer="<img src=x>")
    assert status == 404 and "No float8 layer" in body
    status, payload = _route(server, run=PLAIN_RUN)
    assert status == 200 and not payload["available"]
    assert "no float8 layers" in payload["reason"]


def test_the_float8_view_draws_and_findings_link_to_it(server):
    page = load_page(
        _entry(server, view="overview", run=SATURATING_RUN),
        wait_for=READY,
        evaluate={"link": FOLLOW_MP015, "view": FLOAT8_VIEW},
        screenshot="dashboard_float8_view.png",
    )
    assert [e for e in page.errors if not e.endswith("/favicon.ico")] == []
    # The MP015 finding on the saturating layer opens the float8 view on it.
    assert page.values["link"]["view"] == "float8"
    assert page.values["link"]["layer"] == "f8/hidden"
    assert "layer=f8/hidden" in page.values["link"]["hash"]
    view = page.values["view"]
    assert view["state"] == "ready" and view["notMeasured"] == []
    assert view["heatmaps"] == 2  # saturation and underflow
    assert view["historyPlots"] == 3  # inputs, kernel, output gradient
    assert view["picked"] == "f8/hidden"
    assert "2 float8 layers (float8_from_float32)" in view["text"]


def test_a_run_without_float8_says_so_in_the_float8_view(server):
    page = load_page(_entry(server, view="float8", run=PLAIN_RUN), wait_for=READY,
                     evaluate={"view": FLOAT8_VIEW})
    assert [e for e in page.errors if not e.endswith("/favicon.ico")] == []
    view = page.values["view"]
    assert view["heatmaps"] == 0 and view["historyPlots"] == 0
    assert view["notMeasured"] == [
        "Float8 training: not measured (no float8 layers in this run (model.quantize('float8') "
        "makes Dense and EinsumDense layers train in float8))"
    ]


def test_the_report_holds_the_float8_view_linked_from_its_findings(logdir, tmp_path):
    require_chromium()
    out = tmp_path / "report.html"
    write_report(str(logdir), str(out))
    html = out.read_text()
    runs = reader.read_logdir(logdir)
    saturating = next(name for name in runs if name.startswith("f8_saturating"))
    assert any(f.code == "MP015" for f in diagnosis.diagnose(runs[saturating]))
    # One float8 section, for the float8 run only; MP015 links to it.
    sections = re.findall(r'<h3 id="(run-\d+-float8)">Float8</h3>', html)
    assert len(sections) == 1 and html.count(">Float8</h3>") == 1
    assert f'href="#{sections[0]}">see the float8 view</a>' in html
    page = load_page(
        out,
        wait_for="document.querySelectorAll('div.plot .main-svg').length",
        evaluate={
            "float8_plots": "[...document.querySelectorAll('div.plot[data-kind^=float8]')]"
            ".map((d) => [d.dataset.kind, !!d.querySelector('.main-svg')])",
        },
        screenshot="report_float8.png",
    )
    assert page.errors == []
    assert page.values["float8_plots"] == (
        [["float8_share", True]] * 2 + [["float8_scale", True]] * 3
    )
