"""Reads one mpprof event file into `Record`s, trusting none of its bytes.

Each frame's checksums are verified (`mpprof.records.tfrecord`), each event parsed,
each summary value decoded without TensorFlow and checked against the schema
(`mpprof.records.validation`). What fails is skipped and counted in `ReadWarnings`,
one line per kind of problem however often it occurs. `mpprof.records.reader` calls
this for each event file of a run.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from typing import Any

import numpy as np
from tensorboard.compat.proto import event_pb2, types_pb2

from mpprof.records import filesystem, schema, tfrecord, validation


@dataclasses.dataclass(frozen=True)
class Record:
    step: int
    wall_time: float
    value: Any  # dict for JSON records, np.ndarray for arrays


def series_key(record: str, series: str | None) -> str:
    """The key of `Run.records` for one series of a record (see `schema.tag_for`)."""
    return record if series is None else record + schema.SERIES_SEPARATOR + series


@dataclasses.dataclass(frozen=True)
class Loss:
    """What could not be read of one event file.

    Attributes:
        file: the file, as warnings show it.
        unreadable_bytes: bytes of records skipped or never reached.
        bytes: the file's size.
        stops_early: whether the loss ends the file's records (a length
            that fails its checksum, a record cut short): every record after
            it is lost, so the run's records stop there.
    """

    file: str
    unreadable_bytes: int
    bytes: int
    stops_early: bool

    def describe(self) -> str:
        share = 100 * self.unreadable_bytes / self.bytes if self.bytes else 100.0
        shown = f"{share:.0f}" if share >= 10 else f"{share:.1f}"
        return f"{self.unreadable_bytes:,} of {self.bytes:,} bytes ({shown}%) unreadable"


class ReadWarnings:
    """The warnings of one run's read: one line per kind of problem.

    A logdir written by a newer mpprof, or a file of garbage, fails on every
    record: the user needs to hear it once, with how often and where first.
    """

    def __init__(self):
        self._kinds: dict[str, list] = {}  # kind -> [count, first full text]
        # What could not be read of each damaged file (`Loss`), by path.
        self.losses: dict[str, Loss] = {}

    def add(self, kind: str, text: str) -> None:
        entry = self._kinds.setdefault(kind, [0, text])
        entry[0] += 1

    def merge(self, other: ReadWarnings) -> None:
        """Adds `other`'s problems (those of another file of the run)."""
        for kind, (count, text) in other._kinds.items():
            self._kinds.setdefault(kind, [0, text])[0] += count
        self.losses.update(other.losses)

    def lines(self) -> list[str]:
        return [
            text if count == 1 else f"{text} (and {count - 1:,} more records like it)"
            for count, text in self._kinds.values()
        ]


def read_event_file(source: str, records: dict[str, list[Record]], warnings: ReadWarnings,
                    fetched: bytes | OSError | None = None) -> None:
    """Reads one event file record by record (see `mpprof.records.tfrecord`).

    Args:
        source: a local or remote event file.
        fetched: the file's bytes (or why they could not be fetched) when
            fetched already (`filesystem.fetch_all`); else it is opened here.
        records: gets each valid record appended under its `series_key`.
        warnings: gets each problem; a file that cannot be read is one.
    """
    # TensorBoard semantics: a tag's metadata (here: the schema version) may
    # come with its first value only and holds for the whole series.
    tag_problems: dict[str, tuple[str, str] | None] = {}
    path = filesystem.shown(source)  # as warnings show it
    try:
        if isinstance(fetched, OSError):
            raise fetched
        with (io.BytesIO(fetched) if fetched is not None
              else filesystem.open_file(source)) as stream:
            size = stream.seek(0, io.SEEK_END)
            stream.seek(0)
            unreadable, stops_early = 0, False
            for frame in tfrecord.read_frames(stream):
                if frame.problem is not None:
                    skipped = "" if frame.fatal else "; skipped"
                    warnings.add(f"{path}\0frame", f"{path}: {frame.problem}{skipped}")
                    unreadable += size - frame.offset if frame.fatal else frame.size
                    stops_early = stops_early or frame.fatal
                else:
                    _parse_event(frame, path, records, warnings, tag_problems)
            if unreadable:
                loss = Loss(path, min(unreadable, size), size, stops_early)
                warnings.losses[path] = loss
                warnings.add(f"{path}\0lost", f"{path}: {loss.describe()}")
    except OSError as e:
        warnings.add(
            f"{path}\0unreadable",
            f"{path}: cannot be read ({filesystem.error_text(e)}); skipped",
        )


