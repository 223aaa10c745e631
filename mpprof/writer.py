"""Writes mpprof records (see `mpprof.schema`) as TensorBoard summaries."""

from __future__ import annotations

import functools
import json
import os
import posixpath

import numpy as np
import tensorflow as tf
from tensorboard.compat.proto import summary_pb2

from mpprof import schema


@functools.cache
def _metadata(record: str) -> bytes:
    return summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(
            plugin_name=schema.PLUGIN_NAME, content=schema.plugin_content(record)
        ),
        # Without a data class, TensorBoard's data providers skip the series.
        data_class=summary_pb2.DATA_CLASS_TENSOR,
    ).SerializeToString()


class RecordWriter:
    """Writes records into one run directory.

    Not thread-safe: TensorBoard summary writers are used from one thread.

    Args:
        run_dir: directory of the run (created if missing); any path
            `tf.io.gfile` can write.
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = os.fspath(run_dir)
        tf.io.gfile.makedirs(self.run_dir)
        self._writer = tf.summary.create_file_writer(
            self.run_dir, filename_suffix=schema.EVENT_FILE_SUFFIX
        )

    def write_json(self, record: str, value, step: int) -> None:
        text = json.dumps(value, sort_keys=True, default=_json_default)
        self._write(record, tf.constant(text), step)

    def write_array(self, record: str, value, step: int, series: str | None = None) -> None:
        """Writes a float64 array; `series` names one of several series of a
        record (see `schema.tag_for`)."""
        tensor = tf.constant(np.asarray(value, dtype=np.float64))
        self._write(record, tensor, step, series)

    def write_file(self, relative_path: str, data: bytes) -> None:
        """Writes `data` into the file `relative_path` of the run directory
        (its folders created as needed), replacing any file there."""
        path = posixpath.join(self.run_dir, relative_path)
        tf.io.gfile.makedirs(posixpath.dirname(path))
        with tf.io.gfile.GFile(path, "wb") as f:
            f.write(data)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def _write(self, record: str, tensor: tf.Tensor, step: int, series: str | None = None) -> None:
        with self._writer.as_default():
            tf.summary.write(
                schema.tag_for(record, series), tensor, step=int(step),
                metadata=_metadata(record),
            )


def _json_default(value):
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"Cannot write {type(value).__name__} into an mpprof record")
