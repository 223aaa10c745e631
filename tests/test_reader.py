"""The reader on its own: run names, versions, live and broken files."""

import shutil

import numpy as np
import pytest

from mpprof import reader, schema
from mpprof import writer as writer_module
from mpprof.writer import RecordWriter


def test_lists_nested_runs_and_only_mpprof_files(tmp_path):
    for run in ("a/train", "b/train"):
        writer = RecordWriter(tmp_path / run)
        writer.write_json(schema.RUN_CONTEXT, {"model_policy": "float32"}, 0)
        writer.close()
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "events.out.tfevents.1.host.v2").write_bytes(b"not ours")
    assert reader.list_runs(tmp_path) == ["a/train", "b/train"]
    assert reader.read_run(tmp_path, "a/train").context == {"model_policy": "float32"}


@pytest.mark.parametrize("name", ["/etc", "../x", "a/../../etc", "a//train", "c"])
def test_names_that_are_not_runs_are_refused(tmp_path, name):
    writer = RecordWriter(tmp_path / "a" / "train")
    writer.write_json(schema.RUN_CONTEXT, {}, 0)
    writer.close()
    (tmp_path / "c").mkdir()
    with pytest.raises(reader.NoMpprofDataError):
        reader.read_run(tmp_path, name)


def test_missing_logdir_and_empty_logdir(tmp_path):
    with pytest.raises(reader.LogdirNotFoundError, match="does not exist"):
        reader.read_logdir(tmp_path / "nowhere")
    with pytest.raises(reader.NoMpprofDataError, match="MixedPrecisionProfiler"):
        reader.read_logdir(tmp_path)


def test_newer_schema_version_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(schema, "SCHEMA_VERSION", schema.SCHEMA_VERSION + 1)
    writer_module._metadata.cache_clear()  # the writer caches each record's metadata
    writer = RecordWriter(tmp_path / "train")
    writer.write_json(schema.RUN_CONTEXT, {"x": 1}, 0)
    writer.close()
    monkeypatch.undo()
    writer_module._metadata.cache_clear()
    run = reader.read_run(tmp_path, "train")
    assert run.context == {}
    assert any("upgrade mpprof" in w for w in run.warnings)


def test_a_record_cut_in_half_keeps_what_came_before(overflow_logdir, tmp_path):
    shutil.copytree(overflow_logdir, tmp_path, dirs_exist_ok=True)
    (path,) = reader.event_files(tmp_path, "train")
    complete = reader.read_run(tmp_path, "train")
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) - 7])
    cut = reader.read_run(tmp_path, "train")
    assert any("incomplete record" in w for w in cut.warnings)
    assert cut.inventory == complete.inventory
    np.testing.assert_array_equal(cut.loss_scale.overflow_steps,
                                  complete.loss_scale.overflow_steps)


def test_loss_scale_series_is_a_step_function(overflow_logdir):
    loss_scale = reader.read_run(overflow_logdir, "train").loss_scale
    steps, scales = loss_scale.series()
    assert steps[0] == loss_scale.first_step - 1 and scales[0] == loss_scale.initial_scale
    assert np.all(np.diff(steps) > 0)
    after = loss_scale.scale_after(steps)
    np.testing.assert_array_equal(after, scales)
    assert loss_scale.steps_since_last_overflow == (
        loss_scale.steps_run - 1 - loss_scale.overflow_steps[-1]
    )