def _parse_event(frame: tfrecord.Frame, path: str, records: dict, warnings: ReadWarnings,
                 tag_problems: dict) -> None:
    try:
        event = event_pb2.Event.FromString(frame.payload)
    except Exception as e:  # noqa: BLE001 - bytes that pass their CRC but are no Event
        warnings.add(
            f"{path}\0event",
            f"{path}: record at byte {frame.offset} is not an event ({e}); skipped",
        )
        return
    for value in event.summary.value:
        parsed_tag = schema.parse_tag(value.tag)
        if parsed_tag is None:
            continue
        record, series = parsed_tag
        where = f"{value.tag} at step {event.step} ({path})"
        if value.metadata.plugin_data.plugin_name:
            tag_problems[value.tag] = _metadata_problem(value.metadata.plugin_data.content)
        found = tag_problems.get(value.tag)
        if found is None:
            try:
                parsed = _value(value)
            except ValueError as e:
                found = (f"{value.tag}\0value", f"unreadable value ({e})")
            else:
                reason = validation.step_problem(event.step, event.wall_time) or (
                    validation.problem(record, parsed)
                )
                if reason is None:
                    records.setdefault(series_key(record, series), []).append(
                        Record(step=event.step, wall_time=event.wall_time, value=parsed)
                    )
                    continue
                found = (f"{value.tag}\0malformed", f"malformed record: {reason}")
        kind, reason = found
        warnings.add(kind, f"{where}: {reason}; skipped")


def _metadata_problem(content: bytes) -> tuple[str, str] | None:
    """(kind, reason) if a tag's plugin content makes its records unreadable."""
    try:
        schema.parse_plugin_content(content)
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, TypeError) as e:
        return "metadata", f"unreadable plugin metadata ({e})"
    except ValueError as e:  # the one ValueError it raises itself: a newer schema
        return "newer schema", str(e).rstrip(".")
    return None


# Numeric tensor dtypes a record may hold, and their little-endian layout.
_NUMERIC_DTYPES = {
    types_pb2.DT_DOUBLE: ("<f8", "double_val"),
    types_pb2.DT_FLOAT: ("<f4", "float_val"),
    types_pb2.DT_INT64: ("<i8", "int64_val"),
    types_pb2.DT_INT32: ("<i4", "int_val"),
}


def _value(value):
    """A summary value's tensor: a parsed JSON document or a numeric array.

    Decoded here rather than by `tensorboard.util.tensor_util`, which pulls in
    TensorBoard's TensorFlow stub and its file systems at import (a tenth of
    `mpprof diagnose`'s run time) and copies every array.

    Raises:
        ValueError: the tensor or its JSON text cannot be decoded.
    """
    tensor = value.tensor
    shape = tuple(dim.size for dim in tensor.tensor_shape.dim)
    if tensor.dtype == types_pb2.DT_STRING:
        if shape != () or len(tensor.string_val) != 1:
            raise ValueError(f"a string tensor of shape {list(shape)}, not one JSON text")
        try:
            return json.loads(tensor.string_val[0])
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"not JSON: {e}") from e
    if tensor.dtype not in _NUMERIC_DTYPES:
        raise ValueError(f"a tensor of {types_pb2.DataType.Name(tensor.dtype)}, not numbers")
    if any(size < 0 for size in shape):
        raise ValueError(f"a tensor of shape {list(shape)}")
    layout, field = _NUMERIC_DTYPES[tensor.dtype]
    count = math.prod(shape)
    if tensor.tensor_content:
        if len(tensor.tensor_content) != count * np.dtype(layout).itemsize:
            raise ValueError(f"{len(tensor.tensor_content)} bytes for shape {list(shape)}")
        return np.frombuffer(tensor.tensor_content, layout).reshape(shape)
    values = np.asarray(getattr(tensor, field), dtype=layout)
    if len(values) == 1 and count > 1:
        values = np.repeat(values, count)  # a proto may give one value for all
    if len(values) != count:
        raise ValueError(f"{len(values)} values for shape {list(shape)}")
    return values.reshape(shape)
