"""Statistics of one traced array, as rows the host adds up: the JAX port
of `mpprof.backends.tensorflow.tensor_statistics` (same raw row, same
sample, same bins, so the NUMERICS records read the same on both backends).

A raw row: the value count, how many values are non-finite and the largest
finite magnitude, exact; then, from a sample of at most `SAMPLE_VALUES`
values (one per equal stratum, at a fixed jitter; a smaller array whole),
the log2-magnitude histogram, zeros and non-finite values, scaled to the
whole array. JAX shapes are static, so the sample's positions are constants
of the traced step. A summary row (`gradient_statistics`) has the same
exact columns and, in place of the histogram, the three counts the records
keep of a variable's gradient.
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
# A row without the histogram (`gradient_statistics`): count, non-finite,
# abs-max, then zero, below_normal, below_subnormal (estimated).
SUMMARY_COLUMNS = _FIRST_BIN + 3
# The same strata and jitter as TensorFlow's (seed 0).
_STRATUM_POSITIONS = np.arange(SAMPLE_VALUES) + np.random.default_rng(0).random(SAMPLE_VALUES)


def _bins_of_exponents(exponent_bits: int, bias: int) -> np.ndarray:
    exponent = np.arange(2**exponent_bits) - bias
    bins = np.clip((exponent - schema.NUMERICS_HIST_EDGES[0]) // 2 + 1, 0, _BINS - 1)
    bins[-1] = _NONFINITE_BIN
    return bins.astype(np.int32)


_BIN_OF_FLOAT32_EXPONENT = _bins_of_exponents(8, 127)


def _flat(array) -> jax.Array:
    """`array` flat, as float16, bfloat16 or float32."""
    values = jnp.reshape(array, (-1,))
    if jnp.dtype(values.dtype).name not in ("float16", "bfloat16", "float32"):
        values = values.astype(jnp.float32)
    return values


def _exact(values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(non-finite count, largest finite magnitude) of flat `values`, float32.

    Two plain reductions in the common case, which XLA vectorizes: the
    maximum magnitude, and the sum of `values * 0`, which is NaN exactly
    when a value is infinite or NaN (XLA's vectorized CPU maximum drops NaN,
    so the maximum alone cannot tell; a select or an integer maximum in the
    reduction costs 2-4x as much on CPU). Only a non-finite array takes a
    second pass that counts."""
    peak = jnp.max(jnp.abs(values))
    any_nonfinite = jnp.sum(values * jnp.zeros((), values.dtype), dtype=jnp.float32)

    def all_finite():
        return jnp.float32(0), peak.astype(jnp.float32)

    def with_nonfinite():
        finite = jnp.isfinite(values)
        return (jnp.sum(jnp.logical_not(finite), dtype=jnp.float32),
                jnp.max(jnp.where(finite, jnp.abs(values), jnp.zeros((), values.dtype)))
                .astype(jnp.float32))

    return jax.lax.cond(jnp.isfinite(any_nonfinite), all_finite, with_nonfinite)


def _sample(values: jax.Array) -> tuple[jax.Array, float]:
    """(the sample's magnitude bits as float32's, values each stands for)."""
    size = values.shape[0]
    strata = max(size / SAMPLE_VALUES, 1.0)
    if size <= SAMPLE_VALUES:
        sample = values
    else:
        index = np.minimum((_STRATUM_POSITIONS * strata).astype(np.int64), size - 1)
        sample = values[index]
    # Exact: float32 holds every float16 and bfloat16 value.
    bits = jax.lax.bitcast_convert_type(sample.astype(jnp.float32), jnp.int32) & 0x7FFFFFFF
    return bits, strata


