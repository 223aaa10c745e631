"""The raw statistics row every backend's numerics taps add up on the device,
and its reading on the host (framework-free, shared so that the NUMERICS
records read the same on every backend).

A raw row (one per tensor, summed over a sampled step's calls and steps,
abs-max the maximum): the value count, how many values are non-finite and the
largest finite magnitude, all exact; then, from a sample of at most
`SAMPLE_VALUES` values spread over the tensor (a tensor that small is taken
whole), the log2-magnitude histogram, the zeros and the non-finite values,
scaled to the whole tensor. `statistics_of_rows` turns such rows into the
`schema.NUMERICS_STAT_COLUMNS` and the histogram: the histogram's edges
include float16's smallest normal and subnormal, so the counts below them are
sums of whole bins. Each backend's `tensor_statistics.raw_statistics`
computes a row in its framework.
"""

from __future__ import annotations

import numpy as np

from mpprof.records import schema

# Values a tensor's shares and histogram are estimated from, at most. The
# standard error of an estimated share is at most 0.5 / sqrt(SAMPLE_VALUES),
# 0.8 percentage points: far finer than the 10% and 90% thresholds (and the
# 30-point gap) the diagnosis judges shares by.
SAMPLE_VALUES = 2**12
# The `schema.NUMERICS_COUNT_COLUMNS` (and the histogram) estimated from the
# sample; the others are exact.
ESTIMATED_COLUMNS = ("zero", "below_normal", "below_subnormal")

# Histogram bins: edges 2 binades apart, so a value's bin follows from its
# binary exponent alone. Two more bins count the sample's zeros and its
# non-finite values.
BINS = len(schema.NUMERICS_HIST_EDGES) + 1
ZERO_BIN, NONFINITE_BIN = BINS, BINS + 1
# The histogram bins wholly below float16's smallest normal and subnormal
# (both are histogram edges: bin b < this lies below edge b).
BELOW_NORMAL_BINS = schema.NUMERICS_HIST_EDGES.index(
    int(np.log2(schema.FLOAT16_SMALLEST_NORMAL))) + 1
BELOW_SUBNORMAL_BINS = schema.NUMERICS_HIST_EDGES.index(
    int(np.log2(schema.FLOAT16_SMALLEST_SUBNORMAL))) + 1

# A raw row: count, non-finite and abs-max (exact), then the sample's bins.
COUNT, NONFINITE, ABS_MAX, FIRST_BIN = 0, 1, 2, 3
RAW_COLUMNS = FIRST_BIN + BINS + 2

# Sampled position i lies at (i + JITTER[i]) strata into the tensor: one in
# each of SAMPLE_VALUES equal strata, at a fixed place (so that a step's
# sample is reproducible) that varies irregularly from one stratum to the
# next (so that the positions never step in time with a channel count: a
# stride of 16 over 16 channels would sample one channel only). Float64, so
# that positions are exact in tensors of billions of values.
JITTER = np.random.default_rng(0).random(SAMPLE_VALUES)
STRATUM_POSITIONS = np.arange(SAMPLE_VALUES) + JITTER


def bins_of_exponents(exponent_bits: int, bias: int) -> np.ndarray:
    """For every value of a float format's exponent bits, the bin of a value
    with that exponent: bin b >= 1 holds [2**FIRST * 4**(b - 1), 2**FIRST * 4**b),
    bin 0 everything smaller (subnormals too), the last everything larger;
    all exponent bits set is inf or NaN."""
    exponent = np.arange(2**exponent_bits) - bias
    bins = np.clip((exponent - schema.NUMERICS_HIST_EDGES[0]) // 2 + 1, 0, BINS - 1)
    bins[-1] = NONFINITE_BIN
    return bins.astype(np.int32)


def statistics_of_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., RAW_COLUMNS] rows (summed over call sites and steps, abs-max the
    maximum) as ([..., NUMERICS_STAT_COLUMNS], [..., histogram bins]).

    An estimated count never claims more values than the finite ones there are.
    """
    rows = np.asarray(rows, dtype=np.float64)
    bins = rows[..., FIRST_BIN:]
    histogram = bins[..., :BINS]
    finite = rows[..., COUNT] - rows[..., NONFINITE]
    columns = {
        "count": rows[..., COUNT],
        "nonfinite": rows[..., NONFINITE],
        "zero": np.minimum(bins[..., ZERO_BIN], finite),
        "below_normal": np.minimum(histogram[..., :BELOW_NORMAL_BINS].sum(-1), finite),
        "below_subnormal": np.minimum(histogram[..., :BELOW_SUBNORMAL_BINS].sum(-1), finite),
        "abs_max": rows[..., ABS_MAX],
    }
    return np.stack([columns[c] for c in schema.NUMERICS_STAT_COLUMNS], axis=-1), histogram
