"""The data of a run's report plots: loss scale, numerics heatmaps, GPU tracks.

Large runs are downsampled (`mpprof.display.downsample`, shared with the dashboard)
to what a screen can show, keeping extremes, so a million-step run still
makes a report of a few megabytes. Plot labels are entity-escaped: plotly
renders its labels as markup.
"""

from __future__ import annotations

import html

import numpy as np

from mpprof import diagnosis
from mpprof.display import downsample, headroom
from mpprof.display import float8 as float8_view
from mpprof.jsonsafe import json_floats
from mpprof.records import reader, schema
from mpprof.terminal import printable

_EVENT = schema.LOSS_SCALE_EVENT_COLUMN

# A plot is at most ~2,000 pixels wide: more points than this per line (the
# loss-scale step function is kept as min/max per bucket) cannot be seen.
MAX_TIMELINE_POINTS = 4_000
# Overflow/growth markers drawn one by one; beyond this, one marker per
# bucket of steps, its hover text saying how many it stands for.
MAX_EVENT_MARKERS = 2_000
# Numerics heatmap columns (sampled steps); consecutive samples are merged
# keeping the worst value, so an overflow never disappears.
MAX_HEATMAP_STEPS = 300
# GPU samples per line.
MAX_GPU_POINTS = 2_000
# Float8 share heatmaps: rows (layer x tensor) and columns (sampled steps).
MAX_FLOAT8_ROWS = 300
# Float8 layers drawn in the scale/amax charts (one line pair each).
MAX_FLOAT8_LAYERS = 12
# Flushes per float8 scale/amax line.
MAX_FLOAT8_POINTS = 1_000
# GPU sample columns drawn as tracks (those present with any finite value).
GPU_TRACKS = (
    ("tensor_util", "Tensor Core activity (%)"),
    ("sm_util", "SM activity (%)"),
    ("gpu_util", "GPU utilisation (%)"),
    ("mem_util", "memory bandwidth utilisation (%)"),
    ("power_w", "power (W)"),
)


def run_data(run: reader.Run) -> dict:
    """What the plots of one run need, downsampled and JSON-ready."""
    data: dict = {"name": _label(run.name)}
    if run.loss_scale is not None:
        data["loss_scale"] = _loss_scale_data(run.loss_scale)
    numerics = run.numerics
    if numerics is not None and len(numerics.steps) and len(numerics.layers):
        data["numerics"] = _numerics_data(run)
    if run.gpu is not None:
        tracks = _gpu_data(run.gpu)
        if tracks:
            data["gpu"] = tracks
    if run.float8 is not None:
        data["float8"] = _float8_data(run.float8)
    return data


def _float8_data(float8: reader.Float8) -> dict:
    """The float8 view: share heatmaps (layer x tensor rows, sampled steps)
    and, per tensor, each layer's latest amax and scale x format max over the
    flushes (the first `MAX_FLOAT8_LAYERS` layers)."""
    maps = float8_view.share_maps(float8, MAX_FLOAT8_ROWS, MAX_HEATMAP_STEPS)
    drawn = float8.layers[:MAX_FLOAT8_LAYERS]
    series = [float8_view.layer_series(float8, i, MAX_FLOAT8_POINTS) for i in range(len(drawn))]
    return {
        "rows": [_label(row) for row in maps.rows],
        "steps": maps.column_steps,
        "maps": {name: json_floats(values, decimals=4) for name, values in maps.values.items()},
        "layers": [_label(layer) for layer in drawn],
        "layers_total": len(float8.layers),
        "tensors": {
            tensor: {
                "title": _label(f"{tensor} ({float8_view.FORMAT_NAMES.get(fmt, fmt)})"),
                "lines": [
                    {
                        "steps": s["steps"],
                        "amax": json_floats(s["tensors"][tensor]["amax_last"]),
                        "scale_range": json_floats(s["tensors"][tensor]["scale_range"]),
                        "scale": json_floats(s["tensors"][tensor]["scale"]),
                    }
                    for s in series
                ],
            }
            for tensor, fmt in ((t, float8.formats.get(t, "")) for t in float8.tensors)
        },
    }


def _loss_scale_data(loss_scale: reader.LossScale) -> dict:
    steps, scales = loss_scale.series()
    kept = downsample.envelope(steps, scales, MAX_TIMELINE_POINTS)
    overflows = loss_scale.overflows
    growths = loss_scale.growths
    return {
        "steps": steps[kept].tolist(),
        "scales": json_floats(scales[kept]),
        "overflows": event_markers(overflows[:, _EVENT.step], overflows[:, _EVENT.scale_before]),
        "growths": event_markers(growths[:, _EVENT.step], growths[:, _EVENT.scale_after]),
        "overflow_count": len(overflows),
        "growth_count": len(growths),
    }


