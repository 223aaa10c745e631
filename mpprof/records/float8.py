"""The float8 view of a run's records (`mpprof.records.reader.Run.float8`): the
delayed scaling of each float8 layer at every flush, the shares measured on
sampled steps and the replicas' amax spread, as numpy arrays.

`mpprof.records.reader.Run` builds it from the records it read; nothing here reads
files.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mpprof.records import schema
from mpprof.records.event_file import Record


@dataclasses.dataclass
class Float8:
    """The float8 layers' delayed scaling at each flush, as arrays ready to plot.

    Every array of `state` is [flushes, layers, tensors] (layers as `layers`
    names them, tensors as `tensors`); its keys are
    `schema.FLOAT8_STATE_COLUMNS` ("scale", "amax_max", "amax_last", "steps",
    "saturated_steps", "peak_over_max", "underflowed_steps",
    "warmup_steps"); `steps` are the flushes' train steps.

    `shares` holds what the sampled steps measured, each array [samples,
    layers, tensors] at `sample_steps`: "saturated" (share of all values),
    "underflowed" (share of non-zero values), "peak_over_max" (the largest
    magnitude over the scale times the format's max), "scale" (the scale
    the step quantized with) and "abs_max"; NaN where a tensor was not
    measured. Empty without samples (`numerics_every=None`, or a run
    recorded before mpprof measured them).

    Under a strategy with several `replicas`, `amax_across_replicas` says how
    the replicas' amax histories relate ("per replica": each keeps its own)
    and `replica_spread` holds, per flush, layer and tensor, the
    `schema.FLOAT8_REPLICA_COLUMNS` after "replicas" (least and largest over
    the replicas of the latest amax and of the history's max); empty with
    one replica.
    """

    layers: list[str]
    policies: list[str]
    amax_history_lengths: list[int]
    tensors: list[str]
    formats: dict[str, str]
    format_max: dict[str, float]
    format_min_subnormal: dict[str, float]
    steps: np.ndarray
    state: dict[str, np.ndarray]
    sample_steps: np.ndarray
    shares: dict[str, np.ndarray]
    replicas: int
    amax_across_replicas: str | None
    replica_spread: dict[str, np.ndarray]



def float8(layout: dict | None, records: dict[str, list[Record]]) -> Float8 | None:
    """The float8 layers' scaling state at each flush, or None for a run
    without float8 layers (or recorded before mpprof recorded them).

    Args:
        layout: the latest `schema.FLOAT8_LAYOUT` record.
        records: the run's records by name (FLOAT8_STATE, FLOAT8_SHARES and
            FLOAT8_REPLICAS are read).
    """
    if layout is None or not layout.get("layers"):
        return None
    cells = (len(layout["layers"]), len(layout["tensors"]))
    steps, rows = _float8_by_step(records, schema.FLOAT8_STATE, cells,
                                  len(schema.FLOAT8_STATE_COLUMNS))
    return Float8(
        layers=[layer["name"] for layer in layout["layers"]],
        policies=[str(layer.get("policy")) for layer in layout["layers"]],
        amax_history_lengths=[
            int(layer.get("amax_history_length") or 0) for layer in layout["layers"]
        ],
        tensors=list(layout["tensors"]),
        formats=dict(layout.get("formats") or {}),
        format_max={k: float(v) for k, v in (layout.get("format_max") or {}).items()},
        format_min_subnormal={
            k: float(v) for k, v in (layout.get("format_min_subnormal") or {}).items()
        },
        steps=steps,
        state={name: rows[..., i] for i, name in enumerate(schema.FLOAT8_STATE_COLUMNS)},
        **_float8_shares(layout, records, cells),
        replicas=int(layout.get("replicas") or 1),
        amax_across_replicas=layout.get("amax_across_replicas"),
        replica_spread=_float8_replica_spread(records, steps, cells),
    )


def _float8_by_step(records: dict[str, list[Record]], record: str, cells: tuple[int, int],
                    columns: int) -> tuple[np.ndarray, np.ndarray]:
    """(steps, rows [steps, layers, tensors, columns]) of a float8 record: the
    last record of each step, in step order; records of another shape (a
    changed model) are left out."""
    shape = (*cells, columns)
    by_step = {
        found.step: np.asarray(found.value) for found in records.get(record, [])
        if np.shape(found.value) == shape
    }
    steps = np.array(sorted(by_step), dtype=np.int64)
    rows = np.stack([by_step[step] for step in steps]) if len(steps) else np.zeros((0, *shape))
    return steps, rows


def _float8_shares(layout: dict, records: dict[str, list[Record]],
                   cells: tuple[int, int]) -> dict:
    """`Float8.sample_steps` and `Float8.shares` from the FLOAT8_SHARES records."""
    steps, rows = _float8_by_step(records, schema.FLOAT8_SHARES, cells,
                                  len(schema.FLOAT8_SHARE_COLUMNS))
    column = schema.FLOAT8_SHARE_COLUMN
    formats = layout.get("formats") or {}
    fmax = np.array([float((layout.get("format_max") or {}).get(formats.get(tensor), np.nan))
                     for tensor in layout["tensors"]])
    with np.errstate(divide="ignore", invalid="ignore"):
        count, nonzero = rows[..., column.count], rows[..., column.nonzero]
        measured = count > 0
        return {"sample_steps": steps, "shares": {
            "saturated": np.where(measured, rows[..., column.saturated] / count, np.nan),
            "underflowed": np.where(
                nonzero > 0, rows[..., column.underflowed] / nonzero,
                np.where(measured, 0.0, np.nan)),
            "peak_over_max": np.where(
                measured, rows[..., column.abs_max] / (rows[..., column.scale] * fmax), np.nan),
            "scale": np.where(measured, rows[..., column.scale], np.nan),
            "abs_max": np.where(measured, rows[..., column.abs_max], np.nan),
        }}


def _float8_replica_spread(records: dict[str, list[Record]], steps: np.ndarray,
                           cells: tuple[int, int]) -> dict[str, np.ndarray]:
    """`Float8.replica_spread` at the flush `steps` (NaN where not recorded)."""
    found, rows = _float8_by_step(records, schema.FLOAT8_REPLICAS, cells,
                                  len(schema.FLOAT8_REPLICA_COLUMNS))
    if not len(found):
        return {}
    by_step = dict(zip(found.tolist(), rows, strict=True))
    nan = np.full(rows.shape[1:], np.nan)
    aligned = np.stack([by_step.get(int(step), nan) for step in steps])
    return {name: aligned[..., i] for i, name in enumerate(schema.FLOAT8_REPLICA_COLUMNS)
            if name != "replicas"}
