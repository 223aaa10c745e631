"""The mpprof TensorBoard plugin's HTTP routes, in process.

TensorBoard's own WSGI app over a MultiplexerDataProvider, as `tensorboard`
builds it, on logdirs written by real training runs; payloads are checked
against what `mpprof.records.reader` and `mpprof.diagnosis` say about the same run.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import time
import urllib.request

import diagnosis_runs
import keras
import numpy as np
import plotly as plotly_package
import pynvml
import pytest
import tensorflow as tf
from broken_logdirs import (
    BAD_STEP,
    MALFORMED,
    copy_run,
    malformed_logdir,
    without_root_privileges,
)
from browser import serve_tensorboard
from conftest import BatchTimes, mnist_like, seed_model
from dashboard_logdirs import (
    BFLOAT16_RUN,
    FIRST_LAYER,
    FLOAT16_RUN,
    HOSTILE_NAME,
    dashboard_logdir,
)
from fake_nvml import FakeGpu, FakeNvmlLibrary, installed
from real_nvml import nvml_on_this_machine
from tensorboard.backend import application
from tensorboard.backend.event_processing import data_provider as data_provider_lib
from tensorboard.backend.event_processing import plugin_event_multiplexer
from tensorboard.plugins import base_plugin
from werkzeug import test as werkzeug_test

import mpprof
from mpprof import diagnosis
from mpprof.records import reader, schema
from mpprof.records.writer import RecordWriter
from tensorboard_plugin_mpprof import metadata, payloads
from tensorboard_plugin_mpprof.plugin import MpprofPluginLoader

ROUTE = "/data/plugin/mpprof/"


def tensorboard_client(logdir) -> werkzeug_test.Client:
    """A client of the WSGI app `tensorboard --logdir logdir` would serve."""
    logdir = str(logdir)
    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(logdir)
    multiplexer.Reload()
    provider = data_provider_lib.MultiplexerDataProvider(multiplexer, logdir)
    context = base_plugin.TBContext(logdir=logdir, data_provider=provider, multiplexer=multiplexer)
    plugin = _entry_point_loader()().load(context)
    app = application.TensorBoardWSGI([plugin], data_provider=provider)
    return werkzeug_test.Client(app)


def _entry_point_loader():
    (entry_point,) = [
        ep
        for ep in importlib.metadata.entry_points(group="tensorboard_plugins")
        if ep.name == metadata.PLUGIN_NAME
    ]
    return entry_point.load()


def get_json(client, route: str, **params):
    response = client.get(ROUTE + route, query_string=params)
    assert response.status_code == 200, response.get_data(as_text=True)
    return json.loads(response.get_data())


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    return dashboard_logdir(tmp_path_factory)


@pytest.fixture(scope="module")
def client(logdir):
    return tensorboard_client(logdir)


@pytest.fixture(scope="module")
def runs(logdir):
    return reader.read_logdir(logdir)


def test_entry_point_names_the_loader_and_the_schema_plugin_name():
    assert _entry_point_loader() is MpprofPluginLoader
    assert metadata.PLUGIN_NAME == schema.PLUGIN_NAME


def test_loader_without_plotly_hides_the_tab_and_logs_why(monkeypatch, caplog, logdir):
    monkeypatch.setitem(sys.modules, "plotly", None)  # as if not installed
    context = base_plugin.TBContext(logdir=str(logdir))
    with caplog.at_level(logging.WARNING):
        assert MpprofPluginLoader().load(context) is None
    assert "mpprof TensorBoard tab disabled" in caplog.text
    assert "plotly" in caplog.text


def test_tab_is_active_exactly_when_the_logdir_holds_mpprof_data(client, tmp_path):
    listing = json.loads(client.get("/data/plugins_listing").get_data())
    assert listing["mpprof"]["enabled"] is True
    assert listing["mpprof"]["loading_mechanism"]["module_path"].endswith("/index.js")

    other = tmp_path / "scalars_only"
    with tf.summary.create_file_writer(str(other / "train")).as_default():
        tf.summary.scalar("loss", 1.0, step=0)
    response = tensorboard_client(other).get("/data/plugins_listing")
    assert json.loads(response.get_data())["mpprof"]["enabled"] is False


def test_runs_lists_the_reader_runs_with_their_summaries(client, runs):
    payload = get_json(client, "runs")
    assert [r["run"] for r in payload["runs"]] == sorted(runs)
    assert sorted(runs) == sorted([BFLOAT16_RUN, FLOAT16_RUN])
    by_name = {r["run"]: r for r in payload["runs"]}
    for name, run in runs.items():
        summary = by_name[name]
        assert summary["model_policy"] == run.context["model_policy"]
        loss_scale = run.loss_scale
        if loss_scale is None:
            assert summary["loss_scale"] is None
        else:
            assert summary["loss_scale"]["overflows"] == loss_scale.skipped_steps
            assert summary["loss_scale"]["steps_run"] == loss_scale.steps_run
    assert by_name[FLOAT16_RUN]["loss_scale"]["overflows"] > 0


# What dashboard_logdirs trains, by hand: Input((8,)) -> Dense(16) "dense_in"
# under the run's policy -> Dense(1, dtype="float32") "head"; per run: the
# policy, its half type, and the optimizer compile ends up with.
TRAINED = {
    FLOAT16_RUN: ("mixed_float16", "float16", "LossScaleOptimizer"),
    BFLOAT16_RUN: ("mixed_bfloat16", "bfloat16", "SGD"),
}


def _layer(entry: dict) -> tuple:
    return (entry["class"], entry["policy"], entry["compute_dtype"], entry["variable_dtype"],
            entry["output_dtypes"], entry["params"], entry["float32_island"])


def test_context_and_inventory_are_the_reader_and_the_model_trained(client, runs):
    assert sorted(TRAINED) == sorted(runs)
    for name, (policy, half, optimizer) in TRAINED.items():
        context = get_json(client, "context", run=name)["context"]
        assert context == runs[name].context
        assert (context["model_policy"], context["global_policy"]) == (policy, policy)
        assert context["optimizer"] == optimizer
        assert context["keras_version"] == keras.__version__
        assert context["framework"]["version"] == tf.__version__

        inventory = get_json(client, "inventory", run=name)
        assert inventory.pop("available") is True
        assert inventory == runs[name].inventory
        assert [layer["name"] for layer in inventory["layers"]] == [FIRST_LAYER, "head"]
        dense_in, head = inventory["layers"]
        assert _layer(dense_in) == ("Dense", policy, half, "float32", [half], 8 * 16 + 16, False)
        assert _layer(head) == (
            "Dense", "float32", "float32", "float32", ["float32"], 16 * 1 + 1, True
        )
        # The inputs arrive as float32 and are cast to the half type; the
        # float32 head casts the half output of dense_in back.
        assert [(c["layer"], c["from_dtype"], c["to_dtype"]) for c in inventory["casts"]] == [
            (FIRST_LAYER, "float32", half), ("head", half, "float32"),
        ]


def test_loss_scale_matches_the_reader(client, runs):
    loss_scale = runs[FLOAT16_RUN].loss_scale
    payload = get_json(client, "loss_scale", run=FLOAT16_RUN)
    steps, scales = loss_scale.series()
    assert payload["series"] == {"step": steps.tolist(), "scale": scales.tolist()}
    assert payload["overflows"]["step"] == loss_scale.overflow_steps.tolist()
    assert payload["overflows"]["total"] == loss_scale.skipped_steps
    assert payload["growths"]["step"] == loss_scale.growths[:, 0].astype(int).tolist()
    assert payload["final_scale"] == loss_scale.final_scale

    no_scaling = get_json(client, "loss_scale", run=BFLOAT16_RUN)
    assert no_scaling["available"] is False
    assert "not a LossScaleOptimizer" in no_scaling["reason"]


def test_downsampled_loss_scale_keeps_both_ends_and_the_extremes(client, runs):
    steps, scales = runs[FLOAT16_RUN].loss_scale.series()
    points = 4
    assert len(steps) > points
    series = get_json(client, "loss_scale", run=FLOAT16_RUN, points=points)["series"]
    assert len(series["step"]) < len(steps)
    assert series["step"][0] == steps[0] and series["step"][-1] == steps[-1]
    assert min(series["scale"]) == scales.min() and max(series["scale"]) == scales.max()
    assert set(series["step"]) <= set(steps.tolist())


def test_findings_are_the_diagnosis_of_the_run(client, runs):
    for name, run in runs.items():
        payload = get_json(client, "findings", run=name)
        result = diagnosis.evaluate(run)
        expected = json.loads(json.dumps([f.to_dict() for f in result.findings]))
        assert payload["available"] is True
        assert payload["findings"] == expected
        assert payload["counts"] == {
            severity: sum(f.severity == severity for f in result.findings)
            for severity in ("critical", "warning", "info")
        }
        # What the terminal prints as "not measured" is in the payload too.
        unchecked = [(c.code, c.reason) for c in result.notes]
        assert [(n["code"], n["reason"]) for n in payload["not_checked"]] == unchecked
        assert {(c.code, c.reason) for c in result.not_measured} <= set(unchecked)


def test_runs_carry_their_finding_counts(client, runs):
    by_name = {r["run"]: r for r in get_json(client, "runs")["runs"]}
    for name, run in runs.items():
        findings = diagnosis.diagnose(run)
        counts = by_name[name]["findings"]
        assert sum(counts.values()) == len(findings)
        for severity, count in counts.items():
            assert count == sum(f.severity == severity for f in findings)


def test_numerics_matrices_match_the_reader(client, runs):
    run = runs[FLOAT16_RUN]
    numerics = run.numerics
    payload = get_json(
        client, "numerics", run=FLOAT16_RUN, direction="backward", stat="underflow_frac"
    )
    assert numerics is not None  # the callback samples numerics by default
    # Room for every layer and step: the matrix comes back as recorded.
    raw = np.asarray(numerics.backward["underflow_frac"], dtype=np.float64)
    assert payload["rows"] == list(numerics.layers) == payload["row_layers"]
    assert payload["column_steps"] == list(numerics.steps)
    np.testing.assert_allclose(
        np.array(payload["values"], dtype=float), raw.T, atol=1e-5, equal_nan=True
    )
    # One column: each layer's worst value over all sampled steps.
    pooled = get_json(
        client,
        "numerics",
        run=FLOAT16_RUN,
        direction="backward",
        stat="underflow_frac",
        columns=1,
    )
    np.testing.assert_allclose(
        np.array(pooled["values"], dtype=float)[:, 0], np.nanmax(raw, axis=0), atol=1e-6
    )
    # One row and one column: the worst value of the whole matrix, its row
    # labelled with the layers it covers.
    whole = get_json(
        client,
        "numerics",
        run=FLOAT16_RUN,
        direction="forward",
        stat="abs_max",
        rows=1,
        columns=1,
    )
    (cell,) = whole["values"][0]
    assert whole["rows"] == [f"{FIRST_LAYER} … head ({len(numerics.layers)} layers)"]
    assert cell == np.nanmax(numerics.forward["abs_max"])
    history = get_json(client, "layer_history", run=FLOAT16_RUN, layer=FIRST_LAYER)
    index = list(numerics.layers).index(FIRST_LAYER)
    np.testing.assert_allclose(
        np.array(history["series"]["backward/underflow_frac"], dtype=float),
        raw[:, index],
        atol=1e-12,
    )


def test_headroom_is_bits_below_the_policy_max_and_marks_overflows(client, runs):
    numerics = runs[FLOAT16_RUN].numerics
    payload = get_json(client, "numerics", run=FLOAT16_RUN, direction="forward", stat="headroom")
    assert numerics is not None
    values = np.array(payload["values"], dtype=float)  # [layers, steps]
    abs_max = numerics.forward["abs_max"].T
    overflowed = diagnosis.forward_overflow_mask(runs[FLOAT16_RUN]).T
    fine = ~overflowed & (abs_max > 0)
    np.testing.assert_allclose(
        values[fine], np.log2(numerics.policy_max / abs_max[fine]), atol=0.01
    )
    assert np.all(values[overflowed] < 0)
    assert payload["policy_max"] == numerics.policy_max
    assert payload["dtype"] == "float16" and payload["underflow_applies"] is True
    np.testing.assert_array_equal(np.array(payload["overflowed"]), overflowed)
    nonfinite = np.array(payload["nonfinite"], dtype=float)
    np.testing.assert_allclose(nonfinite, numerics.forward["nonfinite_frac"].T, atol=1e-4)


def test_overflowed_samples_are_marked_with_their_nonfinite_share():
    """A layer whose outputs were all non-finite has a finite max of 0: the
    history and the heatmap say it overflowed, and by how much."""
    run = diagnosis_runs.read("forward_overflow")
    numerics = run.numerics
    index = list(numerics.layers).index("second")
    history = payloads.layer_history_payload(run, "second", 1000)
    overflowed = diagnosis.forward_overflow_mask(run)[:, index]
    assert overflowed.any()
    assert history["overflowed"] == overflowed.tolist()
    assert history["dtype"] == "float16"
    nonfinite = np.array(history["series"]["forward/nonfinite_frac"], dtype=float)
    assert np.all(nonfinite[overflowed] > 0)
    heatmap = payloads.numerics_payload(run, "forward", "headroom", 100, 100)
    row = heatmap["row_layers"].index("second")
    assert heatmap["overflowed"][row] == overflowed.tolist()
    assert heatmap["values"][row] == [payloads.OVERFLOW_HEADROOM] * len(overflowed)


def test_bfloat16_numerics_are_labelled_with_bfloat16s_range():
    run = diagnosis_runs.read("healthy_bfloat16")
    payload = payloads.numerics_payload(run, "backward", "underflow_frac", 100, 100)
    assert payload["dtype"] == "bfloat16"
    assert payload["policy_max"] == schema.BFLOAT16_MAX
    # float16's underflow share is recorded, but it is no judgement here.
    assert payload["underflow_applies"] is False
    assert payload["dtype_smallest_normal"] == 2.0**-126
    # An all-zero output has the most headroom bfloat16 has, not float16's.
    headroom = payloads.numerics_payload(run, "forward", "headroom", 100, 100)
    assert np.nanmax(np.array(headroom["values"], dtype=float)) <= np.log2(
        schema.BFLOAT16_MAX / 2.0**-133
    ) + 0.01
    assert headroom["dtype"] == "bfloat16"


def test_histogram_shares_are_the_recorded_counts_per_sample(client, runs):
    numerics = runs[FLOAT16_RUN].numerics
    payload = get_json(
        client, "histogram", run=FLOAT16_RUN, layer=FIRST_LAYER, direction="forward"
    )
    index = list(numerics.layers).index(FIRST_LAYER)
    counts = numerics.forward_hist[:, index, :].astype(float)  # [S, B]
    shares = np.array(payload["shares"], dtype=float).T
    totals = counts.sum(axis=1)
    assert payload["column_steps"] == numerics.steps.tolist()
    np.testing.assert_allclose(
        shares[totals > 0], (counts / totals[:, None])[totals > 0], atol=1e-4
    )
    assert payload["edges"] == list(schema.NUMERICS_HIST_EDGES)
    assert payload["lines"]["float16 max"] == pytest.approx(np.log2(65504.0))
    assert payload["lines"]["float16 smallest subnormal"] == -24


def test_gpu_payload_says_what_this_machines_nvml_has(client, runs):
    """The dashboard's runs sampled the machine's own NVML: asked directly
    here, it tells what the payload must say."""
    machine = nvml_on_this_machine()
    for name in runs:
        payload = get_json(client, "gpu", run=name)
        if machine is None:
            assert (payload["available"], payload["mode"]) == (False, "unavailable")
            assert "libnvidia-ml.so.1" in payload["reason"]
            assert payload["devices"] == [] and payload["tracks"] == {}
        else:
            assert payload["available"] is True and payload["mode"] in ("gpm", "basic")
            assert {d["uuid"] for d in payload["devices"]} <= set(machine)


def test_gpu_payload_tracks_are_what_the_gpu_reported(tmp_path):
    """A run sampled from a fake NVML C library whose GPU reports constant
    values: every track's bucket means are those values, in the tracks' units."""
    fake = FakeGpu()
    steps = 4
    with installed(FakeNvmlLibrary([fake])):
        keras.utils.set_random_seed(0)
        seed_model(last_dtype="float32").fit(
            *mnist_like(samples=32 * steps), batch_size=32, verbose=0,
            callbacks=[mpprof.MixedPrecisionProfiler(str(tmp_path), gpu_interval=0.1),
                       BatchTimes(sleep_s=0.3)],
        )
    keras.mixed_precision.set_dtype_policy("float32")
    payload = get_json(tensorboard_client(tmp_path), "gpu", run="train", points=3)
    assert (payload["available"], payload["mode"], payload["tensor_source"]) == (
        True, "gpm", "GPM"
    )
    assert [d["name"] for d in payload["devices"]] == [fake.name]
    (track,) = payload["tracks"].values()
    expected = {
        "tensor_util": fake.gpm_values[pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL],
        "hmma_tensor_util": fake.gpm_values[pynvml.NVML_GPM_METRIC_HMMA_TENSOR_UTIL],
        "sm_util": fake.gpm_values[pynvml.NVML_GPM_METRIC_SM_UTIL],
        "gpu_util": fake.gpu_util,
        "mem_used_bytes": fake.memory_used,
        "power_w": fake.power_mw / 1000.0,
        "temperature_c": fake.temperature_c,
    }
    for column, value in expected.items():
        assert 1 <= len(track[column]) <= 3
        assert track[column] == [pytest.approx(value)] * len(track[column]), column
    # The steps the samples were taken during: within the fit's four.
    assert all(0 <= s <= steps for s in track["step"])


@pytest.mark.parametrize(
    "route, params, status",
    [
        ("inventory", {"run": "no/such/run"}, 404),
        ("inventory", {"run": "/etc"}, 404),
        ("inventory", {"run": "../" + FLOAT16_RUN}, 404),
        ("findings", {}, 400),
        ("loss_scale", {"run": FLOAT16_RUN, "points": "many"}, 400),
        ("loss_scale", {"run": FLOAT16_RUN, "points": "1"}, 400),
        (
            "numerics",
            {"run": FLOAT16_RUN, "direction": "sideways", "stat": "abs_max"},
            400,
        ),
        ("numerics", {"run": FLOAT16_RUN, "direction": "forward", "stat": "mean"}, 400),
        (
            "numerics",
            {"run": FLOAT16_RUN, "direction": "backward", "stat": "headroom"},
            400,
        ),
        (
            "numerics",
            {
                "run": FLOAT16_RUN,
                "direction": "forward",
                "stat": "abs_max",
                "columns": "0",
            },
            400,
        ),
        ("layer_history", {"run": FLOAT16_RUN}, 400),
        ("histogram", {"run": FLOAT16_RUN, "direction": "forward"}, 400),
        ("histogram", {"run": FLOAT16_RUN, "layer": FIRST_LAYER, "direction": "up"}, 400),
        ("gpu", {"run": "nope"}, 404),
    ],
)
def test_bad_requests(client, route, params, status):
    response = client.get(ROUTE + route, query_string=params)
    assert response.status_code == status, response.get_data(as_text=True)


def test_unknown_layer_is_404(client):
    response = client.get(
        ROUTE + "layer_history",
        query_string={"run": FLOAT16_RUN, "layer": "no_such_layer"},
    )
    assert response.status_code == 404


def test_a_run_without_numerics_says_so(client, runs):
    assert runs[BFLOAT16_RUN].numerics is None  # recorded with numerics_every=None
    for route, params in [
        ("numerics", {"direction": "forward", "stat": "headroom"}),
        ("layer_history", {"layer": "head"}),
    ]:
        payload = get_json(client, route, run=BFLOAT16_RUN, **params)
        assert payload["available"] is False
        assert "not recorded" in payload["reason"]


@pytest.mark.parametrize(
    "path",
    [
        "static/../plugin.py",
        "static/..%2fplugin.py",
        "static/%2e%2e/plugin.py",
        "static/%2e%2e%2f%2e%2e%2fmpprof%2fschema.py",
        "static//etc/passwd",
        "static/subdir/../index.js",
        "static/nonexistent.js",
        "static/",
    ],
)
def test_static_files_are_safe_from_path_traversal(client, path):
    response = client.get(ROUTE + path)
    assert response.status_code == 404
    assert b"import" not in response.get_data()


def test_static_files_and_plotly_are_served(client):
    index = client.get(ROUTE + "index.js")
    assert index.status_code == 200
    assert index.headers["Content-Type"].startswith("text/javascript")
    assert b"export async function render" in index.get_data()
    assert client.get(ROUTE + "static/style.css").status_code == 200
    plotly = client.get(ROUTE + "plotly.min.js", headers={"Accept-Encoding": "gzip"})
    assert plotly.status_code == 200 and plotly.headers["Content-Encoding"] == "gzip"
    shipped = pathlib.Path(plotly_package.__file__).parent / "package_data" / "plotly.min.js"
    assert gzip.decompress(plotly.get_data()) == shipped.read_bytes()


def test_routes_see_new_data_written_while_training_runs(logdir, tmp_path):
    copy = tmp_path / "live"
    shutil.copytree(logdir / HOSTILE_NAME, copy / HOSTILE_NAME)
    client = tensorboard_client(copy)
    before = get_json(client, "loss_scale", run=FLOAT16_RUN)
    last = before["series"]["step"][-1]
    writer = RecordWriter(copy / FLOAT16_RUN)
    overflow = [[last + 10, 64.0, 32.0, schema.EVENT_OVERFLOW]]
    writer.write_array(schema.LOSS_SCALE_EVENTS, overflow, step=last + 10)
    writer.close()
    after = get_json(client, "loss_scale", run=FLOAT16_RUN)
    assert after["overflows"]["total"] == before["overflows"]["total"] + 1
    assert after["overflows"]["step"][-1] == last + 10


# ---------------------------------------------------------------- bad input


def test_malformed_records_leave_every_run_listed(tmp_path):
    client = tensorboard_client(malformed_logdir(tmp_path))
    listed = {r["run"]: r for r in get_json(client, "runs")["runs"]}
    assert sorted(listed) == sorted(f"{name}/train" for name in MALFORMED)
    for name, (record, _) in MALFORMED.items():
        run = f"{name}/train"
        assert listed[run]["model_policy"] == "mixed_float16" and listed[run]["warnings"] == 1
        (warning,) = get_json(client, "context", run=run)["warnings"]
        assert f"{schema.tag_for(record)} at step {BAD_STEP}" in warning
        codes = [f["code"] for f in get_json(client, "findings", run=run)["findings"]]
        assert codes == ["MP011"]  # policy_max=0 made no layer "overflow"


def test_a_symlink_loop_lists_a_run_once(tmp_path):
    copy_run("storm", tmp_path / "storm")
    (tmp_path / "self").symlink_to(".")
    listed = [r["run"] for r in get_json(tensorboard_client(tmp_path), "runs")["runs"]]
    assert listed == ["storm/train"]


_UNREADABLE_SCRIPT = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
from test_plugin_routes import ROUTE, tensorboard_client
logdir = sys.argv[2]
client = tensorboard_client(logdir)
# Locked once TensorBoard's own multiplexer has loaded (it stops at an
# unreadable directory by itself); mpprof's routes list the logdir on demand.
os.chmod(os.path.join(logdir, "lost+found"), 0)
def get(route, **params):
    response = client.get(ROUTE + route, query_string=params)
    return response.status_code, response.get_data(as_text=True)
answers = {"runs": get("runs"), "context": get("context", run="storm/train"),
           "locked": get("context", run="lost+found")}
os.chmod(os.path.join(logdir, "later", "train"), 0)  # listed, then unreadable
answers["later"] = get("context", run="later/train")
answers["runs_after"] = get("runs")
print(json.dumps(answers))
"""