def event_markers(steps: np.ndarray, scales: np.ndarray) -> dict:
    """Marker positions; beyond MAX_EVENT_MARKERS one per bucket, with counts."""
    steps = steps.astype(np.int64)
    if len(steps) <= MAX_EVENT_MARKERS:
        return {"steps": steps.tolist(), "scales": json_floats(scales), "counts": None}
    edges = np.linspace(steps.min(), steps.max() + 1, MAX_EVENT_MARKERS + 1)
    bucket = np.clip(np.searchsorted(edges, steps, side="right") - 1, 0, MAX_EVENT_MARKERS - 1)
    used, first, counts = np.unique(bucket, return_index=True, return_counts=True)
    peak = np.full(MAX_EVENT_MARKERS, -np.inf)
    np.maximum.at(peak, bucket, scales)
    return {
        "steps": steps[first].tolist(),
        "scales": json_floats(peak[used]),
        "counts": counts.tolist(),
    }


def _numerics_data(run: reader.Run) -> dict:
    """The heatmaps (layer x merged samples) and their overflow markers."""
    numerics = run.numerics
    steps = np.asarray(numerics.steps, dtype=np.int64)
    # Consecutive samples merged into columns; each keeps its worst value.
    starts = downsample.group_starts(len(steps), MAX_HEATMAP_STEPS)
    forward_max = np.asarray(numerics.forward["abs_max"], dtype=np.float64)
    backward_max = np.asarray(numerics.backward["abs_max"], dtype=np.float64)
    # Overflowed or not: the diagnosis decides, by each layer's own dtype.
    forward_overflowed = diagnosis.forward_overflow_mask(run)
    bits = headroom.headroom_bits(numerics.policy_max, forward_max, forward_overflowed)
    maps = {
        # The worst (least) headroom of the samples a column merges.
        "forward_headroom": json_floats(-_worst_per_column(-bits, starts), decimals=2),
        "backward_log10_abs_max": _log10_map(backward_max, starts),
        "forward_nonfinite_frac": json_floats(
            _worst_per_column(numerics.forward["nonfinite_frac"], starts), decimals=3
        ),
        "backward_underflow_frac": json_floats(
            _worst_per_column(numerics.backward["underflow_frac"], starts), decimals=3
        ),
    }
    overflow = {
        "forward": _overflow_cells(forward_overflowed, starts),
        "backward": _overflow_cells(diagnosis.backward_overflow_mask(run), starts),
    }
    return {
        "layers": [_label(name) for name in numerics.layers],
        "steps": steps[starts].tolist(),
        **headroom.dtype_fields(numerics.policy_max),
        "maps": maps,
        "overflow": overflow,
        "forensic_steps": steps[np.asarray(numerics.forensic, dtype=bool)].tolist()[
            :MAX_EVENT_MARKERS
        ],
    }


def _worst_per_column(values, starts: np.ndarray) -> np.ndarray:
    """[samples, layers] values as [layers, columns], each column the max of
    the samples it merges (NaN ignored)."""
    values = np.asarray(values, dtype=np.float64).T
    return downsample.pool_max(values, np.arange(len(values)), starts)


def _log10_map(abs_max: np.ndarray, starts: np.ndarray) -> list:
    with np.errstate(all="ignore"):
        finite = np.where(np.isfinite(abs_max) & (abs_max > 0), abs_max, np.nan)
        return json_floats(np.log10(_worst_per_column(finite, starts)), decimals=2)


def _overflow_cells(overflowed: np.ndarray, starts: np.ndarray) -> dict:
    """(layer, column) cells where any merged sample overflowed, for markers
    over a heatmap."""
    merged = np.logical_or.reduceat(np.asarray(overflowed, dtype=bool), starts, axis=0).T
    layer, column = np.nonzero(merged)
    keep = slice(0, MAX_EVENT_MARKERS)
    return {"layer": layer[keep].tolist(), "column": column[keep].tolist()}


def _gpu_data(gpu: reader.Gpu) -> list[dict]:
    """One track per recorded GPU_TRACKS column, a line per device (bucket
    means over time), x in seconds since the first sample."""
    tracks_by_device = downsample.device_tracks(gpu.samples, MAX_GPU_POINTS)
    if not tracks_by_device:
        return []
    with np.errstate(all="ignore"):
        start = np.nanmin([np.nanmin(t["wall_time"]) for t in tracks_by_device.values()])
    tracks = []
    for column, title in GPU_TRACKS:
        if not any(np.isfinite(t[column]).any() for t in tracks_by_device.values()):
            continue
        lines = [
            {
                "name": f"GPU {device}",
                "x": json_floats(track["wall_time"] - start, decimals=2),
                "y": json_floats(track[column], decimals=2),
            }
            for device, track in tracks_by_device.items()
        ]
        tracks.append({"title": title, "lines": lines})
    return tracks


def _label(text) -> str:
    """`text` for a plotly label: plotly renders labels as markup, so escape
    it, and control and bidi-override characters too (see `sections.escape`)."""
    return html.escape(printable(text), quote=False)
