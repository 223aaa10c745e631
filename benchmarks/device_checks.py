"""What the device checks (`gpu_check_jax.py`, `gpu_check_torch.py`) read
back alike, with Keras and mpprof alone (any backend)."""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np

from mpprof import cli


def column_medians(gpu, columns: tuple[str, ...], rows=slice(None)) -> dict:
    """The median of each NVML column's finite values in `rows` (None: no
    value), for the columns this run's samples have."""
    medians = {}
    for column in columns:
        try:
            values = gpu.column(column)[rows]
        except ValueError:
            continue
        values = values[np.isfinite(values)]
        medians[column] = float(np.median(values)) if len(values) else None
    return medians


def diagnose(log_dir: str) -> dict:
    """`mpprof diagnose LOG_DIR --format json`: its exit status and findings."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["diagnose", log_dir, "--format", "json"])
    return {"exit": code, "findings": json.loads(out.getvalue())}
