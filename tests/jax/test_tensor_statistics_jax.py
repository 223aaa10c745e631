"""The JAX statistics rows against NumPy, value by value: the exact columns
(count, non-finite, largest finite magnitude), the sampled counts and the
log2 histogram, for float16, bfloat16 and float32, and a gradient's
unscaled row for scales above, at and below 1."""

import ml_dtypes
import numpy as np
import pytest

from mpprof.backends import numerics_rows
from mpprof.backends.jax import tensor_statistics as ts
from mpprof.records import schema

EDGES = np.asarray(schema.NUMERICS_HIST_EDGES, dtype=np.float64)
STAT = {name: i for i, name in enumerate(schema.NUMERICS_STAT_COLUMNS)}


def _values(size: int, dtype, rng) -> np.ndarray:
    """Every kind of value: zeros, float16 subnormals and smaller, normals
    over 60 binades, the dtype's largest, infinities and NaN."""
    magnitudes = 2.0 ** rng.uniform(-45, 20, size)
    values = magnitudes * rng.choice([-1.0, 1.0], size)
    values[rng.random(size) < 0.05] = 0.0
    values[:4] = [np.inf, -np.inf, np.nan, float(ml_dtypes.finfo(dtype).max)]
    values[4:8] = [2.0**-14, 2.0**-24, 2.0**-25, -0.0]
    rng.shuffle(values)
    with np.errstate(over="ignore"):  # beyond float16's range: infinities
        return values.astype(dtype)


def _sample(flat: np.ndarray) -> tuple[np.ndarray, float]:
    """The documented sample: all of a small array; else one value per
    equal stratum at the fixed jitter."""
    size = flat.size
    if size <= numerics_rows.SAMPLE_VALUES:
        return flat, 1.0
    strata = size / numerics_rows.SAMPLE_VALUES
    index = np.minimum((numerics_rows.STRATUM_POSITIONS * strata).astype(np.int64), size - 1)
    return flat[index], strata


def _expected(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([NUMERICS_STAT_COLUMNS], histogram) computed in float64 by NumPy."""
    flat = values.astype(np.float64).reshape(-1)
    finite = np.isfinite(flat)
    sample, strata = _sample(flat)
    magnitude = np.abs(sample[np.isfinite(sample)])
    nonzero = magnitude[magnitude > 0]
    stats = np.zeros(len(STAT))
    stats[STAT["count"]] = flat.size
    stats[STAT["nonfinite"]] = (~finite).sum()
    stats[STAT["abs_max"]] = np.abs(flat[finite]).max()
    stats[STAT["zero"]] = (magnitude == 0).sum() * strata
    stats[STAT["below_normal"]] = (nonzero < 2.0**-14).sum() * strata
    stats[STAT["below_subnormal"]] = (nonzero < 2.0**-24).sum() * strata
    # Bin b >= 1 holds [2**EDGES[b-1], 2**EDGES[b]); bin 0 all below.
    bins = np.searchsorted(EDGES, np.log2(nonzero), side="right")
    histogram = np.bincount(bins, minlength=len(EDGES) + 1) * strata
    return stats, histogram


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
@pytest.mark.parametrize("size", [1000, 50_000])
def test_raw_statistics_match_numpy(dtype, size):
    values = _values(size, dtype, np.random.default_rng(size))
    stats, histogram = numerics_rows.statistics_of_rows(np.asarray(ts.raw_statistics(values)))
    expected_stats, expected_histogram = _expected(values)
    np.testing.assert_allclose(stats, expected_stats, rtol=1e-6)
    np.testing.assert_allclose(histogram, expected_histogram, rtol=1e-6)


def test_a_finite_array_has_no_nonfinite_and_its_exact_peak():
    values = np.linspace(-3.0, 2.5, 200_000, dtype=np.float32)
    stats, _ = numerics_rows.statistics_of_rows(np.asarray(ts.raw_statistics(values)))
    assert stats[STAT["nonfinite"]] == 0
    assert stats[STAT["abs_max"]] == 3.0


@pytest.mark.parametrize("size", [1000, 50_000])
def test_nan_anywhere_in_a_large_array_is_counted(size):
    # XLA's vectorized CPU maximum drops NaN: the count must not.
    for position in (0, size // 3, size - 1):
        values = np.ones(size, np.float32)
        values[position] = np.nan
        stats, _ = numerics_rows.statistics_of_rows(np.asarray(ts.raw_statistics(values)))
        assert stats[STAT["nonfinite"]] == 1, position
        assert stats[STAT["abs_max"]] == 1.0


@pytest.mark.parametrize("scale", [2.0**15, 3.0, 1.0, 0.5])
@pytest.mark.parametrize("size", [1000, 200_704])
def test_gradient_rows_match_numpy_scaled_and_unscaled(scale, size):
    gradient = _values(size, np.float32, np.random.default_rng(7))
    # Finite, yet non-finite once divided by a scale below 1.
    gradient[np.flatnonzero(np.isfinite(gradient))[:3]] = np.float32(3e38)
    # Beside it: a finite gradient, an empty one and one of float16.
    finite = np.random.default_rng(8).standard_normal((64, 3)).astype(np.float32)
    empty = np.zeros((0,), np.float32)
    half = _values(700, np.float16, np.random.default_rng(9))
    gradients = [gradient, finite, empty, half]
    scaled, unscaled = ts.gradient_statistics(gradients, np.float32(scale))
    scaled = ts.statistics_of_summaries(np.asarray(scaled))
    unscaled = ts.statistics_of_summaries(np.asarray(unscaled))
    for i, g in enumerate(gradients):
        if g.size:
            np.testing.assert_allclose(scaled[i], _expected(g)[0], rtol=1e-6)
            with np.errstate(over="ignore"):
                divided = g.astype(np.float32) / np.float32(scale)
            np.testing.assert_allclose(unscaled[i], _expected(divided)[0], rtol=1e-6)
        else:
            assert not scaled[i].any() and not unscaled[i].any()
    if scale < 1:
        # The three planted and float32's largest overflow too.
        assert unscaled[0, STAT["nonfinite"]] == (~np.isfinite(gradient)).sum() + 3 + 1


def test_a_verdict_that_every_gradient_is_finite_takes_the_quick_branch():
    # The verdict is trusted (a LossScaleOptimizer's on the same gradients);
    # without one, the gradients are checked here.
    gradient = np.ones(10_000, np.float32)
    gradient[5] = np.inf
    for verdict, nonfinite in ((None, 1), (np.bool_(False), 1), (np.bool_(True), 0)):
        scaled, _ = ts.gradient_statistics([gradient], 1.0, verdict)
        assert ts.statistics_of_summaries(np.asarray(scaled))[0, STAT["nonfinite"]] == nonfinite


def test_an_empty_array_gives_zero_rows():
    empty = np.zeros((0, 4), np.float32)
    assert not np.asarray(ts.raw_statistics(empty)).any()
    assert not any(np.asarray(rows).any() for rows in ts.gradient_statistics([empty], 1.0))
    assert all(np.asarray(rows).shape == (0, ts.SUMMARY_COLUMNS)
               for rows in ts.gradient_statistics([], 1.0))