def test_an_unreadable_directory_does_not_break_the_routes(tmp_path):
    """Real permissions: the server runs without root's override."""
    copy_run("storm", tmp_path / "storm")
    copy_run("storm", tmp_path / "later")
    locked = tmp_path / "lost+found"
    locked.mkdir()
    tests = pathlib.Path(__file__).parent
    try:
        result = subprocess.run(
            without_root_privileges(
                [sys.executable, "-c", _UNREADABLE_SCRIPT, str(tests), str(tmp_path)]
            ),
            capture_output=True, text=True, timeout=300,
        )
    finally:
        locked.chmod(0o755)
        (tmp_path / "later" / "train").chmod(0o755)
    assert result.returncode == 0, result.stderr[-3000:]
    answers = json.loads(result.stdout.splitlines()[-1])
    status, body = answers["runs"]
    assert status == 200
    assert [r["run"] for r in json.loads(body)["runs"]] == ["later/train", "storm/train"]
    assert answers["context"][0] == 200
    assert answers["locked"][0] == 404
    status, body = answers["later"]
    assert status == 404 and "cannot be read (Permission denied)" in body
    status, body = answers["runs_after"]
    assert status == 200 and [r["run"] for r in json.loads(body)["runs"]] == ["storm/train"]


def _served_json(url: str):
    with urllib.request.urlopen(url, timeout=60) as response:
        return json.loads(response.read())


