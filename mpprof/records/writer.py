"""Writes mpprof records (see `mpprof.records.schema`) as TensorBoard event files.

The files are TensorBoard's own (TFRecord frames, `tfrecord.frame`, of
`Event` protos holding tensor summaries, as `tf.summary.write` writes them),
so TensorBoard, the reader and the plugin read them as before; writing them
needs neither TensorFlow nor any other framework.

A local event file is appended to. A remote one (an object store cannot
append: rewriting the whole object at every flush, as TensorBoard's own
writers do there, costs the file's size per flush) is written as parts, one
new object per flush holding only what the flush adds (`schema.part_name`).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import posixpath
import socket
import time

import numpy as np
from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2

from mpprof.records import filesystem, run_context, run_files, schema, tfrecord

# Event files of one process are told apart by this count, as TensorBoard's
# own writer does (two writers may start in the same second).
_FILE_COUNT = itertools.count()


@functools.cache
def _metadata(record: str) -> summary_pb2.SummaryMetadata:
    return summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(
            plugin_name=schema.PLUGIN_NAME, content=schema.plugin_content(record)
        ),
        # Without a data class, TensorBoard's data providers skip the series.
        data_class=summary_pb2.DATA_CLASS_TENSOR,
    )


def event_file_name(wall_time: float) -> str:
    """A new event file's name: TensorBoard's pattern (time, host, pid, a
    count) and mpprof's suffix, which the reader looks for."""
    return (f"events.out.tfevents.{int(wall_time):010d}.{socket.gethostname()}."
            f"{os.getpid()}.{next(_FILE_COUNT)}{schema.EVENT_FILE_SUFFIX}")


