"""Statistics of one traced array, as rows the host adds up: the JAX port
of `mpprof.backends.tensorflow.tensor_statistics` (same raw row, same
sample, same bins, so the NUMERICS records read the same on both backends).

A raw row: the value count, how many values are non-finite and the largest
finite magnitude, exact (from the magnitude bits, read as integers); then,
from a sample of at most `SAMPLE_VALUES` values (one per equal stratum, at
a fixed jitter; a smaller array whole), the log2-magnitude histogram, zeros
and non-finite values, scaled to the whole array. JAX shapes are static, so
the sample's positions are constants of the traced step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mpprof.records import schema

SAMPLE_VALUES = 2**12
ESTIMATED_COLUMNS = ("zero", "below_normal", "below_subnormal")
_BINS = len(schema.NUMERICS_HIST_EDGES) + 1
_ZERO_BIN, _NONFINITE_BIN = _BINS, _BINS + 1
_BELOW_NORMAL_BINS = schema.NUMERICS_HIST_EDGES.index(
    int(np.log2(schema.FLOAT16_SMALLEST_NORMAL))) + 1
_BELOW_SUBNORMAL_BINS = schema.NUMERICS_HIST_EDGES.index(
    int(np.log2(schema.FLOAT16_SMALLEST_SUBNORMAL))) + 1
_COUNT, _NONFINITE, _ABS_MAX, _FIRST_BIN = 0, 1, 2, 3
RAW_COLUMNS = _FIRST_BIN + _BINS + 2
# The same strata and jitter as TensorFlow's (seed 0).
_STRATUM_POSITIONS = np.arange(SAMPLE_VALUES) + np.random.default_rng(0).random(SAMPLE_VALUES)
# Per float dtype: the integer dtype of its width, magnitude mask, +inf's bits.
_MAGNITUDE_BITS = {
    "float16": (jnp.int16, 0x7FFF, 0x7C00),
    "bfloat16": (jnp.int16, 0x7FFF, 0x7F80),
    "float32": (jnp.int32, 0x7FFFFFFF, 0x7F800000),
}


def _bins_of_exponents(exponent_bits: int, bias: int) -> np.ndarray:
    exponent = np.arange(2**exponent_bits) - bias
    bins = np.clip((exponent - schema.NUMERICS_HIST_EDGES[0]) // 2 + 1, 0, _BINS - 1)
    bins[-1] = _NONFINITE_BIN
    return bins.astype(np.int32)


_BIN_OF_FLOAT32_EXPONENT = _bins_of_exponents(8, 127)


def raw_statistics(array) -> jax.Array:
    """The float32 [RAW_COLUMNS] row of `array` (traced or concrete)."""
    values = jnp.reshape(array, (-1,))
    name = jnp.dtype(values.dtype).name
    if name not in _MAGNITUDE_BITS:
        values, name = values.astype(jnp.float32), "float32"
    integer, mask, infinity = _MAGNITUDE_BITS[name]
    size = values.shape[0]
    if size == 0:
        return jnp.zeros((RAW_COLUMNS,), jnp.float32)
    magnitude = jax.lax.bitcast_convert_type(values, integer) & jnp.asarray(mask, integer)
    finite = magnitude < jnp.asarray(infinity, integer)
    nonfinite = jnp.sum(jnp.logical_not(finite), dtype=jnp.float32)
    peak_bits = jnp.max(jnp.where(finite, magnitude, jnp.zeros((), integer)))
    abs_max = jax.lax.bitcast_convert_type(peak_bits, values.dtype).astype(jnp.float32)
    strata = max(size / SAMPLE_VALUES, 1.0)
    if size <= SAMPLE_VALUES:
        sample = values
    else:
        index = np.minimum((_STRATUM_POSITIONS * strata).astype(np.int64), size - 1)
        sample = values[index]
    # Exact: float32 holds every float16 and bfloat16 value.
    bits = jax.lax.bitcast_convert_type(sample.astype(jnp.float32), jnp.int32) & 0x7FFFFFFF
    bins = jnp.asarray(_BIN_OF_FLOAT32_EXPONENT)[bits >> 23]
    bins = jnp.where(bits == 0, _ZERO_BIN, bins)
    counts = jax.ops.segment_sum(jnp.ones_like(bins, jnp.float32), bins,
                                 num_segments=_BINS + 2)
    return jnp.concatenate([jnp.stack([jnp.float32(size), nonfinite, abs_max]),
                            counts * jnp.float32(strata)])


def merge_rows(rows) -> jax.Array:
    """Rows of one tensor's several calls as one: sums, abs-max the maximum."""
    rows = jnp.stack(rows)
    total = jnp.sum(rows, axis=0)
    return total.at[_ABS_MAX].set(jnp.max(rows[:, _ABS_MAX]))


def statistics_of_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., RAW_COLUMNS] rows as ([..., NUMERICS_STAT_COLUMNS], [..., bins])
    (on the host; as TensorFlow's)."""
    rows = np.asarray(rows, dtype=np.float64)
    bins = rows[..., _FIRST_BIN:]
    histogram = bins[..., :_BINS]
    finite = rows[..., _COUNT] - rows[..., _NONFINITE]
    columns = {
        "count": rows[..., _COUNT],
        "nonfinite": rows[..., _NONFINITE],
        "zero": np.minimum(bins[..., _ZERO_BIN], finite),
        "below_normal": np.minimum(histogram[..., :_BELOW_NORMAL_BINS].sum(-1), finite),
        "below_subnormal": np.minimum(histogram[..., :_BELOW_SUBNORMAL_BINS].sum(-1), finite),
        "abs_max": rows[..., _ABS_MAX],
    }
    return np.stack([columns[c] for c in schema.NUMERICS_STAT_COLUMNS], axis=-1), histogram