def test_logdir_spec_runs_are_tensorboards_runs_in_the_tab(tmp_path):
    """`tensorboard --logdir_spec a:DIR1,b:DIR2` (no --logdir): the tab lists
    the runs Scalars lists, under TensorBoard's names, and serves them."""
    first, second = tmp_path / "first", tmp_path / "second"
    shutil.copytree(diagnosis_runs.logdir("forward_overflow"), first)  # run a/train
    # Records at the spec's directory itself: TensorBoard names the run "b/.".
    shutil.copytree(diagnosis_runs.logdir("healthy_float32") / "train", second)
    with serve_tensorboard(flags=("--logdir_spec", f"a:{first},b:{second}")) as url:
        deadline = time.monotonic() + 60
        while len(tensorboard_runs := _served_json(url + "data/runs")) < 2:
            assert time.monotonic() < deadline, tensorboard_runs
            time.sleep(0.5)
        assert _served_json(url + "data/plugins_listing")["mpprof"]["enabled"]
        listed = [r["run"] for r in _served_json(url + "data/plugin/mpprof/runs")["runs"]]
        assert sorted(listed) == sorted(tensorboard_runs) == ["a/train", "b/."]
        findings = _served_json(url + "data/plugin/mpprof/findings?run=a/train")
        assert "MP003" in [f["code"] for f in findings["findings"]]
        context = _served_json(url + "data/plugin/mpprof/context?run=b/.")
        assert context["run"] == "b/." and context["context"]["fit_state"] == "ended"