def raw_statistics(array) -> jax.Array:
    """The float32 [RAW_COLUMNS] row of `array` (traced or concrete)."""
    values = _flat(array)
    size = values.shape[0]
    if size == 0:
        return jnp.zeros((RAW_COLUMNS,), jnp.float32)
    nonfinite, abs_max = _exact(values)
    bits, strata = _sample(values)
    bins = jnp.asarray(_BIN_OF_FLOAT32_EXPONENT)[bits >> 23]
    bins = jnp.where(bits == 0, _ZERO_BIN, bins)
    counts = jax.ops.segment_sum(jnp.ones_like(bins, jnp.float32), bins,
                                 num_segments=_BINS + 2)
    return jnp.concatenate([jnp.stack([jnp.float32(size), nonfinite, abs_max]),
                            counts * jnp.float32(strata)])


# float32 bits of float16's smallest normal and subnormal (both histogram
# edges, so these counts equal sums of whole histogram bins).
_NORMAL_BITS = int(np.float32(schema.FLOAT16_SMALLEST_NORMAL).view(np.int32))
_SUBNORMAL_BITS = int(np.float32(schema.FLOAT16_SMALLEST_SUBNORMAL).view(np.int32))


def _counts(bits: jax.Array, strata: float) -> jax.Array:
    """[zero, below_normal, below_subnormal] of a sample, scaled: three
    comparisons a value, where a histogram costs a scatter."""
    nonzero = bits > 0
    return jnp.stack([
        jnp.sum(bits == 0, dtype=jnp.float32),
        jnp.sum(nonzero & (bits < _NORMAL_BITS), dtype=jnp.float32),
        jnp.sum(nonzero & (bits < _SUBNORMAL_BITS), dtype=jnp.float32),
    ]) * jnp.float32(strata)


def gradient_statistics(gradient, scale) -> tuple[jax.Array, jax.Array]:
    """The [SUMMARY_COLUMNS] rows of a (loss-scaled) gradient and of the
    gradient unscaled (`gradient / scale` in float32), without the
    histograms that a gradient's record does not keep.

    The unscaled row costs no pass over the gradient: dividing by a positive
    scale keeps the order of magnitudes (rounding is monotone), so the
    largest finite magnitude is the scaled one divided, and with a scale of
    at least 1 no finite value becomes non-finite; its counts come from the
    same sample divided. A scale below 1 takes the full pass."""
    values = _flat(gradient)
    size = values.shape[0]
    if size == 0:
        return jnp.zeros((SUMMARY_COLUMNS,), jnp.float32), jnp.zeros((SUMMARY_COLUMNS,),
                                                                     jnp.float32)
    nonfinite, abs_max = _exact(values)
    bits, strata = _sample(values)
    scale = jnp.asarray(scale, jnp.float32)
    unscaled_bits = jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(bits, jnp.float32) / scale, jnp.int32)
    unscaled_nonfinite, unscaled_abs_max = jax.lax.cond(
        scale >= 1,
        lambda: (nonfinite, abs_max / scale),
        lambda: _exact(values.astype(jnp.float32) / scale))
    count = jnp.float32(size)
    return (
        jnp.concatenate([jnp.stack([count, nonfinite, abs_max]), _counts(bits, strata)]),
        jnp.concatenate([jnp.stack([count, unscaled_nonfinite, unscaled_abs_max]),
                         _counts(unscaled_bits, strata)]),
    )


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


def statistics_of_summaries(rows: np.ndarray) -> np.ndarray:
    """[..., SUMMARY_COLUMNS] rows as [..., NUMERICS_STAT_COLUMNS] (host)."""
    rows = np.asarray(rows, dtype=np.float64)
    finite = rows[..., _COUNT] - rows[..., _NONFINITE]
    zero, below_normal, below_subnormal = (
        np.minimum(rows[..., _FIRST_BIN + i], finite) for i in range(3))
    columns = {
        "count": rows[..., _COUNT],
        "nonfinite": rows[..., _NONFINITE],
        "zero": zero,
        "below_normal": below_normal,
        "below_subnormal": below_subnormal,
        "abs_max": rows[..., _ABS_MAX],
    }
    return np.stack([columns[c] for c in schema.NUMERICS_STAT_COLUMNS], axis=-1)
