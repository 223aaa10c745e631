"""Typed views of a run's records: the loss scale, numerics and GPU series
as numpy arrays ready to plot and judge (float8: `mpprof.records.float8`).

`mpprof.records.reader.Run` builds each view from the records it read; nothing here
reads files. The views know the columns of `mpprof.records.schema`, so no front end
indexes a record by a bare number.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mpprof.records import schema
from mpprof.records.event_file import Record

_EVENT = schema.LOSS_SCALE_EVENT_COLUMN
_PROGRESS = schema.LOSS_SCALE_PROGRESS_COLUMN
_STEP = schema.NUMERICS_STEP_COLUMN


@dataclasses.dataclass
class LossScale:
    """The dynamic loss scale of a run, exact to the step.

    Attributes:
        events: float64 [n, 4], columns `schema.LOSS_SCALE_EVENT_COLUMNS`,
            sorted by step: every overflow (skipped step) and every growth.
        progress: float64 [m, 3], columns `schema.LOSS_SCALE_PROGRESS_COLUMNS`:
            steps run, scale and skipped steps at each read of the counters.
    """

    events: np.ndarray
    progress: np.ndarray

    def _kind(self, kind: float) -> np.ndarray:
        return self.events[self.events[:, _EVENT.kind] == kind]

    @property
    def overflows(self) -> np.ndarray:
        """[k, 3]: step, scale before, scale after of each overflow (the
        columns of `schema.LOSS_SCALE_EVENT_COLUMN` before "kind")."""
        return self._kind(schema.EVENT_OVERFLOW)[:, : _EVENT.kind]

    @property
    def growths(self) -> np.ndarray:
        """[k, 3]: step, scale before, scale after of each growth."""
        return self._kind(schema.EVENT_GROWTH)[:, : _EVENT.kind]

    @property
    def overflow_steps(self) -> np.ndarray:
        return self.overflows[:, _EVENT.step].astype(np.int64)

    @property
    def skipped_steps(self) -> int:
        return len(self.overflows)

    @property
    def first_step(self) -> int:
        return int(self.progress[0, _PROGRESS.steps_run]) if len(self.progress) else 0

    @property
    def steps_run(self) -> int:
        """Steps run up to the last read, skipped steps included."""
        last = int(self.progress[-1, _PROGRESS.steps_run]) if len(self.progress) else 0
        if len(self.events):
            last = max(last, int(self.events[-1, _EVENT.step]) + 1)
        return last

    @property
    def initial_scale(self) -> float:
        if len(self.progress):
            return float(self.progress[0, _PROGRESS.scale])
        return float(self.events[0, _EVENT.scale_before]) if len(self.events) else float("nan")

    @property
    def final_scale(self) -> float:
        if len(self.events) and (
            not len(self.progress)
            or self.events[-1, _EVENT.step] >= self.progress[-1, _PROGRESS.steps_run]
        ):
            return float(self.events[-1, _EVENT.scale_after])
        if not len(self.progress):
            return float("nan")
        return float(self.progress[-1, _PROGRESS.scale])

    @property
    def steps_since_last_overflow(self) -> int | None:
        steps = self.overflow_steps
        return None if not len(steps) else self.steps_run - 1 - int(steps[-1])

    def series(self) -> tuple[np.ndarray, np.ndarray]:
        """Vertices of the step function "scale after step s", for plotting.

        The scale after any step between two vertices equals the earlier one.
        """
        steps = [self.first_step - 1]
        scales = [self.initial_scale]
        steps.extend(self.events[:, _EVENT.step].tolist())
        scales.extend(self.events[:, _EVENT.scale_after].tolist())
        if self.steps_run - 1 > steps[-1]:
            steps.append(self.steps_run - 1)
            scales.append(scales[-1])
        return np.asarray(steps, dtype=np.int64), np.asarray(scales)

    @property
    def initial_descent(self) -> int:
        """How many overflows in a row the run started with: the scale
        calibrating down from its initial value."""
        steps = np.sort(self.overflow_steps)
        if not len(steps) or steps[0] != self.first_step:
            return 0
        gaps = np.flatnonzero(np.diff(steps) != 1)
        return int(gaps[0] + 1) if len(gaps) else len(steps)

    def scale_after(self, steps) -> np.ndarray:
        """The scale after each of `steps` (exact: it changes only at events)."""
        vertex_steps, vertex_scales = self.series()
        index = np.searchsorted(vertex_steps, np.asarray(steps), side="right") - 1
        return vertex_scales[np.clip(index, 0, None)]


_STAT_INDEX = {name: i for i, name in enumerate(schema.NUMERICS_STAT_COLUMNS)}


def _shares(stats: np.ndarray) -> dict[str, np.ndarray]:
    """Per-row statistics of [..., NUMERICS_STAT_COLUMNS] arrays as shares."""
    count = np.maximum(stats[..., _STAT_INDEX["count"]], 1.0)
    return {
        "abs_max": stats[..., _STAT_INDEX["abs_max"]],
        "count": stats[..., _STAT_INDEX["count"]],
        "nonfinite_frac": stats[..., _STAT_INDEX["nonfinite"]] / count,
        "zero_frac": stats[..., _STAT_INDEX["zero"]] / count,
        "underflow_frac": stats[..., _STAT_INDEX["below_normal"]] / count,
        "subnormal_frac": stats[..., _STAT_INDEX["below_subnormal"]] / count,
    }


@dataclasses.dataclass
class Numerics:
    """Per-layer numerics on sampled steps, as arrays ready to plot.

    `forward[stat]` and `backward[stat]` are [steps, layers] arrays (layers in
    call order, `layers` names them); `variable_grads[stat]` and
    `unscaled_variable_grads[stat]` are [steps, variables]. Stats: "abs_max",
    "count", "nonfinite_frac", "zero_frac", "underflow_frac" (non-zero below
    the float16 smallest normal), "subnormal_frac" (non-zero below the float16
    smallest subnormal). Histograms are [steps, layers, bins] counts of
    log2|x| with `hist_edges`.
    """

    layers: list[str]
    variables: list[str]
    policy_max: float
    hist_edges: np.ndarray
    steps: np.ndarray
    loss: np.ndarray
    loss_scale: np.ndarray
    forensic: np.ndarray
    steps_covered: np.ndarray
    forward: dict[str, np.ndarray]
    backward: dict[str, np.ndarray]
    forward_hist: np.ndarray
    backward_hist: np.ndarray
    variable_grads: dict[str, np.ndarray]
    unscaled_variable_grads: dict[str, np.ndarray]


@dataclasses.dataclass
class Gpu:
    """What the GPU sampler and the XProf window recorded.

    Attributes:
        mode: "gpm" (Tensor Core utilization measured), "basic" (NVML without
            GPM: kernel utilization only) or "unavailable".
        reason: why that mode, in words.
        devices: per sampled GPU, its facts from the run context
            (index, name, uuid, architecture, compute_capability, mode, ...).
        samples: float64 [n, len(schema.GPU_SAMPLE_COLUMNS)], sorted by wall
            time then device; NaN where a value was not measured.
        kernels: the latest `kernels/tensor_core_share` record, or None.
    """

    mode: str
    reason: str
    devices: list[dict]
    samples: np.ndarray
    kernels: dict | None

    def column(self, name: str, device: int | None = None) -> np.ndarray:
        """One column of `samples` (of one device's rows if `device` is given)."""
        values = self.samples[:, schema.GPU_SAMPLE_COLUMNS.index(name)]
        if device is None:
            return values
        return values[self.samples[:, schema.GPU_SAMPLE_COLUMN.device] == device]


def loss_scale(events: np.ndarray, progress: np.ndarray) -> LossScale | None:
    """One loss-scale series from its stacked event and progress rows, or None
    if it has neither; a row read twice is kept once."""
    if not len(events) and not len(progress):
        return None
    return LossScale(events=_unique_rows(events), progress=_unique_rows(progress))


def numerics(layout: dict | None, records: dict[str, list[Record]]) -> Numerics | None:
    """The numerics samples of `records` laid out by `layout` (the latest
    `schema.NUMERICS_LAYOUT` record), or None if there is no complete sample.

    Args:
        layout: the layers, variables, policy maximum and histogram edges.
        records: a run's records by key (`Run.records`).
    """
    if layout is None:
        return None
    layers, variables = len(layout["layers"]), len(layout["variables"])
    shapes = {
        schema.NUMERICS_STEP: (len(schema.NUMERICS_STEP_COLUMNS),),
        schema.NUMERICS_FORWARD: (layers, len(schema.NUMERICS_STAT_COLUMNS)),
        schema.NUMERICS_BACKWARD: (layers, len(schema.NUMERICS_STAT_COLUMNS)),
        schema.NUMERICS_FORWARD_HIST: (layers, len(layout["hist_edges"]) + 1),
        schema.NUMERICS_BACKWARD_HIST: (layers, len(layout["hist_edges"]) + 1),
        schema.NUMERICS_GRADIENTS: (variables, len(schema.NUMERICS_STAT_COLUMNS)),
        schema.NUMERICS_UNSCALED_GRADIENTS: (variables, len(schema.NUMERICS_STAT_COLUMNS)),
    }
    # The callback writes its samples in batches: each record holds
    # [samples, *shape] (a single [*shape] sample is read too), all
    # records of a batch at the same event step. Batches whose shapes do
    # not match the layout (a changed model) are left out.
    batches: dict[int, dict[str, np.ndarray]] = {}
    for record, shape in shapes.items():
        for found in records.get(record, []):
            value = np.asarray(found.value)
            if value.shape == shape:
                value = value[None]
            if value.shape[1:] == shape:
                batches.setdefault(found.step, {})[record] = value
    complete = [
        batch for _, batch in sorted(batches.items())
        if len(batch) == len(shapes) and len({len(v) for v in batch.values()}) == 1
    ]
    if not complete:
        return None
    joined = {record: np.concatenate([b[record] for b in complete]) for record in shapes}
    # One sample per step, the last written, in step order.
    sample_steps = joined[schema.NUMERICS_STEP][:, _STEP.step]
    reversed_unique = np.unique(sample_steps[::-1], return_index=True)[1]
    keep = len(sample_steps) - 1 - reversed_unique

    def stacked(record: str) -> np.ndarray:
        return joined[record][keep]

    step_rows = stacked(schema.NUMERICS_STEP)
    return Numerics(
        layers=list(layout["layers"]),
        variables=list(layout["variables"]),
        policy_max=float(layout["policy_max"]),
        hist_edges=np.asarray(layout["hist_edges"], dtype=np.float64),
        steps=step_rows[:, _STEP.step].astype(np.int64),
        loss=step_rows[:, _STEP.loss],
        loss_scale=step_rows[:, _STEP.loss_scale],
        forensic=step_rows[:, _STEP.forensic] > 0,
        steps_covered=step_rows[:, _STEP.steps_covered].astype(np.int64),
        forward=_shares(stacked(schema.NUMERICS_FORWARD)),
        backward=_shares(stacked(schema.NUMERICS_BACKWARD)),
        forward_hist=stacked(schema.NUMERICS_FORWARD_HIST),
        backward_hist=stacked(schema.NUMERICS_BACKWARD_HIST),
        variable_grads=_shares(stacked(schema.NUMERICS_GRADIENTS)),
        unscaled_variable_grads=_shares(stacked(schema.NUMERICS_UNSCALED_GRADIENTS)),
    )


def gpu(entry: dict | None, samples: np.ndarray, kernels: dict | None) -> Gpu | None:
    """The GPU view, or None if the run recorded no GPU entry, sample or kernels.

    Args:
        entry: the run context's "gpu" collector entry.
        samples: the stacked `schema.GPU_SAMPLES` rows.
        kernels: the latest `schema.KERNEL_STATS` record.
    """
    if entry is None and not len(samples) and kernels is None:
        return None
    entry = entry or {}
    if len(samples):
        # A row written twice (e.g. re-read logdir) is kept once, in time order.
        samples = np.unique(samples, axis=0)
    return Gpu(
        mode=entry.get("mode", "unavailable"),
        reason=entry.get("reason", ""),
        devices=list(entry.get("devices", [])),
        samples=samples,
        kernels=kernels,
    )


def stacked_rows(records: list[Record], columns: int) -> np.ndarray:
    """The rows of every record of a [rows, columns] table, concatenated."""
    arrays = [np.reshape(r.value, (-1, columns)) for r in records]
    return np.concatenate(arrays) if arrays else np.zeros((0, columns))


def _unique_rows(rows: np.ndarray) -> np.ndarray:
    """Sorted by the first column; a row read twice is kept once."""
    if not len(rows):
        return rows
    return np.unique(rows, axis=0)
