"""Statistics of one tensor and the device-side tables that add them up.

`tensor_statistics` counts a tensor's values (non-finite, zero, below
float16's smallest normal and subnormal), takes its finite abs-max and a
log2-magnitude histogram, in one XLA-compiled pass. A `StatisticsTable`
holds them per row (layer or variable) in one variable, so a sample comes to
the host in one read.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from mpprof import schema

_SMALLEST_NORMAL = schema.FLOAT16_SMALLEST_NORMAL
_SMALLEST_SUBNORMAL = schema.FLOAT16_SMALLEST_SUBNORMAL
_EDGES = np.asarray(schema.NUMERICS_HIST_EDGES, dtype=np.float32)


def tensor_statistics(
    tensor: tf.Tensor, with_histogram: bool = True
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor | None]:
    """Counts (`schema.NUMERICS_COUNT_COLUMNS`), finite abs-max and log2 histogram.

    Computed in float32 so that float16 values are measured, not re-rounded.
    """
    # Flattened first, so that tensors of every shape share one trace per
    # dtype: a model with hundreds of layers would otherwise trace the
    # statistics once per distinct shape (a minute for MobileNetV3Small).
    values = tf.reshape(tensor, [-1])
    if with_histogram:
        return _statistics_with_histogram(values)
    return (*_statistics(values), None)


# XLA fuses the dozen element-wise passes below into one: without it they
# cost as much as the layer itself on large activations. Static shapes
# throughout (no boolean_mask, no bincount) so that it compiles; XLA compiles
# each concrete length once, when the step runs.
@tf.function(jit_compile=True, autograph=False, reduce_retracing=True)
def _statistics_with_histogram(values):
    return _compute_statistics(values, True)


@tf.function(jit_compile=True, autograph=False, reduce_retracing=True)
def _statistics(values):
    return _compute_statistics(values, False)[:2]


def _compute_statistics(values, with_histogram):
    # Compared in the tensor's own dtype (no float32 copy of a large tensor);
    # both thresholds are exact in float16 and bfloat16.
    magnitude = tf.abs(values)
    finite = tf.math.is_finite(values)
    nonzero = tf.logical_and(finite, magnitude > 0)
    counts = tf.stack([
        tf.cast(tf.size(values), tf.float32),
        _count(tf.logical_not(finite)),
        _count(tf.equal(values, 0)),
        _count(tf.logical_and(nonzero, magnitude < tf.cast(_SMALLEST_NORMAL, values.dtype))),
        _count(tf.logical_and(nonzero, magnitude < tf.cast(_SMALLEST_SUBNORMAL, values.dtype))),
    ])
    abs_max = tf.cast(tf.reduce_max(tf.where(finite, magnitude, tf.zeros_like(magnitude))),
                      tf.float32)
    if not with_histogram:
        return counts, abs_max, None
    # The histogram only shows where values sit: it is estimated from at most
    # _HISTOGRAM_VALUES evenly spaced values, each counting for `stride`.
    stride = tf.maximum(1, tf.size(values) // _HISTOGRAM_VALUES)
    sampled = tf.cast(values[::stride], tf.float32)
    sampled_nonzero = tf.logical_and(tf.math.is_finite(sampled), sampled != 0)
    bins = tf.clip_by_value((_binary_exponent(sampled) - _FIRST_EDGE) // 2 + 1, 0, _BINS - 1)
    histogram = tf.math.unsorted_segment_sum(
        tf.cast(sampled_nonzero, tf.float32), bins, num_segments=_BINS
    ) * tf.cast(stride, tf.float32)
    return counts, abs_max, histogram


# Histogram bins: edges 2 binades apart, so a value's bin follows from its
# binary exponent alone (integer ops, far cheaper than a log and a search).
_BINS = len(_EDGES) + 1
_FIRST_EDGE = schema.NUMERICS_HIST_EDGES[0]
_HISTOGRAM_VALUES = 2**16


def _binary_exponent(values: tf.Tensor) -> tf.Tensor:
    """floor(log2|v|) of float32 values, from their exponent bits."""
    bits = tf.bitwise.right_shift(tf.bitcast(values, tf.int32), 23)
    return tf.bitwise.bitwise_and(bits, 0xFF) - 127


def _count(mask: tf.Tensor) -> tf.Tensor:
    return tf.reduce_sum(tf.cast(mask, tf.float32))


class StatisticsTable:
    """Device-side statistics of `rows` tensors, aggregated until drained.

    One variable holds, per row, the counts, the abs-max and (optionally) the
    histogram, so one read brings a whole table to the host.

    Args:
        rows: how many tensors (layers or variables) the table holds.
        name: variable name.
        with_histogram: whether to keep the log2 histogram too.
    """

    def __init__(self, rows: int, name: str, with_histogram: bool = True):
        self.rows = rows
        self.with_histogram = with_histogram
        self.columns = len(schema.NUMERICS_STAT_COLUMNS) + (_BINS if with_histogram else 0)
        self.table = tf.Variable(
            tf.zeros((rows, self.columns)), trainable=False, name=f"mpprof_{name}"
        )

    def record(self, row: int, tensor: tf.Tensor) -> None:
        self.record_many([row], [tensor])

    def record_many(self, rows: list[int], tensors: list[tf.Tensor]) -> None:
        """Adds the statistics of `tensors[i]` into row `rows[i]`, in one update."""
        if not tensors:
            return
        statistics = [tensor_statistics(t, self.with_histogram) for t in tensors]
        sums = tf.stack([
            counts if histogram is None else tf.concat([counts, histogram], 0)
            for counts, _, histogram in statistics
        ])
        abs_max = tf.stack([m for _, m, _ in statistics])
        context = tf.distribute.get_replica_context()
        if context is not None and context.num_replicas_in_sync > 1:
            # MirroredStrategy all-reduces only SUM and MEAN: the maximum is
            # taken from a sum of one-hot vectors, one slot per replica.
            per_replica_max = abs_max[:, None] * tf.one_hot(
                context.replica_id_in_sync_group, context.num_replicas_in_sync
            )
            sums, per_replica_max = context.all_reduce(
                tf.distribute.ReduceOp.SUM, [sums, per_replica_max]
            )
            abs_max = tf.reduce_max(per_replica_max, axis=1)
        # One-hot updates instead of scatter ops: XLA has no ResourceScatterNdMax.
        one_hot = tf.one_hot(rows, self.rows, axis=0)  # [table rows, len(rows)]
        added = tf.matmul(one_hot, sums)
        row_max = tf.reduce_max(one_hot * abs_max[None, :], axis=1, keepdims=True)
        count_columns = len(schema.NUMERICS_COUNT_COLUMNS)
        table = self.table
        self.table.assign(tf.concat([
            table[:, :count_columns] + added[:, :count_columns],
            tf.maximum(table[:, count_columns:count_columns + 1], row_max),
            table[:, count_columns + 1:] + added[:, count_columns:],
        ], axis=1))

    def split(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """A read table as ([rows, NUMERICS_STAT_COLUMNS], [rows, bins] or None)."""
        stats_columns = len(schema.NUMERICS_STAT_COLUMNS)
        histogram = values[:, stats_columns:] if self.with_histogram else None
        return values[:, :stats_columns], histogram
