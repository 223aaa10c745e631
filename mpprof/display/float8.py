"""The data of the float8 view, shared by the dashboard and the HTML report.

Rows are (layer, tensor) pairs, layers in the order `Run.float8` gives them,
each layer's inputs, kernel and output gradient together. The share heatmaps
(rows x sampled steps) keep each cell's worst value when consecutive samples
or rows are merged, and the scale/amax series keep each bucket's largest, so
a saturated step never averages away. Presentation only: labels are plain
text here, each front end escapes them its own way.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mpprof.display import downsample
from mpprof.records import reader

# Short names of the float8 formats, as Keras' docs write them.
FORMAT_NAMES = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
SHARES = ("saturated", "underflowed")


@dataclasses.dataclass
class Float8Maps:
    """Share heatmaps: `values[share]` is [rows, columns], NaN where no
    sample measured a cell.

    Attributes:
        rows: each row's label ("layer · tensor (format)", or a merged range).
        row_layers: the first layer each row covers.
        column_steps: the first sampled step each column covers.
        values: {"saturated": share of values, "underflowed": share of
            non-zero values} per cell.
        samples_total: sampled steps before merging.
    """

    rows: list[str]
    row_layers: list[str]
    column_steps: list[int]
    values: dict[str, np.ndarray]
    samples_total: int


def row_labels(float8: reader.Float8) -> list[tuple[str, str]]:
    """(layer, "layer · tensor (format)") of every row, in row order."""
    return [
        (layer, f"{layer} · {tensor} ({FORMAT_NAMES.get(float8.formats.get(tensor), '?')})")
        for layer in float8.layers for tensor in float8.tensors
    ]


def share_maps(float8: reader.Float8, rows: int, columns: int) -> Float8Maps:
    """The saturation and underflow heatmaps, merged to at most `rows` x `columns`."""
    labels = row_labels(float8)
    row_starts = downsample.group_starts(len(labels), rows)
    steps = np.asarray(float8.sample_steps, dtype=np.int64)
    column_starts = downsample.group_starts(len(steps), columns)
    values = {}
    for share in SHARES:
        matrix = np.asarray(float8.shares[share], dtype=np.float64)  # [S, L, T]
        matrix = matrix.reshape(len(steps), -1).T  # [L*T, S]
        values[share] = downsample.pool_max(matrix, row_starts, column_starts)
    return Float8Maps(
        rows=[_merged_label(labels, row_starts, i) for i in range(len(row_starts))],
        row_layers=[labels[start][0] for start in row_starts.tolist()],
        column_steps=steps[column_starts].tolist() if len(steps) else [],
        values=values,
        samples_total=len(steps),
    )


def layer_series(float8: reader.Float8, layer: int, points: int) -> dict:
    """One layer's delayed scaling over the flushes, at most `points` per line.

    Returns:
        {"steps": [...], "tensors": {tensor: {"scale", "amax_max",
        "amax_last", "scale_range"}}}: each series' largest value per bucket
        of flushes; "scale_range" is the largest magnitude the scale
        represents (scale x the format's max): an amax above it saturated.
    """
    steps = np.asarray(float8.steps, dtype=np.int64)
    starts = downsample.group_starts(len(steps), points)
    tensors = {}
    for ti, tensor in enumerate(float8.tensors):
        fmax = float8.format_max.get(float8.formats.get(tensor), np.nan)
        series = {
            name: np.asarray(float8.state[name][:, layer, ti], dtype=np.float64)
            for name in ("scale", "amax_max", "amax_last")
        }
        series["scale_range"] = series["scale"] * fmax
        tensors[tensor] = {
            name: downsample.pool_max(values[None, :], np.zeros(1, np.int64), starts)[0]
            for name, values in series.items()
        }
    return {"steps": steps[starts].tolist() if len(steps) else [], "tensors": tensors}


def _merged_label(labels: list[tuple[str, str]], starts: np.ndarray, i: int) -> str:
    first = int(starts[i])
    last = int(starts[i + 1]) - 1 if i + 1 < len(starts) else len(labels) - 1
    if first == last:
        return labels[first][1]
    return f"{labels[first][1]} … {labels[last][1]} ({last - first + 1} rows)"
