"""Statistics of one tensor and the device-side tables that add them up.

`raw_statistics` gives, for one tensor, a row of numbers the device adds up
over a sampled step: the value count, how many values are non-finite and the
largest finite magnitude, all exact; and, from a sample of at most
`SAMPLE_VALUES` values spread over the tensor (a tensor that small is taken
whole), how many are zero, non-finite, and in each bin of the log2-magnitude
histogram, scaled to the whole tensor. `statistics_of_rows` turns such rows,
on the host, into the `schema.NUMERICS_STAT_COLUMNS` and the histogram: the
histogram's edges include float16's smallest normal and subnormal, so the
counts below them are sums of whole bins. A `StatisticsTable` holds the rows
of many tensors (layers or variables) in one variable, so a sample comes to
the host in one read.

Why this shape: on the CPU a dozen element-wise passes over a large float16
activation cost as much as the layer itself (float16 arithmetic is emulated
there), and so do a few dozen small ops per tensor on a small one. The exact
part reads each value once, as an integer (its magnitude bits); only a
tensor that holds a non-finite value (an overflowing step) is read again, to
count them and take the finite maximum. Everything else is one binning pass
over the sample, and the arithmetic on the bins is left to the host.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from mpprof.backends.numerics_rows import (
    ABS_MAX,
    BINS,
    RAW_COLUMNS,
    SAMPLE_VALUES,
    STRATUM_POSITIONS,
    ZERO_BIN,
    bins_of_exponents,
    statistics_of_rows,
)
from mpprof.records import schema

# Per float dtype: the integer dtype of its width, the mask of its magnitude
# bits (all but the sign) and the bits of +inf. As integers, magnitudes order
# like the values they encode, and every non-finite one is >= +inf's bits.
_MAGNITUDE_BITS = {
    tf.float16: (tf.int16, 0x7FFF, 0x7C00),
    tf.bfloat16: (tf.int16, 0x7FFF, 0x7F80),
    tf.float32: (tf.int32, 0x7FFFFFFF, 0x7F800000),
    tf.float64: (tf.int64, 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000),
}

def raw_statistics(tensor: tf.Tensor) -> tf.Tensor:
    """The float32 [RAW_COLUMNS] row of `tensor`'s statistics (see the module
    docstring); `statistics_of_rows` reads it.

    Args:
        tensor: a floating-point tensor of any shape.
    """
    values = tf.reshape(tensor, [-1])
    if values.dtype not in _MAGNITUDE_BITS:
        values = tf.cast(values, tf.float32)
    return _traced_statistics(values.dtype)(values)


def tensor_statistics(tensor) -> tuple[np.ndarray, float, np.ndarray]:
    """Eagerly: counts (`schema.NUMERICS_COUNT_COLUMNS`), finite abs-max and
    log2 histogram of one tensor.

    "count", "nonfinite" and the abs-max are exact; "zero", "below_normal",
    "below_subnormal" and the histogram are estimated from a sample of at most
    `SAMPLE_VALUES` values (each sampled value stands for size / sampled
    values), exact for a tensor no larger.
    """
    stats, histogram = statistics_of_rows(raw_statistics(tensor).numpy())
    count_columns = len(schema.NUMERICS_COUNT_COLUMNS)
    return stats[:count_columns], float(stats[count_columns]), histogram


# One traced function per dtype, taking a flat tensor of any length: tensors
# of every shape share it, so that a model with hundreds of layers traces the
# statistics a few times, not once per tensor.
_TRACED: dict = {}


def _traced_statistics(dtype: tf.DType):
    integer_maximum = _integer_maximum_available()
    key = (dtype, integer_maximum)
    if key not in _TRACED:
        _TRACED[key] = tf.function(
            lambda values: _compute_statistics(values, integer_maximum),
            input_signature=[tf.TensorSpec([None], dtype)], autograph=False,
        )
    return _TRACED[key]


def _integer_maximum_available() -> bool:
    """Whether the statistics may take integer maxima: on a host without
    GPUs (TensorFlow has no GPU kernel for an int16 or int32 maximum)."""
    return not tf.config.list_logical_devices("GPU")


def _compute_statistics(values: tf.Tensor, integer_maximum: bool) -> tf.Tensor:
    size = tf.size(values, out_type=tf.int64)
    nonfinite, abs_max = _exact_statistics(values, integer_maximum)
    sample, valid, weight = _sample(values, size)
    # Every sampled value falls into one bin: the histogram's, zero or
    # non-finite (the sample's unused places weigh nothing).
    bins = tf.math.unsorted_segment_sum(
        tf.cast(valid, tf.float32), _bin_of(sample), num_segments=BINS + 2
    )
    return tf.concat([tf.stack([tf.cast(size, tf.float32), nonfinite, abs_max]),
                      bins * weight], axis=0)


def _exact_statistics(values: tf.Tensor, integer_maximum: bool) -> tuple[tf.Tensor, tf.Tensor]:
    """(non-finite count, largest finite magnitude) of flat `values`, as float32.

    Args:
        values: a flat float16, bfloat16, float32 or float64 tensor.
        integer_maximum: take the maximum of the magnitude bits as integers
            (one pass fewer; not every device has an integer maximum).
    """
    integer, magnitude_mask, infinity = _MAGNITUDE_BITS[values.dtype]
    magnitude = tf.bitwise.bitwise_and(tf.bitcast(values, integer),
                                       tf.constant(magnitude_mask, integer))
    infinity = tf.constant(infinity, integer)
    # NaN's bits become +inf's, so that the maximum is +inf exactly when a
    # value is non-finite: no reliance on how a float maximum treats NaN
    # (XLA's CPU maximum drops it). An empty tensor's maximum is at least 0.
    if integer_maximum:
        peak_bits = tf.maximum(tf.minimum(tf.reduce_max(magnitude), infinity),
                               tf.zeros((), integer))
        peak = tf.bitcast(peak_bits, values.dtype)
    else:
        capped = tf.bitcast(tf.minimum(magnitude, infinity), values.dtype)
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

    A tensor of more than `SAMPLE_VALUES` values gives one value from each of
    that many equal strata (see `STRATUM_POSITIONS`). A smaller one is taken
    whole, each value once; the sample's other places are masked out.
    """
    strata = tf.maximum(tf.cast(size, tf.float64) / SAMPLE_VALUES, 1.0)
    # With strata of one value (a small tensor) position i is value i.
    index = tf.minimum(tf.cast(STRATUM_POSITIONS * strata, tf.int64), size - 1)
    # An empty tensor has nothing to gather from (a layer may output one).
    sample = tf.cond(size > 0, lambda: tf.gather(values, index),
                     lambda: tf.zeros((SAMPLE_VALUES,), values.dtype))
    return sample, tf.range(SAMPLE_VALUES, dtype=tf.int64) < size, tf.cast(strata, tf.float32)


