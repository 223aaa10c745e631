"""The reader on its own: run names, versions, live and broken files."""

import json
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
from mpprof.records import reader, schema, tfrecord
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
    warning, lost = read.warnings
    assert "corrupt record at byte" in warning and "checksum" in warning
    (loss,) = read.losses  # one record's bytes: the rest is read
    assert f"{loss.unreadable_bytes:,} of {loss.bytes:,} bytes (" in lost
    assert 0 < loss.unreadable_bytes < 1000 and not loss.stops_early
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
    warning, lost = run.warnings
    assert "corrupt record at byte 0" in warning and "(100%) unreadable" in lost


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


def test_a_remote_logdir_is_written_in_parts_and_read_through_fsspec():
    """`scheme://` paths go through fsspec (here its in-memory memory://): each
    flush writes one new object with only what it adds, and the run reads
    back joined, in order, like the local file."""
    import fsspec

    source = reader.read_run(logdir("storm"), "train")
    root = "memory://mpprof-remote-parts"
    writer = RecordWriter(f"{root}/run/train")
    flushes = 0
    for record, found in source.records.items():
        for item in found:
            if isinstance(item.value, dict):
                writer.write_json(record, item.value, item.step)
            else:
                writer.write_array(record, item.value, item.step)
        writer.flush()
        flushes += 1
    writer.flush()  # nothing new: no object
    writer.close()
    fs = fsspec.filesystem("memory")
    names = sorted(path.rsplit("/", 1)[-1] for path in fs.ls(f"{root}/run/train", detail=False))
    parts = [name for name in names if schema.PART_MARK in name]
    assert len(parts) == 1 + flushes  # the writer's start, then one per flush
    assert parts == [schema.part_name(writer.path.rsplit("/", 1)[-1], i)
                     for i in range(len(parts))]
    # Each part is a complete event file: the first record of each is the
    # file-version event, and no part repeats another's records.
    import io

    from tensorboard.compat.proto import event_pb2

    from mpprof.records import tfrecord

    for name in parts:
        frames = list(tfrecord.read_frames(io.BytesIO(fs.cat_file(f"{root}/run/train/{name}"))))
        assert all(frame.problem is None for frame in frames)
        assert event_pb2.Event.FromString(frames[0].payload).file_version == "brain.Event:2"
    assert reader.list_runs(root) == ["run/train"]
    remote = reader.read_run(root, "run/train")
    assert remote.warnings == [] and remote.context == source.context
    np.testing.assert_array_equal(remote.loss_scale.events, source.loss_scale.events)
    for record, found in source.records.items():
        assert [r.step for r in remote.records[record]] == [r.step for r in found]


def test_a_remote_run_read_again_fetches_only_its_new_parts(monkeypatch):
    import fsspec

    root = "memory://mpprof-remote-reread"
    writer = RecordWriter(f"{root}/train")
    writer.write_json(schema.RUN_CONTEXT, {"fit_state": "running"}, 0)
    writer.flush()
    reuse = reader.FileReads()
    first = reader.read_run(root, "train", reuse)
    fetched = []
    fs = fsspec.filesystem("memory")
    original = type(fs).cat_file

    def counting(self, path, *args, **kwargs):
        fetched.append(path.rsplit("/", 1)[-1])
        return original(self, path, *args, **kwargs)

    monkeypatch.setattr(type(fs), "cat_file", counting)
    writer.write_json(schema.RUN_CONTEXT, {"fit_state": "ended"}, 5)
    writer.flush()
    again = reader.read_run(root, "train", reuse)
    # The new part, and the writer's 1 KiB fit-end file (rewritten in place).
    parts = [name for name in fetched if "tfevents" in name]
    assert parts == [schema.part_name(writer.path.rsplit("/", 1)[-1], 2)]
    assert len(fetched) == 2
    assert first.context["fit_state"] == "running" and again.context["fit_state"] == "ended"
    assert [r.step for r in again.records[schema.RUN_CONTEXT]] == [0, 5]
    fetched.clear()
    reader.read_run(root, "train", reuse)
    assert [name for name in fetched if "tfevents" in name] == []  # nothing new
    writer.close()


def test_a_remote_run_of_many_parts_is_fetched_in_batches(monkeypatch):
    """Each part is one object: reading them one request after another would
    cost a round trip per flush; they are fetched a batch at a time."""
    import fsspec

    root = "memory://mpprof-remote-batches"
    writer = RecordWriter(f"{root}/train")
    for step in range(300):
        writer.write_array(schema.LOSS_SCALE_PROGRESS, [step, 2.0**15, 0.0], step)
        writer.flush()
    writer.close()
    batches = []
    fs = fsspec.filesystem("memory")
    original = type(fs).cat

    def counting(self, path, *args, **kwargs):
        batches.append(len(path) if isinstance(path, list) else 1)
        return original(self, path, *args, **kwargs)

    monkeypatch.setattr(type(fs), "cat", counting)
    for reuse in (None, reader.FileReads()):
        batches.clear()
        run = reader.read_run(root, "train", reuse)
        assert [r.step for r in run.records[schema.LOSS_SCALE_PROGRESS]] == list(range(300))
        assert batches == [128, 128, 45]  # 301 parts: the writer's start, then 300 flushes


