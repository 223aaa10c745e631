"""The reader on its own: run names, versions, live and broken files."""

import os
import shutil

import numpy as np
import pytest
from broken_logdirs import (
    BAD_STEP,
    MALFORMED,
    copy_run,
    event_file,
    flip_loss_scale_step_bit,
    newer_schema_run,
    write_malformed,
    write_record,
    zeros_run,
)
from conftest import ScaleProbe, overflow_data, overflow_model
from diagnosis_runs import logdir

import mpprof
from mpprof.records import reader, schema
from mpprof.records import writer as writer_module
from mpprof.records.writer import RecordWriter


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
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) - 7])
    cut = reader.read_run(tmp_path, "train")
    assert any("incomplete record" in w for w in cut.warnings)
    assert cut.inventory == complete.inventory
    np.testing.assert_array_equal(cut.loss_scale.overflow_steps,
                                  complete.loss_scale.overflow_steps)




def test_loss_scale_series_is_the_optimizers_scale_step_by_step(tmp_path):
    """The series' vertices are where the optimizer's scale changed, as a
    probe read it after every batch of the same fit; the steps since the last
    overflow count from the last step whose update was skipped."""
    model = overflow_model(growth_steps=4)
    probe = ScaleProbe()
    x, y = overflow_data()
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False,
              callbacks=[mpprof.MixedPrecisionProfiler(log_dir=str(tmp_path)), probe])
    scales = np.array(probe.scales)  # the scale after step i
    changed = np.flatnonzero(scales != np.concatenate([[2.0**30], scales[:-1]]))
    last = len(scales) - 1
    vertex_steps = [-1, *changed.tolist(), *([last] if changed[-1] != last else [])]
    vertex_scales = [2.0**30, *scales[vertex_steps[1:]].tolist()]
    skipped = np.flatnonzero(np.diff(np.concatenate([[0], probe.iterations])) == 0)
    assert len(changed) > 5 and len(skipped) > 5 and len(skipped) < len(changed)  # a storm

    loss_scale = reader.read_run(tmp_path, "train").loss_scale
    steps, series = loss_scale.series()
    assert steps.tolist() == vertex_steps and series.tolist() == vertex_scales
    np.testing.assert_array_equal(loss_scale.scale_after(np.arange(len(scales))), scales)
    assert loss_scale.steps_since_last_overflow == last - skipped[-1]


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_malformed_record_is_skipped_with_a_warning_naming_tag_and_step(tmp_path, name):
    run_dir = copy_run("healthy_mixed", tmp_path)
    good = reader.read_run(tmp_path, "train")
    write_malformed(run_dir, name)
    read = reader.read_run(tmp_path, "train")
    record, _ = MALFORMED[name]
    (warning,) = read.warnings
    assert f"{schema.tag_for(record)} at step {BAD_STEP}" in warning
    assert "malformed record" in warning and warning.endswith("skipped")
    # What the run said before the bad record is what it says now.
    assert read.context == good.context and read.health == good.health
    np.testing.assert_array_equal(read.loss_scale.events, good.loss_scale.events)
    np.testing.assert_array_equal(read.loss_scale.progress, good.loss_scale.progress)
    assert read.numerics.policy_max == good.numerics.policy_max == schema.FLOAT16_MAX
    assert read.numerics.variables == good.numerics.variables


@pytest.mark.parametrize("name", ["healthy_mixed", "storm", "forward_overflow", "nan_weights"])
def test_real_runs_pass_validation_untouched(name):
    """Look-alikes of the malformed records (NaN losses, non-finite weights,
    overflowing layers) are data, not damage: nothing is skipped."""
    read = reader.read_run(logdir(name), "train")
    assert read.warnings == []
    assert read.readable and read.cut_short is None


def test_a_flipped_bit_fails_its_checksum(tmp_path):
    run_dir = copy_run("storm", tmp_path)
    good = reader.read_run(tmp_path, "train").loss_scale
    flipped = flip_loss_scale_step_bit(event_file(run_dir))
    assert flipped > 1e20  # what the reader would have believed
    read = reader.read_run(tmp_path, "train")
    (warning,) = read.warnings
    assert "corrupt record at byte" in warning and "checksum" in warning
    # Only the damaged record is lost; no step beyond what really ran.
    assert read.loss_scale.steps_run <= good.steps_run
    assert not (read.loss_scale.events[:, 0] >= good.steps_run).any()
    assert read.inventory is not None and read.context == reader.read_run(
        logdir("storm"), "train").context


