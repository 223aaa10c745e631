"""Logdirs as a sweep makes them, read without a framework: odd run names,
many runs, concurrent writers, what `diagnose --format json` says of each run,
and the HTML report's escaping. Runs are written with `RecordWriter` (the
callback's own writer); the plugin is served by TensorBoard's WSGI app."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import pytest
from tensorboard.backend import application
from tensorboard.plugins import base_plugin
from werkzeug import test as werkzeug_test

from mpprof import cli
from mpprof.records import reader, schema
from mpprof.records.writer import RecordWriter
from tensorboard_plugin_mpprof import run_cache
from tensorboard_plugin_mpprof.plugin import MpprofPluginLoader
from tensorboard_plugin_mpprof.routes import MpprofPlugin

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from synthetic_logdir import write_synthetic_run

ROUTE = "/data/plugin/mpprof/"


def small_run(run_dir, *, steps: int = 40, scale: float = 2.0**15, fit_state="ended",
              model_policy: str = "mixed_float16", optimizer: str = "LossScaleOptimizer") -> None:
    """A run as the callback leaves it: context, loss-scale progress."""
    writer = RecordWriter(run_dir)
    writer.write_json(schema.RUN_CONTEXT, {
        "model_policy": model_policy, "global_policy": model_policy,
        "optimizer": optimizer, "fit_state": fit_state}, 0)
    writer.write_array(schema.LOSS_SCALE_PROGRESS, [steps, scale, 0.0], steps)
    writer.close()


def plugin_client(logdir) -> werkzeug_test.Client:
    """TensorBoard's WSGI app serving only the mpprof plugin over `logdir`
    (the plugin reads the logdir itself; no event multiplexer needed)."""
    plugin = MpprofPluginLoader().load(base_plugin.TBContext(logdir=str(logdir)))
    return werkzeug_test.Client(application.TensorBoardWSGI([plugin]))


def get_json(client, route: str, **params):
    response = client.get(ROUTE + route, query_string=params)
    assert response.status_code == 200, response.get_data(as_text=True)
    return json.loads(response.get_data())


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpprof.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


# ------------------------------------------------------- fault 1: run names


def test_a_run_name_with_a_backslash_is_read_everywhere(tmp_path):
    small_run(tmp_path / "sweep\\lr=0.1" / "train")
    small_run(tmp_path / "plain" / "train")
    runs = reader.read_logdir(tmp_path)
    assert sorted(runs) == ["plain/train", "sweep\\lr=0.1/train"]
    assert runs["sweep\\lr=0.1/train"].readable
    for command in ("summary", "diagnose", "report"):
        extra = ["-o", tmp_path / "r.html"] if command == "report" else []
        done = run_cli(command, tmp_path, *extra)
        assert done.returncode == cli.EXIT_OK, (command, done.stderr)
    assert "sweep\\lr=0.1/train" in run_cli("summary", tmp_path).stdout
    names = [r["run"] for r in get_json(plugin_client(tmp_path), "runs")["runs"]]
    assert sorted(names) == ["plain/train", "sweep\\lr=0.1/train"]
    context = get_json(plugin_client(tmp_path), "context", run="sweep\\lr=0.1/train")
    assert context


@pytest.mark.parametrize("name", ["..\\..\\etc", "a\\..\\b"])
def test_a_backslash_name_that_is_not_a_run_is_still_refused(tmp_path, name):
    small_run(tmp_path / "train")
    with pytest.raises(reader.NoMpprofDataError):
        reader.read_run(tmp_path, name)


# ------------------------------------------- fault 6: the report's run names


def test_the_html_report_escapes_bidi_overrides_and_controls_of_run_names(tmp_path):
    hostile = "evil\u202egnp.exe\x1b[2J"
    small_run(tmp_path / hostile / "train")
    output = tmp_path / "report.html"
    done = run_cli("report", tmp_path, "-o", output, "-q")
    assert done.returncode == cli.EXIT_OK, done.stderr
    page = output.read_text(encoding="utf-8")
    head, _, rest = page.partition('<script type="application/json" id="mpprof-data">')
    data, _, tail = rest.partition("</script>")
    for text in (head, tail, json.dumps(json.loads(data), ensure_ascii=False)):
        assert "\u202e" not in text and "\x1b" not in text
    assert "evil\\u202egnp.exe\\x1b[2J/train" in head


# --------------------------------------- fault 5: diagnose's JSON, every run


def test_diagnose_json_says_each_run_s_fit_state_and_lists_unreadable_runs(tmp_path):
    small_run(tmp_path / "ended" / "train")
    write_synthetic_run(tmp_path / "killed" / "train", steps=4000, layers=3, samples=4)
    small_run(tmp_path / "killed" / "train", fit_state="running", steps=4000)
    small_run(tmp_path / "raised" / "train", fit_state="failed")
    (tmp_path / "corrupt" / "train").mkdir(parents=True)
    name = "events.out.tfevents.1.host.1.0" + schema.EVENT_FILE_SUFFIX
    (tmp_path / "corrupt" / "train" / name).write_bytes(b"\0" * 64)
    done = run_cli("diagnose", tmp_path, "--format", "json-runs")
    assert done.returncode == cli.EXIT_UNREADABLE, done.stderr
    runs = {r["run"]: r for r in json.loads(done.stdout)["runs"]}
    assert set(runs) == {"ended/train", "killed/train", "raised/train", "corrupt/train"}
    assert runs["ended/train"]["fit_state"] == "ended"
    assert runs["killed/train"]["fit_state"] == "cut_short"
    assert runs["killed/train"]["cut_short"]["step"] == 4000
    assert runs["killed/train"]["findings"]
    assert runs["raised/train"]["fit_state"] == "failed"
    assert runs["corrupt/train"]["readable"] is False and runs["corrupt/train"]["warnings"]
    rows = json.loads(run_cli("diagnose", tmp_path, "--format", "json").stdout)
    assert {row["fit_state"] for row in rows if row["run"] == "killed/train"} == {"cut_short"}


# ------------------------------------------------------- build 1: many runs


def test_a_sweep_is_read_once_then_only_what_changed(tmp_path, monkeypatch, caplog):
    for i in range(30):
        small_run(tmp_path / f"lr_{i:03d}" / "train", steps=10 + i)
    monkeypatch.setattr(run_cache, "_RUN_LIST_TTL_S", 0.0)  # every request walks
    # A budget below one run's read: full reads are dropped, summaries stay.
    monkeypatch.setenv("MPPROF_CACHE_MB", "0")
    reads = []
    real_read = reader.read_run
    monkeypatch.setattr(run_cache.reader, "read_run",
                        lambda logdir, run: reads.append(run) or real_read(logdir, run))
    plugin = MpprofPlugin(base_plugin.TBContext(logdir=str(tmp_path)))
    client = werkzeug_test.Client(application.TensorBoardWSGI([plugin]))
    with caplog.at_level("WARNING"):
        first = get_json(client, "runs")["runs"]
    assert [r["run"] for r in first] == [f"lr_{i:03d}/train" for i in range(30)]
    assert first[7]["loss_scale"]["steps_run"] == 17
    assert len(reads) == 30 and "mpprof: reading 30 runs" in caplog.text
    assert "mpprof: read 30 runs in" in caplog.text
    assert get_json(client, "runs")["runs"] == first and len(reads) == 30
    assert plugin._runs.cached_bytes < 200_000  # one full read kept, not 30
    # One run grows (a fit writing into it): only it is read again.
    writer = RecordWriter(tmp_path / "lr_007" / "train")
    writer.write_array(schema.LOSS_SCALE_PROGRESS, [500, 2.0**15, 0.0], 500)
    writer.close()
    again = get_json(client, "runs")["runs"]
    assert reads[30:] == ["lr_007/train"] and again[7]["loss_scale"]["steps_run"] == 500
    # A run removed from the sweep leaves the list.
    shutil.rmtree(tmp_path / "lr_000")
    assert len(get_json(client, "runs")["runs"]) == 29 and len(reads) == 31
