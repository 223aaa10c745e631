"""JSON-ready payloads of the plugin's routes, built from a `mpprof.records.reader.Run`.

Presentation only: values come from the reader and findings from
`mpprof.diagnosis`; nothing here judges a run. What a run did not record
comes back as `{"available": false, "reason": ...}` so every view can say
"not measured" instead of breaking.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from tensorboard import errors

from mpprof import diagnosis
from mpprof.display import downsample, headroom
from mpprof.display import float8 as float8_view
from mpprof.display.run_digest import severity_counts
from mpprof.jsonsafe import json_floats, json_safe
from mpprof.records import reader
from mpprof.replay import files as replay_files
from mpprof.replay import text as replay_text
from tensorboard_plugin_mpprof import metadata

NUMERICS_DIRECTIONS = ("forward", "backward")
NUMERICS_STATS = (
    "abs_max",
    "nonfinite_frac",
    "zero_frac",
    "underflow_frac",
    "subnormal_frac",
)
# Derived from the forward abs max: log2(largest finite value / abs max).
HEADROOM = "headroom"
# Enough digits for a heatmap's colour and hover; the rest is payload size.
# abs_max keeps full precision (it spans 40 binades).
_DECIMALS = {
    HEADROOM: 2,
    "nonfinite_frac": 5,
    "zero_frac": 5,
    "underflow_frac": 5,
    "subnormal_frac": 5,
}
OVERFLOW_HEADROOM = headroom.OVERFLOW_HEADROOM
SEVERITIES = diagnosis.SEVERITIES


def not_available(reason: str, **extra) -> dict:
    return {"available": False, "reason": reason, **extra}


def evaluate(run: reader.Run) -> diagnosis.Diagnosis:
    """The diagnosis of `run`: its findings and what each rule could check."""
    return diagnosis.evaluate(run)


def unchecked_notes(result: diagnosis.Diagnosis) -> list[dict]:
    """The rules that could not look at the run, and why ("not measured"...),
    as `Diagnosis.notes` orders them."""
    return [dataclasses.asdict(note) for note in result.notes]


def context_payload(run: reader.Run) -> dict:
    return {"run": run.name, "context": run.context.record, "warnings": run.warnings}


def findings_payload(run: reader.Run, result: diagnosis.Diagnosis) -> dict:
    """The findings of `run`, most severe first, and the rules not checked;
    under those a replay bears on, the run's replay (`mpprof replay`), as
    lines of text."""
    replays = replay_files.saved_results(run.path, "." + run.writer_suffix)
    findings = []
    for finding in result.findings:
        row = finding.to_dict()
        shown = replay_text.replay_for(finding.code, replays)
        if shown is not None:
            row["replay"] = {"headline": replay_text.headline(shown),
                             "lines": replay_text.result_lines(shown)}
        findings.append(row)
    return {
        "available": True,
        "findings": findings,
        "counts": severity_counts(result),
        "not_checked": unchecked_notes(result),
    }


def inventory_payload(run: reader.Run) -> dict:
    inventory = run.inventory
    if inventory is None:
        return not_available(diagnosis.inventory_missing_reason(run.context))
    return {"available": True, **inventory}


def loss_scale_payload(run: reader.Run, points: int) -> dict:
    loss_scale = run.loss_scale
    if loss_scale is None:
        optimizer = run.context.optimizer
        return not_available(
            f"no dynamic loss scale: the optimizer ({optimizer}) is not a LossScaleOptimizer"
        )
    steps, scales = loss_scale.series()
    kept = downsample.envelope(steps, scales, points)
    overflows = loss_scale.overflows
    shown = downsample.evenly(len(overflows), metadata.MAX_MARKERS)
    growths = loss_scale.growths
    shown_growths = downsample.evenly(len(growths), metadata.MAX_MARKERS)
    return {
        "available": True,
        "series": {
            "step": steps[kept].tolist(),
            "scale": json_floats(scales[kept]),
        },
        "series_vertices": len(steps),
        "overflows": {
            "step": overflows[shown, 0].astype(np.int64).tolist(),
            "scale_before": json_floats(overflows[shown, 1]),
            "scale_after": json_floats(overflows[shown, 2]),
            "total": len(overflows),
        },
        "growths": {
            "step": growths[shown_growths, 0].astype(np.int64).tolist(),
            "scale_after": json_floats(growths[shown_growths, 2]),
            "total": len(growths),
        },
        "first_step": loss_scale.first_step,
        "steps_run": loss_scale.steps_run,
        "initial_scale": _null_nonfinite(loss_scale.initial_scale),
        "final_scale": _null_nonfinite(loss_scale.final_scale),
        "steps_since_last_overflow": loss_scale.steps_since_last_overflow,
    }


def numerics_payload(run: reader.Run, direction: str, stat: str, rows: int, columns: int) -> dict:
    """A layer x step matrix of one statistic, max-pooled to rows x columns.

    Each cell holds the worst value of the layers and sampled steps it covers
    (for headroom: of the largest abs max), so an overflow never averages away.
    Headroom matrices come with `overflowed` (cells whose output overflowed)
    and `nonfinite` (their largest share of non-finite values).
    """
    numerics = run.numerics
    if numerics is None:
        return not_available("per-layer numerics were not recorded in this run")
    layers, steps = list(numerics.layers), np.asarray(numerics.steps, dtype=np.int64)
    stats = getattr(numerics, direction)
    source_stat = "abs_max" if stat == HEADROOM else stat
    if source_stat not in stats:
        return not_available(f"{direction} {source_stat} was not recorded in this run")
    matrix = np.asarray(stats[source_stat], dtype=np.float64).T  # [L, S]
    row_starts = downsample.group_starts(len(layers), rows)
    column_starts = downsample.group_starts(len(steps), columns)
    values = downsample.pool_max(matrix, row_starts, column_starts)
    extra = {}
    if stat == HEADROOM:
        overflowed = downsample.pool_max(
            diagnosis.forward_overflow_mask(run).T.astype(np.float64), row_starts,
            column_starts,
        )
        values = headroom.headroom_bits(numerics.policy_max, values, overflowed > 0)
        nonfinite = np.asarray(numerics.forward["nonfinite_frac"], dtype=np.float64).T
        extra = {
            "overflowed": (overflowed > 0).tolist(),
            "nonfinite": json_floats(
                downsample.pool_max(nonfinite, row_starts, column_starts), decimals=4
            ),
        }
    forensic = np.asarray(numerics.forensic, dtype=bool)
    return {
        "available": True,
        "direction": direction,
        "stat": stat,
        **headroom.dtype_fields(numerics.policy_max),
        "rows": [_row_label(layers, row_starts, i) for i in range(len(row_starts))],
        "row_layers": [layers[start] for start in row_starts.tolist()],
        "column_steps": steps[column_starts].tolist() if len(steps) else [],
        "column_forensic": (
            np.logical_or.reduceat(forensic, column_starts).tolist() if len(steps) else []
        ),
        "values": json_floats(values, decimals=_DECIMALS.get(stat)),
        **extra,
        "layers_total": len(layers),
        "samples_total": len(steps),
    }


def layer_history_payload(run: reader.Run, layer: str, points: int) -> dict:
    """Every recorded statistic of one layer over the sampled steps.

    `overflowed` marks samples whose output overflowed (as the diagnosis
    decides it, by the dtype the layer computed in): their finite abs max
    says nothing, a view marks them.
    """
    numerics = run.numerics
    if numerics is None:
        return not_available("per-layer numerics were not recorded in this run")
    index = _layer_index(numerics, layer, run.name)
    steps = np.asarray(numerics.steps, dtype=np.int64)
    starts = downsample.group_starts(len(steps), points)
    series = {}
    for direction in NUMERICS_DIRECTIONS:
        for stat, matrix in getattr(numerics, direction).items():
            column = np.asarray(matrix, dtype=np.float64)[:, index]
            pooled = np.fmax.reduceat(column, starts) if len(column) else column
            series[f"{direction}/{stat}"] = json_floats(pooled)
    forensic = np.asarray(numerics.forensic, dtype=bool)
    overflowed = np.asarray(diagnosis.forward_overflow_mask(run), dtype=bool)[:, index]
    return {
        "available": True,
        "layer": layer,
        **headroom.dtype_fields(numerics.policy_max),
        "step": steps[starts].tolist() if len(steps) else [],
        "forensic": np.logical_or.reduceat(forensic, starts).tolist() if len(steps) else [],
        "overflowed": np.logical_or.reduceat(overflowed, starts).tolist() if len(steps) else [],
        "series": series,
    }


def histogram_payload(run: reader.Run, layer: str, direction: str, columns: int) -> dict:
    """One layer's log2-magnitude histograms over the sampled steps.

    `shares[b][c]` is the share of the finite non-zero values of column `c`
    (consecutive samples summed) in binade bin `b`; bin edges are log2
    magnitudes (`edges`, the first and last bins open-ended).
    """
    numerics = run.numerics
    if numerics is None:
        return not_available("per-layer numerics were not recorded in this run")
    index = _layer_index(numerics, layer, run.name)
    histograms = numerics.forward_hist if direction == "forward" else numerics.backward_hist
    counts = np.asarray(histograms, dtype=np.float64)
    if counts.ndim != 3 or not counts.shape[0]:
        return not_available(f"no {direction} histograms were recorded in this run")
    counts = counts[:, index, :]  # [S, B]
    steps = np.asarray(numerics.steps, dtype=np.int64)
    starts = downsample.group_starts(len(steps), columns)
    pooled = np.add.reduceat(counts, starts, axis=0)  # [C, B]
    totals = pooled.sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        shares = np.where(totals > 0, pooled / np.maximum(totals, 1), np.nan)
    dtype = headroom.dtype_range(numerics.policy_max)
    return {
        "available": True,
        "layer": layer,
        "direction": direction,
        **headroom.dtype_fields(numerics.policy_max),
        "edges": numerics.hist_edges.tolist(),
        "column_steps": steps[starts].tolist(),
        "shares": json_floats(shares.T, decimals=4),
        "lines": {
            f"{dtype.name} max": math.log2(dtype.max),
            f"{dtype.name} smallest normal": math.log2(dtype.smallest_normal),
            f"{dtype.name} smallest subnormal": math.log2(dtype.smallest_subnormal),
        },
    }


def _layer_index(numerics: reader.Numerics, layer: str, run_name: str) -> int:
    layers = list(numerics.layers)
    if layer not in layers:
        raise errors.NotFoundError(f"No layer {layer!r} in the numerics of run {run_name!r}")
    return layers.index(layer)


def float8_payload(run: reader.Run, layer: str | None, rows: int, columns: int,
                   points: int) -> dict:
    """The float8 view: saturation and underflow shares (float8 layer and
    tensor x sampled step, merged to at most `rows` x `columns`, each cell the
    worst it covers) and one layer's scales and amax over the flushes (the
    first layer unless `layer` names one)."""
    float8 = run.float8
    if float8 is None:
        return not_available(
            "no float8 layers in this run (model.quantize('float8') makes Dense and "
            "EinsumDense layers train in float8)"
        )
    index = 0
    if layer is not None:
        if layer not in float8.layers:
            raise errors.NotFoundError(f"No float8 layer {layer!r} in run {run.name!r}")
        index = float8.layers.index(layer)
    maps = float8_view.share_maps(float8, rows, columns)
    series = float8_view.layer_series(float8, index, points)
    return {
        "available": True,
        "layers": list(float8.layers),
        "policies": list(float8.policies),
        "tensors": list(float8.tensors),
        "formats": {t: float8_view.FORMAT_NAMES.get(f, f) for t, f in float8.formats.items()},
        # Per tensor: the largest value of its format.
        "format_max": _null_nonfinite(
            {t: float8.format_max.get(f, math.nan) for t, f in float8.formats.items()}),
        "shares": {
            "rows": maps.rows,
            "row_layers": maps.row_layers,
            "column_steps": maps.column_steps,
            "values": {name: json_floats(v, decimals=5) for name, v in maps.values.items()},
            "samples_total": maps.samples_total,
        },
        "layer": float8.layers[index],
        "history": {
            "steps": series["steps"],
            "tensors": {
                tensor: {name: json_floats(values) for name, values in lines.items()}
                for tensor, lines in series["tensors"].items()
            },
        },
    }


def gpu_payload(run: reader.Run, points: int) -> dict:
    """GPU sample tracks per device (bucket means), the kernel Tensor Core share."""
    gpu = run.gpu
    if gpu is None:
        return not_available("no GPU samples were recorded in this run")
    kernels = _null_nonfinite(gpu.kernels) if gpu.kernels else None
    payload = {
        "available": gpu.mode != "unavailable",
        "mode": gpu.mode,
        "reason": gpu.reason,
        "devices": _null_nonfinite(gpu.devices),
        "tensor_source": _tensor_source(gpu.mode, kernels),
        "kernels": kernels,
        "tracks": {},
    }
    for device, track in downsample.device_tracks(gpu.samples, points).items():
        payload["tracks"][str(device)] = {
            name: json_floats(means, decimals=4) for name, means in track.items()
        }
    return payload


def _tensor_source(mode: str, kernels: dict | None) -> str | None:
    """Which measurement the tensor utilization track comes from."""
    if mode == "gpm":
        return "GPM"
    if kernels and kernels.get("tensor_core_share") is not None:
        return "kernel share"
    if mode == "basic":
        return "basic"
    return None


def _row_label(layers: list[str], starts: np.ndarray, i: int) -> str:
    first = int(starts[i])
    last = int(starts[i + 1]) - 1 if i + 1 < len(starts) else len(layers) - 1
    if first == last:
        return layers[first]
    return f"{layers[first]} … {layers[last]} ({last - first + 1} layers)"


def _null_nonfinite(value):
    """`value` JSON-ready, NaN and infinities as None (a gap in a view)."""
    return json_safe(value, nonfinite_as_null=True)


def advice_payload(run: reader.Run) -> dict:
    """The precision advisor's plan for the run (`mpprof.advisor.advise_run`:
    per-layer facts, the plan and its code, the projection; no replay), and
    the saved verification when `mpprof advise --verify` ran."""
    from mpprof import advisor

    if not run.inventory:
        return not_available("no precision inventory was recorded (the train step was "
                             "never traced)")
    advice = advisor.advise_run(run)
    advice["verification"] = advisor.saved_verification(run.path)
    return {"available": True, **json_safe(advice)}