class RecordWriter:
    """Writes records into one run directory.

    Records go through the file's buffer: all of them are on disk after
    `flush()` (and `close()`). Not thread-safe: one thread writes.

    Args:
        run_dir: directory of the run (created if missing); a local path or
            any URL `mpprof.records.filesystem` writes.

    Raises:
        OSError: the run directory or its event file cannot be written.
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = os.fspath(run_dir)
        filesystem.makedirs(self.run_dir)
        wall_time = time.time()
        name = event_file_name(wall_time)
        self.path = filesystem.join(self.run_dir, name)
        # What the files this writer adds beside its records (replay
        # captures) are named by, so that they stay with its run.
        self.writer_id = run_files.writer_id(self.path)
        self._fit_end_path = filesystem.join(self.run_dir, schema.fit_end_name(name))
        self._unanswered: filesystem.NoAnswerError | None = None
        self._flush_failed: OSError | None = None
        self._file = (_PartWriter(self.path, wall_time) if filesystem.is_remote(self.path)
                      else filesystem.open_append(self.path))
        try:
            self._add(event_pb2.Event(wall_time=wall_time, file_version="brain.Event:2"))
            self.flush()
            self._write_fit_end({"fit_state": run_context.FIT_RUNNING})
        except BaseException:
            self._file.close()
            raise

    def mark_fit_end(self, fit_state: str, step: int,
                     recording_stopped: str | None = None) -> None:
        """Says how the fit ended in the fit-end file reserved at the start,
        rewritten in place: it still works when a full disk stopped the
        records midway (`recording_stopped` says why). Raises OSError."""
        self._write_fit_end({
            "fit_state": fit_state, "step": int(step), "wall_time": time.time(),
            "recording_stopped": recording_stopped,
        })

    def _write_fit_end(self, value: dict) -> None:
        text = json.dumps(value, sort_keys=True).encode()
        if len(text) > schema.FIT_END_SIZE:  # a very long reason: shortened
            value = {**value, "recording_stopped": str(value["recording_stopped"])[:300]}
            text = json.dumps(value, sort_keys=True).encode()[: schema.FIT_END_SIZE]
        self._store(filesystem.overwrite_bytes, self._fit_end_path,
                    text.ljust(schema.FIT_END_SIZE))

    def write_json(self, record: str, value, step: int) -> None:
        text = json.dumps(value, sort_keys=True, default=_json_default)
        tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[text.encode()])
        self._write(record, tensor, step)

    def write_array(self, record: str, value, step: int, series: str | None = None) -> None:
        """Writes a float64 array; `series` names one of several series of a
        record (see `schema.tag_for`)."""
        array = np.ascontiguousarray(value, dtype="<f8")
        tensor = tensor_pb2.TensorProto(
            dtype=types_pb2.DT_DOUBLE,
            tensor_shape=tensor_shape_pb2.TensorShapeProto(
                dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=n) for n in array.shape]
            ),
            tensor_content=array.tobytes(),
        )
        self._write(record, tensor, step, series)

    def write_file(self, relative_path: str, data: bytes) -> None:
        """Writes `data` into the file `relative_path` of the run directory
        (its folders created as needed), replacing any file there."""
        path = filesystem.join(self.run_dir, *relative_path.split("/"))
        self._store(filesystem.makedirs, posixpath.dirname(path) if filesystem.is_remote(path)
                    else os.path.dirname(path))
        self._store(filesystem.write_bytes, path, data)

    def flush(self) -> None:
        try:
            self._store(self._file.flush)
        except OSError as e:
            self._flush_failed = e
            raise

    def close(self) -> None:
        """Closes the event file, after a last flush unless a flush failed
        (a full disk, a store that is down: not waited on again; only the
        fit-end file is tried, `mark_fit_end`)."""
        try:
            if self._flush_failed is None:
                self.flush()
        finally:
            self._file.close()

    def _store(self, write, *args) -> None:
        """`write(*args)`; once the store left a write unanswered past its
        deadline (`filesystem.NoAnswerError`), every later one (the close,
        the fit-end file) raises that at once instead of waiting again."""
        if self._unanswered is not None:
            raise self._unanswered
        try:
            write(*args)
        except filesystem.NoAnswerError as e:
            self._unanswered = e
            raise

    def _write(self, record: str, tensor: tensor_pb2.TensorProto, step: int,
               series: str | None = None) -> None:
        value = summary_pb2.Summary.Value(
            tag=schema.tag_for(record, series), metadata=_metadata(record), tensor=tensor
        )
        self._add(event_pb2.Event(wall_time=time.time(), step=int(step),
                                  summary=summary_pb2.Summary(value=[value])))

    def _add(self, event: event_pb2.Event) -> None:
        self._file.write(tfrecord.frame(event.SerializeToString()))


class _PartWriter:
    """A remote event file written as parts: each flush puts one new object
    with what was written since the last one (after the file-version event,
    so each part is a complete event file). A flush that fails keeps its
    records for the next one.

    A flush asked for while one waits on the store (a SIGTERM handler's,
    on the same thread) does nothing: the signal is not held up by a second
    wait, and the waiting flush keeps every record it did not send."""

    def __init__(self, path: str, wall_time: float):
        self._path = path
        self._index = 0
        self._pending = bytearray()
        self._sending = False
        self._header = tfrecord.frame(event_pb2.Event(
            wall_time=wall_time, file_version="brain.Event:2").SerializeToString())

    def write(self, data: bytes) -> None:
        self._pending += data

    def flush(self) -> None:
        if not self._pending or self._sending:
            return
        sent = len(self._pending)
        if self._index == 0 and self._pending.startswith(self._header):
            data = bytes(self._pending)  # the writer's own first event
        else:
            data = self._header + self._pending
        self._sending = True
        try:
            filesystem.write_bytes(schema.part_name(self._path, self._index), data)
        finally:
            self._sending = False
        self._index += 1
        del self._pending[:sent]  # records written meanwhile wait for the next

    def close(self) -> None:
        self._pending.clear()


def _json_default(value):
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"Cannot write {type(value).__name__} into an mpprof record")