def _bin_of(sample: tf.Tensor) -> tf.Tensor:
    """Each sampled value's bin (int32): a histogram bin for a finite non-zero
    value, else `ZERO_BIN` or `NONFINITE_BIN`. From the value's exponent
    bits through a lookup table: integer ops, far cheaper than a log and a
    search."""
    if sample.dtype == tf.float64:
        integer, shift, table = tf.int64, 52, _BIN_OF_EXPONENT[tf.float64]
    else:
        # Exact: float32 holds every float16 and bfloat16 value, subnormals
        # as normal numbers with their true exponent.
        sample = tf.cast(sample, tf.float32)
        integer, shift, table = tf.int32, 23, _BIN_OF_EXPONENT[tf.float32]
    magnitude = tf.bitwise.bitwise_and(tf.bitcast(sample, integer),
                                       _MAGNITUDE_BITS[sample.dtype][1])
    # Zero's exponent bits are a subnormal's (bin 0): move it to its own bin.
    is_zero = tf.cast(tf.equal(magnitude, 0), tf.int32)
    return tf.gather(table, tf.bitwise.right_shift(magnitude, shift)) + is_zero * ZERO_BIN


_BIN_OF_EXPONENT = {
    tf.float32: bins_of_exponents(8, 127),
    tf.float64: bins_of_exponents(11, 1023),
}


class StatisticsTable:
    """Device-side statistics of `rows` tensors, aggregated until drained.

    One variable holds a raw row (`raw_statistics`) per tensor, so one read
    brings a whole table to the host; `split` reads it.

    Args:
        rows: how many tensors (layers or variables) the table holds.
        name: variable name.
        with_histogram: whether `split` gives the log2 histogram too.
    """

    def __init__(self, rows: int, name: str, with_histogram: bool = True):
        self.rows = rows
        self.with_histogram = with_histogram
        self.columns = RAW_COLUMNS
        self.table = tf.Variable(
            tf.zeros((rows, self.columns)), trainable=False, name=f"mpprof_{name}"
        )

    def record(self, row: int, tensor: tf.Tensor) -> None:
        self.record_many([row], [tensor])

    def record_many(self, rows: list[int], tensors: list[tf.Tensor]) -> None:
        """Adds the statistics of `tensors[i]` into row `rows[i]`, in one update."""
        if not tensors:
            return
        raw = tf.stack([raw_statistics(t) for t in tensors])
        abs_max = raw[:, ABS_MAX]
        context = tf.distribute.get_replica_context()
        if context is not None and context.num_replicas_in_sync > 1:
            # MirroredStrategy all-reduces only SUM and MEAN: the maximum is
            # taken from a sum of one-hot vectors, one slot per replica.
            per_replica_max = abs_max[:, None] * tf.one_hot(
                context.replica_id_in_sync_group, context.num_replicas_in_sync
            )
            raw, per_replica_max = context.all_reduce(
                tf.distribute.ReduceOp.SUM, [raw, per_replica_max]
            )
            abs_max = tf.reduce_max(per_replica_max, axis=1)
        # One-hot updates instead of scatter ops: XLA has no ResourceScatterNdMax.
        one_hot = tf.one_hot(rows, self.rows, axis=0)  # [table rows, len(rows)]
        added = tf.matmul(one_hot, raw)
        row_max = tf.reduce_max(one_hot * abs_max[None, :], axis=1, keepdims=True)
        table = self.table
        self.table.assign(tf.concat([
            table[:, :ABS_MAX] + added[:, :ABS_MAX],
            tf.maximum(table[:, ABS_MAX:ABS_MAX + 1], row_max),
            table[:, ABS_MAX + 1:] + added[:, ABS_MAX + 1:],
        ], axis=1))

    def split(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """A read table as ([rows, NUMERICS_STAT_COLUMNS], [rows, bins] or None)."""
        stats, histogram = statistics_of_rows(values)
        return stats, histogram if self.with_histogram else None
