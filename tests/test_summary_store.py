"""The run list's summaries saved between TensorBoard restarts
(`tensorboard_plugin_mpprof.summary_store`): trusted while a run's files and
mpprof's code are unchanged, never written into the logdir."""

from __future__ import annotations

import json
import shutil

import diagnosis_runs
import pytest
from tensorboard.plugins import base_plugin
from werkzeug import test as werkzeug_test

from mpprof.display import run_digest
from mpprof.records import reader, schema
from mpprof.records.writer import RecordWriter
from tensorboard_plugin_mpprof import routes, summary_store


@pytest.fixture
def logdir(tmp_path, monkeypatch):
    monkeypatch.setenv("MPPROF_SUMMARY_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "logs"
    shutil.copytree(diagnosis_runs.logdir("storm"), root / "storm")
    shutil.copytree(diagnosis_runs.logdir("healthy_float32"), root / "healthy")
    # Runs without their fit's digest (`run_digest`; recorded by an older
    # mpprof, or a fit still running): the store is what spares their reads.
    for digest in root.rglob(run_digest.NAME):
        digest.unlink()
    return root


def runs_of(logdir) -> list[dict]:
    """/runs of a new plugin on `logdir`: a TensorBoard just started."""
    plugin = routes.MpprofPlugin(base_plugin.TBContext(logdir=str(logdir)))
    response = werkzeug_test.Client(plugin.get_plugin_apps()["/runs"]).get("/runs")
    assert response.status_code == 200
    return json.loads(response.get_data())["runs"]


def test_a_restarted_tensorboard_reads_no_unchanged_run(logdir, reads, tmp_path):
    first = runs_of(logdir)
    assert sorted(reads) == ["healthy/train", "storm/train"]
    reads.clear()
    assert runs_of(logdir) == first
    assert reads == []
    # Nothing was written into the logdir; one file in the cache folder.
    assert sorted(p.name for p in (logdir / "storm" / "train").iterdir()) == sorted(
        p.name for p in (diagnosis_runs.logdir("storm") / "train").iterdir()
        if p.name != run_digest.NAME)
    assert len(list((tmp_path / "cache").iterdir())) == 1


def test_a_run_whose_files_changed_is_read_again(logdir, reads):
    before = {run["run"]: run for run in runs_of(logdir)}
    assert before["storm/train"]["fit_state"] == "ended"
    reads.clear()
    # The fit goes on: a record more in its event file (a new writer's file).
    writer = RecordWriter(str(logdir / "storm" / "train"))
    writer.write_json(schema.RUN_CONTEXT, {**reader.read_run(
        logdir, "storm/train").context.record, "fit_state": "running"}, 10_000)
    writer.close()
    reads.clear()
    after = {run["run"]: run for run in runs_of(logdir)}
    assert reads == ["storm/train"]
    # Its summary is the new one: a fit that has not recorded its end.
    assert after["storm/train"]["fit_state"] != "ended"
    assert after["healthy/train"] == before["healthy/train"]


def test_other_code_or_a_damaged_store_is_not_trusted(logdir, reads, monkeypatch):
    first = runs_of(logdir)
    reads.clear()
    monkeypatch.setattr(summary_store, "_code_fingerprint", lambda: "another mpprof")
    assert runs_of(logdir) == first
    assert sorted(reads) == ["healthy/train", "storm/train"]
    (path,) = (logdir.parent / "cache").iterdir()
    path.write_text('{"format": 1, "code": "another mpprof", "runs": [')
    reads.clear()
    assert runs_of(logdir) == first
    assert len(reads) == 2


def test_off_keeps_nothing(logdir, reads, monkeypatch):
    monkeypatch.setenv("MPPROF_SUMMARY_CACHE", "off")
    runs_of(logdir)
    reads.clear()
    runs_of(logdir)
    assert len(reads) == 2
    assert not (logdir.parent / "cache").exists()
