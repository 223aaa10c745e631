"""Inputs past the dtype's range: the lead fix is to bound them.

When a model input holds values past what the run's half dtype can hold
(float16's 65504: 16-bit images in raw units, 0..65535, with the `/ 65535`
forgotten), the first op to overflow is the cast of that input, and keeping
the first layer in float32 only moves the problem: its output, as large,
feeds the next float16 layer, and the model may stop learning even where
nothing overflows. The fix is to bring the inputs into range: a float32
`Rescaling` first layer, or the division in the input pipeline. This module
says when that is the lead fix, with the input's observed range and the
scale, and writes the code for the run's backend; the replay verifies it as
any fix (`mpprof.replay.verification.Candidate(input_scale=...)`).

Framework-free.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from mpprof import dtypes
from mpprof.fix_syntax import FixSyntax

# 16-bit integer data (images, sensors) spans 0..65535: dividing by its full
# range maps it to [0, 1].
UINT16_RANGE = 65535.0
UINT8_RANGE = 255.0


@dataclasses.dataclass
class InputRange:
    """What one model input held in the captured batch.

    Attributes:
        input: its position in the flattened inputs ("x", or "x[1]").
        dtype: its dtype as captured.
        min, max, abs_max: its finite values' range.
        integer_valued: every value is a whole number.
    """

    input: str
    dtype: str
    min: float
    max: float
    abs_max: float
    integer_valued: bool

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def observe(inputs: list[np.ndarray]) -> list[InputRange]:
    """The range of each numeric model input (the captured batch's x)."""
    ranges = []
    for i, leaf in enumerate(inputs):
        values = np.asarray(leaf)
        if not values.size or not np.issubdtype(values.dtype, np.number) \
                or np.issubdtype(values.dtype, np.bool_):
            continue
        as_float = values.astype(np.float64)
        finite = as_float[np.isfinite(as_float)]
        if not finite.size:
            continue
        ranges.append(InputRange(
            input="x" if len(inputs) == 1 else f"x[{i}]", dtype=str(values.dtype),
            min=float(finite.min()), max=float(finite.max()),
            abs_max=float(np.abs(finite).max()),
            integer_valued=bool(np.all(finite == np.round(finite)))))
    return ranges


def past_range(ranges: list[InputRange], dtype: str) -> list[InputRange]:
    """The inputs holding values beyond `dtype`'s max."""
    limit = dtypes.DTYPE_MAX.get(dtype)
    return [r for r in ranges if limit is not None and r.abs_max > limit]


def scale_for(offending: list[InputRange]) -> tuple[float, str]:
    """The scale that bounds the inputs, and its text for code (`1 / 65535`).

    Whole numbers in 0..65535 are 16-bit data: divided by 65535, they span
    [0, 1]. Otherwise by the power of ten at or above the largest abs max
    seen (a round number a user can check against the data's units)."""
    top = max(r.abs_max for r in offending)
    if all(r.integer_valued and r.min >= 0 for r in offending) and top <= UINT16_RANGE:
        return 1.0 / UINT16_RANGE, "1 / 65535"
    power = 10 ** math.ceil(math.log10(top))
    return 1.0 / power, f"1 / {power:.0e}".replace("e+0", "e").replace("e+", "e")


def bound_inputs_fix(offending: list[InputRange], dtype: str, backend: str | None,
                     keras_flavor: str | None, first_op: dict | None) -> dict:
    """The lead fix's description (verified separately)."""
    scale, scale_text = scale_for(offending)
    shown = "; ".join(
        f"{r.input} ({r.dtype}) spans {r.min:.6g}..{r.max:.6g}, abs max {r.abs_max:.6g}"
        for r in offending)
    cast = (first_op is not None and first_op.get("phase") == "forward"
            and first_op.get("op") in ("Cast", "convert_element_type"))
    why = (f"the first op to overflow is the cast of a model input to {dtype}"
           if cast else f"a model input holds values past {dtype}'s max")
    return {
        "kind": "bound_inputs",
        "inputs": [r.to_dict() for r in offending],
        "dtype": dtype,
        "dtype_max": dtypes.DTYPE_MAX.get(dtype),
        "scale": scale,
        "scale_text": scale_text,
        "why": (f"{why}: {shown}, past {dtype}'s max {dtypes.DTYPE_MAX.get(dtype):.6g}; "
                f"bound the inputs (multiply by {scale_text}) rather than keep a layer in "
                "float32"),
        "code": FixSyntax(keras_flavor, backend).scale_inputs(scale_text),
    }
