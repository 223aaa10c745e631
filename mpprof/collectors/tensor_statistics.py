"""Statistics of one tensor and the device-side tables that add them up.

`tensor_statistics` gives, for one tensor, its value count, how many values
are non-finite and its largest finite magnitude, all exact; and the counts of
zero values, of non-zero values below float16's smallest normal and
subnormal, and a log2-magnitude histogram, estimated from a sample of at most
`SAMPLE_VALUES` values spread over the tensor (a tensor that small is
measured whole: then every statistic is exact). A `StatisticsTable` holds
them per row (layer or variable) in one variable, so a sample comes to the
host in one read.

Why this shape: on the CPU a dozen element-wise passes over a large float16
activation cost as much as the layer itself (float16 arithmetic is emulated
there). The exact part reads each value once, as an integer (its magnitude
bits, a bit mask and an integer minimum, then one float maximum); only a
tensor that holds a non-finite value (an overflowing step) is read again, to
count them and take the finite maximum. Everything else works on the sample.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from mpprof import schema

# Values a tensor's shares and histogram are estimated from, at most. The
# standard error of an estimated share is at most 0.5 / sqrt(SAMPLE_VALUES),
# 0.4 percentage points: far finer than the 10% and 90% thresholds the
# diagnosis judges shares by.
SAMPLE_VALUES = 2**14
# The `schema.NUMERICS_COUNT_COLUMNS` (and the histogram) estimated from the
# sample; the others are exact.
ESTIMATED_COLUMNS = ("zero", "below_normal", "below_subnormal")

_SMALLEST_NORMAL = schema.FLOAT16_SMALLEST_NORMAL
_SMALLEST_SUBNORMAL = schema.FLOAT16_SMALLEST_SUBNORMAL
_EDGES = np.asarray(schema.NUMERICS_HIST_EDGES, dtype=np.float32)

# Per float dtype: the integer dtype of its width, the mask of its magnitude
# bits (all but the sign) and the bits of +inf. As integers, magnitudes order
# like the values they encode, and every non-finite one is >= +inf's bits.
_MAGNITUDE_BITS = {
    tf.float16: (tf.int16, 0x7FFF, 0x7C00),
    tf.bfloat16: (tf.int16, 0x7FFF, 0x7F80),
    tf.float32: (tf.int32, 0x7FFFFFFF, 0x7F800000),
    tf.float64: (tf.int64, 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000),
}

# Where in its stratum each sampled position falls, as a share of the
# stratum: fixed, so that a step's sample is reproducible, and irregular, so
# that the positions never step in time with a channel count (a stride of 16
# over 16 channels would sample one channel only).
_JITTER = np.random.default_rng(0).random(SAMPLE_VALUES).astype(np.float32)


def tensor_statistics(
    tensor: tf.Tensor, with_histogram: bool = True
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor | None]:
    """Counts (`schema.NUMERICS_COUNT_COLUMNS`), finite abs-max and log2 histogram.

    "count", "nonfinite" and the abs-max are exact; "zero", "below_normal",
    "below_subnormal" and the histogram are estimated from a sample of at most
    `SAMPLE_VALUES` values (each sampled value stands for size / sampled
    values), exact for a tensor no larger.

    Args:
        tensor: a floating-point tensor of any shape.
        with_histogram: whether to compute the histogram too (else None).
    """
    values = tf.reshape(tensor, [-1])
    if values.dtype not in _MAGNITUDE_BITS:
        values = tf.cast(values, tf.float32)
    statistics = _traced_statistics(values.dtype, with_histogram)(values)
    return statistics if with_histogram else (*statistics, None)


# One traced function per dtype and kind, taking a flat tensor of any length:
# tensors of every shape share it, so that a model with hundreds of layers
# traces the statistics a few times, not once per tensor (inlined into the
# train step when it runs, the call costs nothing).
_TRACED: dict = {}


def _traced_statistics(dtype: tf.DType, with_histogram: bool):
    key = (dtype, with_histogram)
    if key not in _TRACED:
        _TRACED[key] = tf.function(
            lambda values: _compute_statistics(values, with_histogram),
            input_signature=[tf.TensorSpec([None], dtype)], autograph=False,
        )
    return _TRACED[key]


def _compute_statistics(values: tf.Tensor, with_histogram: bool):
    size = tf.size(values, out_type=tf.int64)
    nonfinite, abs_max = _exact_statistics(values)
    sample, valid, weight = _sample(values, size)
    magnitude = tf.abs(sample)
    finite = tf.logical_and(tf.math.is_finite(sample), valid)
    nonzero = tf.logical_and(finite, magnitude > 0)
    sampled = tf.stack([
        tf.logical_and(finite, tf.equal(sample, 0)),
        tf.logical_and(nonzero, magnitude < tf.cast(_SMALLEST_NORMAL, sample.dtype)),
        tf.logical_and(nonzero, magnitude < tf.cast(_SMALLEST_SUBNORMAL, sample.dtype)),
    ])
    size_f = tf.cast(size, tf.float32)
    # An estimate never claims more values than the finite ones there are.
    estimated = tf.minimum(
        tf.reduce_sum(tf.cast(sampled, tf.float32), axis=1) * weight, size_f - nonfinite
    )
    counts = tf.concat([tf.stack([size_f, nonfinite]), estimated], axis=0)
    if not with_histogram:
        return counts, abs_max
    as_float32 = tf.cast(sample, tf.float32)
    bins = tf.clip_by_value((_binary_exponent(as_float32) - _FIRST_EDGE) // 2 + 1, 0, _BINS - 1)
    in_histogram = tf.logical_and(nonzero, tf.math.is_finite(as_float32))
    histogram = tf.math.unsorted_segment_sum(
        tf.cast(in_histogram, tf.float32), bins, num_segments=_BINS
    ) * weight
    return counts, abs_max, histogram


def _exact_statistics(values: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """(non-finite count, largest finite magnitude) of flat `values`, as float32."""
    integer, magnitude_mask, infinity = _MAGNITUDE_BITS[values.dtype]
    magnitude = tf.bitwise.bitwise_and(tf.bitcast(values, integer),
                                       tf.constant(magnitude_mask, integer))
    # NaN's bits become +inf's, so that the float maximum below is +inf exactly
    # when a value is non-finite: no reliance on how a maximum treats NaN
    # (XLA's CPU maximum drops it). Integer maxima are not on every device.
    capped = tf.bitcast(tf.minimum(magnitude, tf.constant(infinity, integer)), values.dtype)
    # At least 0: the maximum of an empty tensor is -inf.
    peak = tf.maximum(tf.reduce_max(capped), tf.zeros((), values.dtype))

    def all_finite():
        return tf.zeros(()), tf.cast(peak, tf.float32)

    def with_nonfinite():
        finite = tf.math.is_finite(values)
        largest = tf.reduce_max(tf.where(finite, tf.abs(values), tf.zeros_like(values)))
        return (tf.reduce_sum(tf.cast(tf.logical_not(finite), tf.float32)),
                tf.cast(largest, tf.float32))

    return tf.cond(tf.math.is_finite(peak), all_finite, with_nonfinite)


def _sample(values: tf.Tensor, size: tf.Tensor):
    """(sample, which of its places hold a value, values each one stands for).

    A tensor of more than `SAMPLE_VALUES` values is cut into that many equal
    strata (a tail shorter than one stratum is left out) and one value is
    taken from each, at a fixed jitter within it. A smaller one is taken
    whole, each value once; the sample's other places are masked out.
    """
    position = tf.range(SAMPLE_VALUES, dtype=tf.int64)
    stratum = size // SAMPLE_VALUES
    offset = tf.cast(tf.constant(_JITTER) * tf.cast(stratum, tf.float32), tf.int64)
    index = tf.where(stratum > 0, position * stratum + offset,
                     tf.minimum(position, tf.maximum(size - 1, 0)))
    weight = tf.cast(tf.maximum(size, SAMPLE_VALUES), tf.float32) / SAMPLE_VALUES
    # An empty tensor has nothing to gather from (a layer may output one).
    sample = tf.cond(size > 0, lambda: tf.gather(values, index),
                     lambda: tf.zeros((SAMPLE_VALUES,), values.dtype))
    return sample, position < size, weight


# Histogram bins: edges 2 binades apart, so a value's bin follows from its
# binary exponent alone (integer ops, far cheaper than a log and a search).
_BINS = len(_EDGES) + 1
_FIRST_EDGE = schema.NUMERICS_HIST_EDGES[0]


def _binary_exponent(values: tf.Tensor) -> tf.Tensor:
    """floor(log2|v|) of float32 values, from their exponent bits."""
    bits = tf.bitwise.right_shift(tf.bitcast(values, tf.int32), 23)
    return tf.bitwise.bitwise_and(bits, 0xFF) - 127


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
