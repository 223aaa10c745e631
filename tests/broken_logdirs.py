"""Real logdirs, broken the ways users' logdirs break.

Each starts from a run written by real (small) training (`diagnosis_runs`)
and is damaged the way a disk, a crashed writer, a newer mpprof or a hostile
directory name would: a malformed but well-framed record written through the
schema writer, a flipped bit, a file of zeros, an unreadable directory, a
symlink loop.
"""

from __future__ import annotations

import math
import os
import pathlib
import shutil

import numpy as np
from diagnosis_runs import logdir
from tensorboard.compat.proto import event_pb2

from mpprof.records import reader, schema, tfrecord
from mpprof.records.writer import RecordWriter

# Every malformed record is written at this step, so warnings can be checked
# for naming it.
BAD_STEP = 7


def _layout(**changes) -> dict:
    layout = reader.read_run(logdir("healthy_mixed"), "train").latest(schema.NUMERICS_LAYOUT)
    return {**layout, **changes}


def _without(record: dict, key: str) -> dict:
    return {k: v for k, v in record.items() if k != key}


# name: (record, value). Each is well framed (valid checksums) but breaks
# what the schema promises; written after the run's own records, so a reader
# that took it would use it as the latest. JSON records are written as JSON
# whatever their value, array records as float64 arrays.
MALFORMED = {
    "events_wrong_shape": (schema.LOSS_SCALE_EVENTS, lambda: np.ones((2, 3))),
    "events_nan_step": (schema.LOSS_SCALE_EVENTS, lambda: [[math.nan, 4.0, 2.0, 0.0]]),
    "progress_inf_step": (schema.LOSS_SCALE_PROGRESS, lambda: [math.inf, 2.0, 0.0]),
    "context_not_a_dict": (schema.RUN_CONTEXT, lambda: ["mixed_float16"]),
    "health_not_a_dict": (schema.HEALTH, lambda: "healthy"),
    "layout_missing_keys": (schema.NUMERICS_LAYOUT, lambda: _without(_layout(), "variables")),
    "policy_max_zero": (schema.NUMERICS_LAYOUT, lambda: _layout(policy_max=0)),
    "policy_max_string": (schema.NUMERICS_LAYOUT, lambda: _layout(policy_max="65504")),
}
JSON_RECORDS = (schema.RUN_CONTEXT, schema.INVENTORY, schema.NUMERICS_LAYOUT, schema.HEALTH,
                schema.KERNEL_STATS)


def copy_run(source: str, destination: pathlib.Path) -> pathlib.Path:
    """A copy of the real run `source` (a `diagnosis_runs` name) at
    `destination/train`; returns that run directory."""
    shutil.copytree(logdir(source) / "train", destination / "train")
    return destination / "train"


def write_record(run_dir: pathlib.Path, record: str, value, step: int = BAD_STEP) -> None:
    """Writes one record into a new event file of `run_dir` through the
    schema writer, as the callback does."""
    writer = RecordWriter(run_dir)
    if record in JSON_RECORDS:
        writer.write_json(record, value, step)
    else:
        writer.write_array(record, value, step)
    writer.close()


def write_malformed(run_dir: pathlib.Path, name: str) -> None:
    """Appends the malformed record `name` (of `MALFORMED`) to `run_dir`."""
    record, value = MALFORMED[name]
    write_record(run_dir, record, value())


def malformed_logdir(root: pathlib.Path) -> pathlib.Path:
    """One copy of the healthy_mixed run per malformation, `root/<name>/train`."""
    for name in MALFORMED:
        write_malformed(copy_run("healthy_mixed", root / name), name)
    return root


def event_file(run_dir: pathlib.Path) -> pathlib.Path:
    (path,) = run_dir.glob("*tfevents*")
    return path


def flip_loss_scale_step_bit(path: pathlib.Path) -> float:
    """Flips one bit of the last overflow's step in the first loss-scale
    events record of `path` with a step of 2 or more, where a float64 step of
    20 becomes 20 * 2**64.

    Returns the step as the flipped bit makes it read.
    """
    data = bytearray(path.read_bytes())
    with open(path, "rb") as stream:
        frames = list(tfrecord.read_frames(stream))
    for frame in frames:
        event = event_pb2.Event.FromString(frame.payload)
        values = [v for v in event.summary.value
                  if v.tag == schema.tag_for(schema.LOSS_SCALE_EVENTS)]
        if not values:
            continue
        content = values[0].tensor.tensor_content
        rows = np.frombuffer(content, "<f8").reshape(-1, 4)
        late = np.flatnonzero(rows[:, 0] >= 2)  # steps whose exponent is set
        if not len(late):
            continue
        row = int(late[-1])
        start = frame.offset + 12 + frame.payload.index(content)
        top_byte = start + row * 32 + 7  # the float64's sign and exponent byte
        data[top_byte] ^= 0x04
        path.write_bytes(bytes(data))
        flipped = np.frombuffer(bytes(data[top_byte - 7 : top_byte + 1]), "<f8")[0]
        return float(flipped)
    raise AssertionError(f"no loss-scale events in {path}")


def newer_schema_run(run_dir: pathlib.Path, monkeypatch, records: int = 50) -> None:
    """A run written by an mpprof one schema version ahead: `records` records."""
    from mpprof.records import writer as writer_module

    monkeypatch.setattr(schema, "SCHEMA_VERSION", schema.SCHEMA_VERSION + 1)
    writer_module._metadata.cache_clear()  # the writer caches each record's metadata
    try:
        writer = RecordWriter(run_dir)
        writer.write_json(schema.RUN_CONTEXT, {"model_policy": "mixed_float16"}, 0)
        for step in range(records - 1):
            writer.write_array(schema.LOSS_SCALE_PROGRESS, [step, 2.0**15, 0.0], step)
        writer.close()
    finally:
        monkeypatch.undo()
        writer_module._metadata.cache_clear()


def zeros_run(run_dir: pathlib.Path) -> None:
    """A run whose one event file is 4 KiB of zeros (a crash before the
    file system wrote the data)."""
    run_dir.mkdir(parents=True)
    (run_dir / f"events.out.tfevents.1.host{schema.EVENT_FILE_SUFFIX}").write_bytes(
        bytes(4096)
    )


def without_root_privileges(command: list[str]) -> list[str]:
    """`command`, run so that file permissions apply to it.

    Tests run as root here and in CI, and root reads a `chmod 000` directory
    anyway: drop the capabilities that let it (root keeps its uid, so the
    test's own files stay readable). As another user, permissions already
    apply.
    """
    if os.geteuid() != 0:
        return command
    dropped = "-dac_override,-dac_read_search"
    return ["setpriv", "--bounding-set", dropped, "--inh-caps", dropped, *command]

