"""How close a layer's values came to the limits of the dtype it computed in.

One measure for every front end (the TensorBoard dashboard and the HTML
report): headroom, the bits left between a layer's largest finite output
magnitude and the largest value of its dtype, `log2(dtype max / abs max)`.
Samples whose output overflowed (as `diagnosis.forward_overflow_mask`
decides it) get `OVERFLOW_HEADROOM`, an all-zero output the most there is.
"""

from __future__ import annotations

import math

import numpy as np

from mpprof.dtypes import DTYPE_RANGES, DtypeRange

# Headroom given to a sample whose output overflowed (non-finite or beyond max).
OVERFLOW_HEADROOM = -1.0
# Above this many bits headroom is plenty in any dtype: colour scales end here.
COLOR_MAX_BITS = 16.0


def dtype_range(policy_max: float) -> DtypeRange:
    """The dtype whose largest value is `policy_max` (the numerics' own record)."""
    return min(DTYPE_RANGES, key=lambda d: abs(math.log2(d.max) - math.log2(policy_max)))


def dtype_fields(policy_max: float) -> dict:
    """What a view needs to judge values by the dtype the layers computed in.

    Args:
        policy_max: the largest value of that dtype (the numerics' record).

    Returns:
        {"policy_max", "dtype", "dtype_smallest_normal", "underflow_applies",
        "headroom_color_max"}; JSON-ready (a non-finite policy_max as None).
    """
    dtype = dtype_range(policy_max)
    return {
        "policy_max": float(policy_max) if math.isfinite(policy_max) else None,
        "dtype": dtype.name,
        "dtype_smallest_normal": dtype.smallest_normal,
        # The recorded underflow/subnormal shares count values below
        # float16's normal/subnormal range: a judgement only for float16.
        "underflow_applies": dtype.name == "float16",
        "headroom_color_max": COLOR_MAX_BITS,
    }


def headroom_bits(policy_max: float, abs_max: np.ndarray, overflowed: np.ndarray) -> np.ndarray:
    """Bits of headroom of each sample (any shape; `overflowed` of the same).

    Args:
        policy_max: the largest value of the dtype the layers computed in.
        abs_max: largest finite output magnitudes.
        overflowed: whether each sample's output overflowed.
    """
    abs_max = np.asarray(abs_max, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        headroom = np.log2(policy_max / abs_max)
    headroom[np.asarray(overflowed, dtype=bool)] = OVERFLOW_HEADROOM
    # An all-zero output has unbounded headroom: show it as the most there is
    # (the dtype's max over its smallest subnormal).
    largest = math.log2(policy_max / dtype_range(policy_max).smallest_subnormal)
    return np.where(np.isposinf(headroom), largest, headroom)
