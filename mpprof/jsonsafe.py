"""Values made strict JSON: numpy made Python, non-finite floats made legal.

Strict JSON (and the browser's `JSON.parse`) has no NaN or Infinity, yet an
overflow's evidence is often inf and unmeasured samples are NaN. Findings
keep them readable as "inf"/"nan"; plot data turns them into null, a gap.
"""

from __future__ import annotations

import math

import numpy as np


def json_safe(value, *, nonfinite_as_null: bool = False):
    """`value` with numpy arrays and scalars made Python, keys made strings and
    non-finite floats made "inf"/"-inf"/"nan" (or None).

    Args:
        value: a number, string, None, or a dict/list/tuple/array of them.
        nonfinite_as_null: None instead of a string for a non-finite float.
    """
    if isinstance(value, dict):
        return {str(k): json_safe(v, nonfinite_as_null=nonfinite_as_null) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [json_safe(v, nonfinite_as_null=nonfinite_as_null) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if nonfinite_as_null else str(value)
    return value


def json_floats(values, decimals: int | None = None) -> list:
    """A (nested) list of floats, NaN and infinities as None, for plot data.

    Args:
        values: an array (any shape) of numbers.
        decimals: round to this many decimals (payload size), or not at all.
    """
    values = np.asarray(values, dtype=np.float64)
    if decimals is not None:
        values = np.round(values, decimals)
    return np.where(np.isfinite(values), values, None).tolist()
