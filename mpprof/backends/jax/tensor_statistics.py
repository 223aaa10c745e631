"""Statistics of one traced array, as rows the host adds up: the raw row of
`mpprof.backends.numerics_rows` (its layout, sample, bins and host reading
are shared by every backend, so the NUMERICS records read the same), computed
with jax.numpy. JAX shapes are static, so the sample's positions are constants
of the traced step. Summary rows (`gradient_statistics`) have the same
exact columns and, in place of the histogram, the three counts the records
keep of a variable's gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mpprof.backends.numerics_rows import (
    ABS_MAX,
    BINS,
    COUNT,
    FIRST_BIN,
    NONFINITE,
    RAW_COLUMNS,
    SAMPLE_VALUES,
    STRATUM_POSITIONS,
    ZERO_BIN,
    bins_of_exponents,
)
from mpprof.records import schema

# A row without the histogram (`gradient_statistics`): count, non-finite,
# abs-max, then zero, below_normal, below_subnormal (estimated).
SUMMARY_COLUMNS = FIRST_BIN + 3

_BIN_OF_FLOAT32_EXPONENT = bins_of_exponents(8, 127)


def _flat(array) -> jax.Array:
    """`array` flat, as float16, bfloat16 or float32."""
    values = jnp.reshape(array, (-1,))
    if jnp.dtype(values.dtype).name not in ("float16", "bfloat16", "float32"):
        values = values.astype(jnp.float32)
    return values


# Arrays of at most this many values are measured in one pass with selects;
# larger ones by two plain reductions and a branch (`_exact`).
_ONE_PASS_VALUES = 2**15


def _exact(values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(non-finite count, largest finite magnitude) of flat `values`, float32.

    A large array takes two plain reductions, which XLA vectorizes: the
    maximum magnitude, and the sum of `values * 0`, which is NaN exactly
    when a value is infinite or NaN (XLA's vectorized CPU maximum drops NaN,
    so the maximum alone cannot tell; a select in the reduction costs 2-4x
    as much on CPU). Only a non-finite array then takes a second pass that
    counts. A small array takes that counting pass alone: a branch costs
    more than the selects there (measured on XLA's CPU runtime)."""

    def counted():
        finite = jnp.isfinite(values)
        return (jnp.sum(jnp.logical_not(finite), dtype=jnp.float32),
                jnp.max(jnp.where(finite, jnp.abs(values), jnp.zeros((), values.dtype)))
                .astype(jnp.float32))

    if values.shape[0] <= _ONE_PASS_VALUES:
        return counted()
    peak = jnp.max(jnp.abs(values))
    any_nonfinite = jnp.sum(values * jnp.zeros((), values.dtype), dtype=jnp.float32)
    return jax.lax.cond(jnp.isfinite(any_nonfinite),
                        lambda: (jnp.float32(0), peak.astype(jnp.float32)), counted)


def _sample(values: jax.Array) -> tuple[jax.Array, float]:
    """(the sample's magnitude bits as float32's, values each stands for)."""
    size = values.shape[0]
    strata = max(size / SAMPLE_VALUES, 1.0)
    if size <= SAMPLE_VALUES:
        sample = values
    else:
        index = np.minimum((STRATUM_POSITIONS * strata).astype(np.int64), size - 1)
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
    bins = jnp.where(bits == 0, ZERO_BIN, bins)
    counts = jax.ops.segment_sum(jnp.ones_like(bins, jnp.float32), bins,
                                 num_segments=BINS + 2)
    return jnp.concatenate([jnp.stack([jnp.float32(size), nonfinite, abs_max]),
                            counts * jnp.float32(strata)])


# float32 bits of float16's smallest normal and subnormal (both histogram
# edges, so these counts equal sums of whole histogram bins).
_NORMAL_BITS = int(np.float32(schema.FLOAT16_SMALLEST_NORMAL).view(np.int32))
_SUBNORMAL_BITS = int(np.float32(schema.FLOAT16_SMALLEST_SUBNORMAL).view(np.int32))


def _counts(bits: jax.Array) -> jax.Array:
    """[..., 3]: zero, below_normal, below_subnormal of samples' magnitude
    bits [..., values] (negative: no value): three comparisons a value,
    where a histogram costs a scatter."""
    nonzero = bits > 0
    return jnp.stack([
        jnp.sum(bits == 0, axis=-1, dtype=jnp.float32),
        jnp.sum(nonzero & (bits < _NORMAL_BITS), axis=-1, dtype=jnp.float32),
        jnp.sum(nonzero & (bits < _SUBNORMAL_BITS), axis=-1, dtype=jnp.float32),
    ], axis=-1)


