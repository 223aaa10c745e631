"""Shrinks series and matrices to what a screen can show, keeping extremes.

A chart a few thousand pixels wide cannot show a million steps; averaging
would hide the one overflow a user looks for, so series keep each bucket's
extremes and matrices keep each cell's worst value. The HTML report and the
TensorBoard dashboard both draw through these.
"""

from __future__ import annotations

import numpy as np

from mpprof.records import schema


def group_starts(length: int, groups: int) -> np.ndarray:
    """Start indices of min(`length`, `groups`) contiguous groups of `length`
    items, their sizes differing by at most one."""
    count = min(length, max(1, groups))
    if not count:
        return np.zeros(0, dtype=np.int64)
    return np.arange(count, dtype=np.int64) * length // count


def envelope(x: np.ndarray, y: np.ndarray, points: int) -> np.ndarray:
    """Indices of at most ~`points` samples keeping each x bucket's min and max.

    `x` is sorted. The first and last samples are always kept, so a step
    function drawn through the kept vertices spans the whole run.
    """
    if len(x) <= points:
        return np.arange(len(x))
    span = float(x[-1] - x[0]) or 1.0
    buckets = np.minimum(((x - x[0]) / span * (points // 2)).astype(np.int64), points // 2 - 1)
    order = np.lexsort((y, buckets))
    sorted_buckets = buckets[order]
    first = np.r_[True, sorted_buckets[1:] != sorted_buckets[:-1]]
    last = np.r_[sorted_buckets[1:] != sorted_buckets[:-1], True]
    kept = np.concatenate([order[first], order[last], [0, len(x) - 1]])
    return np.unique(kept)


def evenly(count: int, limit: int) -> np.ndarray:
    """At most `limit` evenly spread indices into `count` items."""
    if count <= limit:
        return np.arange(count)
    return np.unique(np.linspace(0, count - 1, limit).round().astype(np.int64))


def pool_max(matrix: np.ndarray, row_starts: np.ndarray, column_starts: np.ndarray) -> np.ndarray:
    """Max of each (row group, column group) cell, ignoring NaN (NaN if all are)."""
    if matrix.size == 0:
        return matrix.reshape(len(row_starts), len(column_starts))
    pooled = np.fmax.reduceat(matrix, row_starts, axis=0)
    return np.fmax.reduceat(pooled, column_starts, axis=1)


def pool_mean(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Mean of each group of a 1-D series, ignoring NaN (NaN if all are)."""
    finite = ~np.isnan(values)
    sums = np.add.reduceat(np.where(finite, values, 0.0), starts)
    counts = np.add.reduceat(finite.astype(np.float64), starts)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)



def device_tracks(samples: np.ndarray, points: int) -> dict[int, dict[str, np.ndarray]]:
    """GPU_SAMPLES rows per device, in time order, as at most `points` bucket
    means per column.

    Args:
        samples: the run's GPU_SAMPLES rows (`schema.GPU_SAMPLE_COLUMNS`).
        points: the most values per column and device.

    Returns:
        {device index: {column: means}} for every column but "device".
    """
    columns = list(schema.GPU_SAMPLE_COLUMNS)
    samples = np.asarray(samples, dtype=np.float64).reshape(-1, len(columns))
    devices = samples[:, columns.index("device")]
    tracks = {}
    for device in np.unique(devices[np.isfinite(devices)]):
        rows = samples[devices == device]
        rows = rows[np.argsort(rows[:, columns.index("wall_time")], kind="stable")]
        starts = group_starts(len(rows), points)
        tracks[int(device)] = {
            name: pool_mean(rows[:, i], starts)
            for i, name in enumerate(columns)
            if name != "device"
        }
    return tracks