def test_an_unknown_scheme_is_one_line_naming_it():
    with pytest.raises(reader.LogdirNotFoundError) as raised:
        reader.list_runs("nosuchscheme://bucket/logs")
    assert "nosuchscheme://" in str(raised.value) and "\n" not in str(raised.value)


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


def _frame_offsets(path) -> list[int]:
    with open(path, "rb") as f:
        return [frame.offset for frame in tfrecord.read_frames(f)]


def test_a_flipped_length_says_how_much_was_lost_and_cuts_the_run_short(tmp_path, capsys):
    """A length that fails its checksum ends the file's reading there: the
    warning says how many bytes (and what share) of the file were lost, the
    run is cut short at its last readable record although the fit ended, and
    the CLI and the tab's /runs say so alike."""
    from mpprof import cli, diagnosis
    from mpprof.display import run_digest

    run_dir = copy_run("storm", tmp_path)
    path = event_file(run_dir)
    data = bytearray(path.read_bytes())
    offsets = _frame_offsets(path)
    at = offsets[len(offsets) // 3]
    data[at] ^= 0x01  # the record's length: its checksum fails
    path.write_bytes(bytes(data))
    run = reader.read_run(tmp_path, "train")
    lost = len(data) - at
    share = round(100 * lost / len(data))
    assert f"{lost:,} of {len(data):,} bytes ({share}%) unreadable" in "\n".join(run.warnings)
    assert run.fit_ends[-1]["fit_state"] == "ended"  # the fit itself ended
    assert run.cut_short is not None and run.cut_short["step"] == run.last_record[0]
    assert f"{share}%" in run.cut_short["unreadable"]
    assert run.fit_outcome == "cut_short"
    code = cli.main(["diagnose", str(tmp_path), "--format", "json-runs"])
    (listed,) = json.loads(capsys.readouterr().out)["runs"]
    assert code in (cli.EXIT_OK, cli.EXIT_FINDINGS)
    row = run_digest.run_summary(run, diagnosis.evaluate(run))
    assert (row["fit_state"], row["cut_short"]) == (listed["fit_state"], listed["cut_short"])
    assert listed["fit_state"] == "cut_short"
    cli.main(["summary", str(tmp_path)])
    assert f"the records after it could not be read ({path}: {lost:,}" in capsys.readouterr().out


def test_records_that_fail_their_checksums_never_pass_a_fail_on_gate(tmp_path, capsys):
    """Half the records' data fails its checksum: each is skipped, the warning
    says how many bytes that is, and `diagnose --fail-on` exits 3 rather
    than pass what it could not read whole; without --fail-on the rest is
    diagnosed."""
    from mpprof import cli

    run_dir = copy_run("storm", tmp_path)
    path = event_file(run_dir)
    data = bytearray(path.read_bytes())
    offsets = _frame_offsets(path)
    for offset in offsets[1:len(offsets) // 2]:
        data[offset + 12] ^= 0xFF  # the first byte of the record's data
    path.write_bytes(bytes(data))
    run = reader.read_run(tmp_path, "train")
    assert run.readable and run.cut_short is None  # later records still read
    (loss,) = run.losses
    assert 0 < loss.unreadable_bytes < loss.bytes and not loss.stops_early
    assert cli.main(["diagnose", str(tmp_path), "--fail-on", "warning"]) == cli.EXIT_UNREADABLE
    err = capsys.readouterr().err
    assert "--fail-on does not pass a run it could not read whole" in err
    assert f"{loss.unreadable_bytes:,} of {loss.bytes:,} bytes" in err
    assert cli.main(["diagnose", str(tmp_path)]) in (cli.EXIT_OK, cli.EXIT_FINDINGS)
    capsys.readouterr()


def test_a_healthy_run_passes_a_fail_on_gate_as_before(tmp_path, capsys):
    from mpprof import cli

    copy_run("healthy_bfloat16", tmp_path)
    assert reader.read_run(tmp_path, "train").losses == []
    assert cli.main(["diagnose", str(tmp_path), "--fail-on", "critical"]) == cli.EXIT_OK
    capsys.readouterr()


def test_an_empty_event_file_beside_a_good_one_is_nothing(tmp_path, capsys):
    """A zero-length event file (a writer that never wrote, a copy cut at
    0 bytes) holds no record: no run of its own, no unreadable run."""
    from mpprof import cli

    run_dir = copy_run("storm", tmp_path)
    good = event_file(run_dir)
    fields = good.name.split(".")
    fields[3] = str(int(fields[3]) + 1)  # started a second into the good one
    fields[5] = "99999"  # another process
    (run_dir / ".".join(fields)).write_bytes(b"")
    assert reader.list_runs(tmp_path) == ["train"]
    assert reader.read_run(tmp_path, "train").warnings == []
    assert cli.main(["diagnose", str(tmp_path)]) in (cli.EXIT_OK, cli.EXIT_FINDINGS)
    assert "nothing readable" not in capsys.readouterr().err
