"""Statistics of one tensor, as rows the host adds up, on PyTorch.

The row is the shared one (`mpprof.backends.numerics_rows`: its layout,
sample, bins and host reading), computed here with torch ops on the tensor's
own device, so the NUMERICS records read the same on every backend: the
value count, how many values are non-finite and the largest finite
magnitude, exact; then, from a sample of at most `SAMPLE_VALUES` values (one
per equal stratum, at the shared fixed jitter; a smaller tensor whole), the
log2-magnitude histogram, zeros and non-finite values, scaled to the whole
tensor. Only sampled steps compute rows.
"""

from __future__ import annotations

import numpy as np
import torch

from mpprof.backends.numerics_rows import (
    ABS_MAX,
    BINS,
    RAW_COLUMNS,
    SAMPLE_VALUES,
    STRATUM_POSITIONS,
    ZERO_BIN,
    bins_of_exponents,
)

# float32 exponent bits -> bin (all bits set: inf or NaN, `NONFINITE_BIN`).
_BIN_OF_FLOAT32_EXPONENT = torch.as_tensor(bins_of_exponents(8, 127), dtype=torch.int64)
# The sample's positions in a tensor of n values, by n (tensors keep their sizes).
_POSITIONS: dict[tuple[int, str], torch.Tensor] = {}


def _positions(size: int, device: torch.device) -> torch.Tensor:
    key = (size, str(device))
    found = _POSITIONS.get(key)
    if found is None:
        strata = size / SAMPLE_VALUES
        index = np.minimum((STRATUM_POSITIONS * strata).astype(np.int64), size - 1)
        found = _POSITIONS[key] = torch.as_tensor(index, device=device)
    return found


def raw_statistics(tensor: torch.Tensor) -> torch.Tensor:
    """The float32 [RAW_COLUMNS] row of `tensor` (on its device)."""
    with torch.no_grad():
        values = tensor.detach().reshape(-1)
        if values.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            values = values.float()
        size = values.numel()
        device = values.device
        if size == 0:
            return torch.zeros(RAW_COLUMNS, dtype=torch.float32, device=device)
        finite = torch.isfinite(values)
        nonfinite = (~finite).sum(dtype=torch.float32)
        abs_max = torch.where(finite, values.abs(), torch.zeros((), dtype=values.dtype,
                                                                device=device)).max().float()
        strata = max(size / SAMPLE_VALUES, 1.0)
        sample = values if size <= SAMPLE_VALUES else values[_positions(size, device)]
        # Exact: float32 holds every float16 and bfloat16 value.
        bits = sample.float().view(torch.int32) & 0x7FFFFFFF
        table = _BIN_OF_FLOAT32_EXPONENT.to(device)
        bins = torch.where(bits == 0, torch.tensor(ZERO_BIN, device=device),
                           table[(bits >> 23).long()])
        counts = torch.bincount(bins.reshape(-1), minlength=BINS + 2).float()
        return torch.cat([torch.stack([torch.tensor(float(size), device=device),
                                       nonfinite, abs_max]), counts * strata])


def merge_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """Rows of one tensor's several calls as one: sums, abs-max the maximum."""
    stacked = torch.stack(rows)
    total = stacked.sum(dim=0)
    total[ABS_MAX] = stacked[:, ABS_MAX].max()
    return total