def test_a_run_directory_whose_name_is_not_utf8_is_served_by_every_run_route(tmp_path):
    """`bad\\xff\\xfe` is listed by /runs (Python's surrogate escapes, sent as
    JSON escapes); a URL cannot carry those code units (they arrive as
    U+FFFD), so the tab sends such a name as its JSON text, `run_json`, which
    every per-run route reads back exactly."""
    name = os.fsdecode(b"bad\xff\xfe")
    copy_run("healthy_mixed", tmp_path / name)
    copy_run("healthy_mixed", tmp_path / "good")
    # TensorBoard's own listing (TensorFlow's gfile) fails on such a name:
    # the plugin alone, as when it lists the runs itself.
    from tensorboard_plugin_mpprof.routes import MpprofPlugin

    plugin = MpprofPlugin(base_plugin.TBContext(logdir=str(tmp_path)))
    client = werkzeug_test.Client(application.TensorBoardWSGI([plugin]))
    listed = [r["run"] for r in get_json(client, "runs")["runs"]]
    assert sorted(listed) == sorted([f"{name}/train", "good/train"])
    routes = {"context": {}, "findings": {}, "inventory": {}, "loss_scale": {}, "gpu": {},
              "float8": {}, "numerics": {"direction": "forward", "stat": "abs_max"}}
    for route, params in routes.items():
        for run in listed:  # the look-alike with a UTF-8 name goes the same way
            payload = get_json(client, route, run_json=json.dumps(run), **params)
            assert payload.get("run", run) == run, route
    mangled = f"{name}/train".encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    assert client.get(ROUTE + "context", query_string={"run": mangled}).status_code == 404
    response = client.get(ROUTE + "context", query_string={"run_json": "{not json"})
    assert response.status_code == 400