def test_a_logdir_of_a_newer_mpprof_says_so_once(tmp_path, monkeypatch):
    newer_schema_run(tmp_path / "train", monkeypatch, records=50)
    run = reader.read_run(tmp_path, "train")
    assert not run.readable
    (warning,) = run.warnings
    assert "upgrade mpprof" in warning and "49 more records" in warning


def test_a_file_of_zeros_is_corrupt_not_empty(tmp_path):
    zeros_run(tmp_path / "train")
    run = reader.read_run(tmp_path, "train")
    assert not run.readable
    (warning,) = run.warnings
    assert "corrupt record at byte 0" in warning


def test_entries_that_are_not_regular_files_are_skipped(tmp_path):
    copy_run("healthy_mixed", tmp_path)
    suffix = "events.out.tfevents.9.host" + schema.EVENT_FILE_SUFFIX
    os.mkfifo(tmp_path / "train" / suffix)  # opening it would wait for a writer
    (tmp_path / "gone").mkdir()
    (tmp_path / "gone" / suffix).symlink_to(tmp_path / "nowhere")
    warnings = []
    assert reader.list_runs(tmp_path, warnings.append) == ["train"]
    assert sorted(w.split(": ")[1] for w in warnings) == [
        "neither a regular file nor a directory; skipped"
    ] * 2
    assert reader.read_run(tmp_path, "train").warnings == []


def test_symlinks_into_the_logdir_are_not_followed(tmp_path):
    copy_run("healthy_mixed", tmp_path / "a")
    (tmp_path / "self").symlink_to(".")
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    copy_run("healthy_mixed", outside)
    (outside / "loop").symlink_to(outside)
    (tmp_path / "linked").symlink_to(outside)
    # A run outside the logdir, linked into it, is read once; loops are not.
    assert reader.list_runs(tmp_path) == ["a/train", "linked/train"]
    assert reader.read_run(tmp_path, "linked/train").readable


def test_a_remote_logdir_is_read_through_tensorflow_file_systems():
    """`scheme://` paths go through tf.io.gfile (here its in-memory ram://)."""
    source = reader.read_run(logdir("storm"), "train")
    writer = RecordWriter("ram://mpprof-remote/run/train")
    for record, found in source.records.items():
        for item in found:
            if isinstance(item.value, dict):
                writer.write_json(record, item.value, item.step)
            else:
                writer.write_array(record, item.value, item.step)
    writer.close()
    assert reader.list_runs("ram://mpprof-remote") == ["run/train"]
    remote = reader.read_run("ram://mpprof-remote", "run/train")
    assert remote.warnings == [] and remote.context == source.context
    np.testing.assert_array_equal(remote.loss_scale.events, source.loss_scale.events)


# ---------------------------------------------------------------- cut short


def test_a_run_without_fit_state_or_ended_is_not_cut_short(tmp_path):
    run_dir = copy_run("healthy_mixed", tmp_path)
    assert reader.read_run(tmp_path, "train").cut_short is None  # logs before fit_state
    context = reader.read_run(tmp_path, "train").context
    write_record(run_dir, schema.RUN_CONTEXT, {**context, "fit_state": "ended"}, 16)
    assert reader.read_run(tmp_path, "train").cut_short is None


@pytest.mark.parametrize("state", ["running", "failed"])
def test_a_run_that_never_ended_is_cut_short_at_its_last_record(tmp_path, state):
    """The callback rewrites the context with fit_state "running" at each
    flush; a killed fit leaves it so, with records of later steps."""
    run_dir = copy_run("healthy_mixed", tmp_path)
    good = reader.read_run(tmp_path, "train")
    last_step, _ = good.last_record
    write_record(run_dir, schema.RUN_CONTEXT, {**good.context, "fit_state": state}, last_step)
    scale = good.loss_scale.final_scale
    write_record(run_dir, schema.LOSS_SCALE_PROGRESS, [last_step + 40, scale, 0.0],
                 last_step + 40)
    run = reader.read_run(tmp_path, "train")
    stopped = run.cut_short
    assert stopped["fit_state"] == state and stopped["step"] == last_step + 40
    newest = max(r.wall_time for records in run.records.values() for r in records)
    assert stopped["wall_time"] == newest
    assert run.loss_scale.steps_run == last_step + 40  # from the latest records