def gradient_statistics(gradients: Sequence, scale,
                        all_finite=None) -> tuple[jax.Array, jax.Array]:
    """[len(gradients), SUMMARY_COLUMNS] rows of (loss-scaled) gradients and
    of the gradients unscaled (`gradient / scale` in float32), without the
    histograms that a gradient's record does not keep.

    All gradients go together, so that their rows cost a fixed few device
    ops however many there are: one branch for all (every gradient finite
    and a scale of at least 1, or not) and one pass over the samples. The
    unscaled rows cost no pass over a gradient: dividing by a positive scale
    keeps the order of magnitudes (rounding is monotone), so the largest
    finite magnitude is the scaled one divided, and with a scale of at least
    1 no finite value becomes non-finite; their counts come from the same
    samples divided. Otherwise a pass counts.

    Args:
        gradients: the gradient arrays (traced or concrete).
        scale: the loss scale they carry.
        all_finite: whether every gradient is known finite (a boolean
            scalar: a LossScaleOptimizer's verdict on the same gradients),
            or None to check here.
    """
    flats = [_flat(g) for g in gradients]
    if not flats:
        empty = jnp.zeros((0, SUMMARY_COLUMNS), jnp.float32)
        return empty, empty
    scale = jnp.asarray(scale, jnp.float32)
    sized = [v for v in flats if v.shape[0]]
    peaks = jnp.stack([jnp.max(jnp.abs(v)).astype(jnp.float32) if v.shape[0]
                       else jnp.float32(0) for v in flats])
    if all_finite is None:
        all_finite = jnp.isfinite(sum(
            (jnp.sum(v * jnp.zeros((), v.dtype), dtype=jnp.float32) for v in sized),
            jnp.float32(0)))

    def quick():
        nonfinite = jnp.zeros((len(flats),), jnp.float32)
        return nonfinite, peaks, nonfinite, peaks / scale

    def counted():
        def exact(values):
            if not values.shape[0]:
                return jnp.float32(0), jnp.float32(0)
            return _exact(values)

        scaled = [exact(v) for v in flats]
        unscaled = [exact(v.astype(jnp.float32) / scale) for v in flats]
        return (jnp.stack([n for n, _ in scaled]), jnp.stack([m for _, m in scaled]),
                jnp.stack([n for n, _ in unscaled]), jnp.stack([m for _, m in unscaled]))

    nonfinite, abs_max, unscaled_nonfinite, unscaled_abs_max = jax.lax.cond(
        jnp.logical_and(all_finite, scale >= 1), quick, counted)
    # The samples, padded with -1 (no count takes a negative), in one array.
    samples, per_stratum = [], []
    for values in flats:
        bits, stratum = _sample(values) if values.shape[0] else (jnp.zeros((0,), jnp.int32), 1.0)
        samples.append(jnp.pad(bits, (0, SAMPLE_VALUES - bits.shape[0]), constant_values=-1))
        per_stratum.append(stratum)
    bits = jnp.stack(samples)
    strata = jnp.asarray(per_stratum, jnp.float32)[:, None]
    unscaled_bits = jnp.where(bits < 0, -1, jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(bits, jnp.float32) / scale, jnp.int32))
    count = jnp.asarray([v.shape[0] for v in flats], jnp.float32)
    return (
        jnp.concatenate([jnp.stack([count, nonfinite, abs_max], axis=1),
                         _counts(bits) * strata], axis=1),
        jnp.concatenate([jnp.stack([count, unscaled_nonfinite, unscaled_abs_max], axis=1),
                         _counts(unscaled_bits) * strata], axis=1),
    )


def merge_rows(rows) -> jax.Array:
    """Rows of one tensor's several calls as one: sums, abs-max the maximum."""
    rows = jnp.stack(rows)
    total = jnp.sum(rows, axis=0)
    return total.at[ABS_MAX].set(jnp.max(rows[:, ABS_MAX]))


def statistics_of_summaries(rows: np.ndarray) -> np.ndarray:
    """[..., SUMMARY_COLUMNS] rows as [..., NUMERICS_STAT_COLUMNS] (host)."""
    rows = np.asarray(rows, dtype=np.float64)
    finite = rows[..., COUNT] - rows[..., NONFINITE]
    zero, below_normal, below_subnormal = (
        np.minimum(rows[..., FIRST_BIN + i], finite) for i in range(3))
    columns = {
        "count": rows[..., COUNT],
        "nonfinite": rows[..., NONFINITE],
        "zero": zero,
        "below_normal": below_normal,
        "below_subnormal": below_subnormal,
        "abs_max": rows[..., ABS_MAX],
    }
    return np.stack([columns[c] for c in schema.NUMERICS_STAT_COLUMNS], axis=-1)
