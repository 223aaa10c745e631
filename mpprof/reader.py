"""Reads mpprof records back from a logdir into plain Python and numpy values.

Every front end (CLI, HTML report, TensorBoard plugin) reads through here.
Only mpprof's own event files are read (the writer marks them with
`EVENT_FILE_SUFFIX`), so a logdir full of histograms stays cheap to read.

Reading never trusts the files: each record's checksums are verified
(`mpprof.tfrecord`) and its content checked against the schema
(`mpprof.validation`); a record that fails is skipped with a warning in
`Run.warnings`, one line per kind of problem however often it occurs. A
directory that cannot be listed is skipped with a warning, and symlink loops
are not followed. Local logdirs are read without importing TensorFlow
(`mpprof.filesystem`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import posixpath
from collections.abc import Callable

import numpy as np
from tensorboard.compat.proto import event_pb2, types_pb2

from mpprof import filesystem, schema, tfrecord, validation
from mpprof.terminal import printable

logger = logging.getLogger(__name__)

# Called with each warning about the logdir as a whole (a directory that
# cannot be listed, a file that is not a regular file).
OnWarning = Callable[[str], None]


_EVENT = schema.LOSS_SCALE_EVENT_COLUMN
_PROGRESS = schema.LOSS_SCALE_PROGRESS_COLUMN
_STEP = schema.NUMERICS_STEP_COLUMN


class LogdirNotFoundError(FileNotFoundError):
    """The logdir does not exist."""


class NoMpprofDataError(LookupError):
    """The logdir exists but holds no mpprof records."""


@dataclasses.dataclass(frozen=True)
class Record:
    step: int
    wall_time: float
    value: object  # dict for JSON records, np.ndarray for arrays


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


@dataclasses.dataclass
class Run:
    """Everything mpprof recorded in one run directory."""

    name: str
    path: str
    records: dict[str, list[Record]]
    warnings: list[str]

    def latest(self, record: str):
        found = self.records.get(record)
        return found[-1].value if found else None

    @property
    def readable(self) -> bool:
        """Whether any record of the run could be read."""
        return any(self.records.values())

    @functools.cached_property
    def last_record(self) -> tuple[int, float] | None:
        """(largest step, latest wall time) over the run's records, or None."""
        found = [r for records in self.records.values() for r in records]
        if not found:
            return None
        return max(r.step for r in found), max(r.wall_time for r in found)

    @property
    def cut_short(self) -> dict | None:
        """How a fit that never recorded its end stopped, or None.

        The callback's run context says "fit_state": "running" from train
        begin (rewritten at each flush), then "ended" when fit returned or
        "failed" when it raised. A run whose latest context still says
        "running" was killed (or is still training); logs older than that key
        say nothing, and give None like a run that ended.

        Returns:
            None, or `{"fit_state": "running"|"failed", "step": the largest
            step of any record, "wall_time": the latest record's time}`.
        """
        state = self.context.get("fit_state")
        if state in (None, "ended") or self.last_record is None:
            return None
        step, wall_time = self.last_record
        return {"fit_state": state, "step": step, "wall_time": wall_time}

    @property
    def context(self) -> dict:
        return self.latest(schema.RUN_CONTEXT) or {}

    @property
    def inventory(self) -> dict | None:
        return self.latest(schema.INVENTORY)

    @property
    def worker(self) -> dict | None:
        """For one worker's own run of a multi-worker fit (`train/worker_<i>`):
        `{"index", "role" ("chief"|"worker"), "model_run", "evidence"}`, where
        `model_run` names the run with the model-level records (inventory, loss
        scale, numerics), written by the chief. None for any other run.
        """
        context = self.context
        if context.get("run_role") != "worker":
            return None
        distributed = context.get("distributed") or {}
        return {
            "index": distributed.get("worker_index"),
            "role": distributed.get("role"),
            "model_run": posixpath.dirname(self.name) or ".",
            "evidence": context.get("worker_evidence") or {},
        }

    @functools.cached_property
    def loss_scale(self) -> LossScale | None:
        """The primary loss-scale series (the compiled optimizer's, or the
        first LossScaleOptimizer the train step applied), or None."""
        return self._loss_scale_series(None)

    @functools.cached_property
    def loss_scales(self) -> dict[str, LossScale]:
        """Every loss-scale series by optimizer name: the primary one under
        the name the run context gives it ("optimizer" in older runs), then
        the series of each other LossScaleOptimizer the step used (a GAN's
        `g_opt`, `d_opt`)."""
        found = {}
        if self.loss_scale is not None:
            loss_scale = (self.context.get("collectors") or {}).get("loss_scale") or {}
            found[str(loss_scale.get("primary", "optimizer"))] = self.loss_scale
        prefix = schema.LOSS_SCALE_PROGRESS + schema.SERIES_SEPARATOR
        for key in sorted(self.records):
            if key.startswith(prefix):
                series = key[len(prefix):]
                found[series] = self._loss_scale_series(series)
        return found

    def _loss_scale_series(self, series: str | None) -> LossScale | None:
        events = self._stacked(_series_key(schema.LOSS_SCALE_EVENTS, series), 4)
        progress = self._stacked(_series_key(schema.LOSS_SCALE_PROGRESS, series), 3)
        if not len(events) and not len(progress):
            return None
        return LossScale(events=_unique_rows(events), progress=_unique_rows(progress))

    @property
    def health(self) -> dict | None:
        return self.latest(schema.HEALTH)

    @functools.cached_property
    def numerics(self) -> Numerics | None:
        layout = self.latest(schema.NUMERICS_LAYOUT)
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
            for found in self.records.get(record, []):
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

    @functools.cached_property
    def float8(self) -> Float8 | None:
        """The float8 layers' scales and amax; None for a run without float8
        layers (or recorded before mpprof recorded them)."""
        layout = self.latest(schema.FLOAT8_LAYOUT)
        if layout is None or not layout.get("layers"):
            return None
        shape = (len(layout["layers"]), len(layout["tensors"]), len(schema.FLOAT8_STATE_COLUMNS))
        # The last record of each step, in step order; records of another
        # shape (a changed model) are left out.
        records = self.records.get(schema.FLOAT8_STATE, [])
        by_step = {
            found.step: np.asarray(found.value) for found in records
            if np.shape(found.value) == shape
        }
        steps = np.array(sorted(by_step), dtype=np.int64)
        rows = np.stack([by_step[step] for step in steps]) if len(steps) else np.zeros((0, *shape))
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
            **self._float8_shares(layout, shape[:2]),
            replicas=int(layout.get("replicas") or 1),
            amax_across_replicas=layout.get("amax_across_replicas"),
            replica_spread=self._float8_replica_spread(steps, shape[:2]),
        )

    def _float8_replica_spread(self, steps: np.ndarray, cells: tuple[int, int]) -> dict:
        """`Float8.replica_spread` at the flush `steps` (NaN where not recorded)."""
        shape = (*cells, len(schema.FLOAT8_REPLICA_COLUMNS))
        by_step = {
            found.step: np.asarray(found.value)
            for found in self.records.get(schema.FLOAT8_REPLICAS, [])
            if np.shape(found.value) == shape
        }
        if not by_step:
            return {}
        rows = np.stack([by_step.get(int(step), np.full(shape, np.nan)) for step in steps])
        return {name: rows[..., i] for i, name in enumerate(schema.FLOAT8_REPLICA_COLUMNS)
                if name != "replicas"}

    def _float8_shares(self, layout: dict, cells: tuple[int, int]) -> dict:
        """`Float8.sample_steps` and `Float8.shares` from the FLOAT8_SHARES records."""
        shape = (*cells, len(schema.FLOAT8_SHARE_COLUMNS))
        by_step = {
            found.step: np.asarray(found.value)
            for found in self.records.get(schema.FLOAT8_SHARES, [])
            if np.shape(found.value) == shape
        }
        steps = np.array(sorted(by_step), dtype=np.int64)
        rows = np.stack([by_step[s] for s in steps]) if len(steps) else np.zeros((0, *shape))
        column = schema.FLOAT8_SHARE_COLUMN
        fmax = np.array([float((layout.get("format_max") or {}).get(
            (layout.get("formats") or {}).get(tensor), np.nan)) for tensor in layout["tensors"]])
        with np.errstate(divide="ignore", invalid="ignore"):
            count, nonzero = rows[..., column.count], rows[..., column.nonzero]
            measured = count > 0
            return {"sample_steps": steps, "shares": {
                "saturated": np.where(measured, rows[..., column.saturated] / count, np.nan),
                "underflowed": np.where(
                    nonzero > 0, rows[..., column.underflowed] / nonzero,
                    np.where(measured, 0.0, np.nan)),
                "peak_over_max": np.where(
                    measured, rows[..., column.abs_max] / (rows[..., column.scale] * fmax),
                    np.nan),
                "scale": np.where(measured, rows[..., column.scale], np.nan),
                "abs_max": np.where(measured, rows[..., column.abs_max], np.nan),
            }}

    @functools.cached_property
    def gpu(self) -> Gpu | None:
        """GPU samples and kernel share; None if the run recorded no GPU entry."""
        entry = self.context.get("collectors", {}).get("gpu")
        samples = self._stacked(schema.GPU_SAMPLES, len(schema.GPU_SAMPLE_COLUMNS))
        kernels = self.latest(schema.KERNEL_STATS)
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

    def _stacked(self, record: str, columns: int) -> np.ndarray:
        arrays = [np.reshape(r.value, (-1, columns)) for r in self.records.get(record, [])]
        return np.concatenate(arrays) if arrays else np.zeros((0, columns))


def _series_key(record: str, series: str | None) -> str:
    """The key of `Run.records` for one series of a record (see `schema.tag_for`)."""
    return record if series is None else record + schema.SERIES_SEPARATOR + series


def _unique_rows(rows: np.ndarray) -> np.ndarray:
    """Sorted by the first column; a row read twice is kept once."""
    if not len(rows):
        return rows
    return np.unique(rows, axis=0)


def list_runs(logdir: str | os.PathLike, on_warning: OnWarning | None = None) -> list[str]:
    """Names of the runs under `logdir` that hold mpprof records, sorted.

    A run's name is its directory relative to `logdir` ("." for logdir
    itself), as TensorBoard names runs. Directories that cannot be listed and
    mpprof-named entries that are not regular files (a FIFO, a dangling
    symlink) are skipped, each with a warning; symlinks back into the logdir
    are not followed.

    Args:
        logdir: a local path or a remote one (`gs://...`).
        on_warning: receives each warning; by default they are logged.
    """
    logdir = _existing_logdir(logdir)
    warn = on_warning or _log_warning
    runs = set()

    def unlisted(directory: str, error: OSError) -> None:
        warn(f"{directory}: cannot be listed ({_reason(error)}); skipped")

    for directory, entries in filesystem.walk(logdir, on_error=unlisted):
        files, others = _event_file_entries(entries)
        for name in others:
            warn(f"{filesystem.join(directory, name)}: {filesystem.Kind.OTHER.value}; skipped")
        if files:
            runs.add(filesystem.relative(directory, logdir))
    return sorted(runs)


def event_files(logdir: str | os.PathLike, run: str) -> list[str]:
    """Paths of the mpprof event files of `run` (a name from `list_runs`), sorted.

    Only regular files are listed. Raises NoMpprofDataError for a name that
    is not a run under `logdir` (absolute paths and ".." included) or a run
    without mpprof records, and OSError if its directory cannot be listed.
    """
    logdir = _existing_logdir(logdir)
    parts = run.split("/")
    if run.startswith("/") or "\\" in run or ".." in parts or "" in parts:
        raise NoMpprofDataError(f"No run {run!r} in {logdir}")
    path = logdir if run == "." else filesystem.join(logdir, run)
    if not filesystem.isdir(path):
        raise NoMpprofDataError(f"No run {run!r} in {logdir}")
    files, _ = _event_file_entries(filesystem.scan(path))
    if not files:
        raise NoMpprofDataError(f"Run {run!r} in {logdir} holds no mpprof records")
    return [filesystem.join(path, name) for name in sorted(files)]


def read_run(logdir: str | os.PathLike, run: str) -> Run:
    """Reads one run; raises NoMpprofDataError if it holds no mpprof records.

    Raises:
        NoMpprofDataError: `run` is not a run of `logdir`.
        OSError: the run's directory cannot be listed.
    """
    files = event_files(logdir, run)
    records: dict[str, list[Record]] = {}
    warnings = _Warnings()
    for path in files:
        _read_event_file(path, records, warnings)
    for found in records.values():
        found.sort(key=lambda r: (r.wall_time, r.step))
    return Run(
        name=run, path=filesystem.dirname(files[0]), records=records, warnings=warnings.lines()
    )


def read_logdir(logdir: str | os.PathLike, on_warning: OnWarning | None = None) -> dict[str, Run]:
    """Reads every mpprof run under `logdir`, keyed by run name.

    A run whose directory became unreadable since it was listed is skipped
    with a warning, like any directory that cannot be listed.
    """
    warn = on_warning or _log_warning
    runs = list_runs(logdir, warn)
    if not runs:
        raise no_runs_error(logdir)
    read = {}
    for name in runs:
        try:
            read[name] = read_run(logdir, name)
        except OSError as e:
            warn(f"run {name}: cannot be read ({_reason(e)}); skipped")
    return read


def select_runs(logdir: str | os.PathLike, run: str | None = None,
                on_warning: OnWarning | None = None) -> list[str]:
    """The runs of `logdir` (see `list_runs`), or only `run`.

    Raises:
        NoMpprofDataError: `run` is not among them, or there is none at all.
    """
    names = list_runs(logdir, on_warning=on_warning)
    if run is not None:
        if run not in names:
            raise NoMpprofDataError(
                f"No mpprof run {run!r} in {os.fspath(logdir)}; its runs: "
                f"{', '.join(names) or 'none'}"
            )
        names = [run]
    if not names:
        raise no_runs_error(logdir)
    return names


def no_runs_error(logdir: str | os.PathLike) -> NoMpprofDataError:
    """The error for a logdir without mpprof runs, saying how to record one."""
    return NoMpprofDataError(
        f"{os.fspath(logdir)} holds no mpprof records. Record a run with "
        "model.fit(..., callbacks=[mpprof.MixedPrecisionProfiler(log_dir=...)]) "
        "and point mpprof at that log_dir."
    )


def _log_warning(text: str) -> None:
    # Logs end up on terminals: a hostile directory name must not drive one.
    logger.warning("%s", printable(text))


def _event_file_entries(entries: list[filesystem.Entry]) -> tuple[list[str], list[str]]:
    """Names of the mpprof event files among `entries`: (regular files, others)."""
    files, others = [], []
    for entry in entries:
        if _is_mpprof_event_file(entry.name) and entry.kind is not filesystem.Kind.DIRECTORY:
            (files if entry.kind is filesystem.Kind.FILE else others).append(entry.name)
    return files, others


def _is_mpprof_event_file(name: str) -> bool:
    return "tfevents" in name and name.endswith(schema.EVENT_FILE_SUFFIX)


def _existing_logdir(logdir: str | os.PathLike) -> str:
    logdir = os.fspath(logdir)
    try:
        found = filesystem.isdir(logdir)
    except OSError as e:
        raise LogdirNotFoundError(f"Logdir {logdir!r} cannot be read ({e})") from e
    if not found:
        raise LogdirNotFoundError(
            f"Logdir {logdir!r} does not exist: pass the log_dir given to "
            "mpprof.MixedPrecisionProfiler."
        )
    return logdir


def _reason(error: OSError) -> str:
    return error.strerror or str(error)


class _Warnings:
    """The warnings of one run's read: one line per kind of problem.

    A logdir written by a newer mpprof, or a file of garbage, fails on every
    record: the user needs to hear it once, with how often and where first.
    """

    def __init__(self):
        self._kinds: dict[str, list] = {}  # kind -> [count, first full text]

    def add(self, kind: str, text: str) -> None:
        entry = self._kinds.setdefault(kind, [0, text])
        entry[0] += 1

    def lines(self) -> list[str]:
        return [
            text if count == 1 else f"{text} (and {count - 1:,} more records like it)"
            for count, text in self._kinds.values()
        ]


def _read_event_file(path: str, records: dict, warnings: _Warnings) -> None:
    """Reads one event file record by record (see `mpprof.tfrecord`)."""
    # TensorBoard semantics: a tag's metadata (here: the schema version) may
    # come with its first value only and holds for the whole series.
    tag_problems: dict[str, tuple[str, str] | None] = {}
    try:
        with filesystem.open_file(path) as stream:
            for frame in tfrecord.read_frames(stream):
                if frame.problem is not None:
                    skipped = "" if frame.fatal else "; skipped"
                    warnings.add(f"{path}\0frame", f"{path}: {frame.problem}{skipped}")
                else:
                    _parse_event(frame, path, records, warnings, tag_problems)
    except OSError as e:
        warnings.add(f"{path}\0unreadable", f"{path}: cannot be read ({_reason(e)}); skipped")


def _parse_event(frame: tfrecord.Frame, path: str, records: dict, warnings: _Warnings,
                 tag_problems: dict) -> None:
    try:
        event = event_pb2.Event.FromString(frame.payload)
    except Exception as e:  # noqa: BLE001 - bytes that pass their CRC but are no Event
        warnings.add(
            f"{path}\0event",
            f"{path}: record at byte {frame.offset} is not an event ({e}); skipped",
        )
        return
    for value in event.summary.value:
        parsed_tag = schema.parse_tag(value.tag)
        if parsed_tag is None:
            continue
        record, series = parsed_tag
        where = f"{value.tag} at step {event.step} ({path})"
        if value.metadata.plugin_data.plugin_name:
            tag_problems[value.tag] = _metadata_problem(value.metadata.plugin_data.content)
        found = tag_problems.get(value.tag)
        if found is None:
            try:
                parsed = _value(value)
            except ValueError as e:
                found = (f"{value.tag}\0value", f"unreadable value ({e})")
            else:
                reason = validation.step_problem(event.step, event.wall_time) or (
                    validation.problem(record, parsed)
                )
                if reason is None:
                    records.setdefault(_series_key(record, series), []).append(
                        Record(step=event.step, wall_time=event.wall_time, value=parsed)
                    )
                    continue
                found = (f"{value.tag}\0malformed", f"malformed record: {reason}")
        kind, reason = found
        warnings.add(kind, f"{where}: {reason}; skipped")


def _metadata_problem(content: bytes) -> tuple[str, str] | None:
    """(kind, reason) if a tag's plugin content makes its records unreadable."""
    try:
        schema.parse_plugin_content(content)
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, TypeError) as e:
        return "metadata", f"unreadable plugin metadata ({e})"
    except ValueError as e:  # the one ValueError it raises itself: a newer schema
        return "newer schema", str(e).rstrip(".")
    return None


# Numeric tensor dtypes a record may hold, and their little-endian layout.
_NUMERIC_DTYPES = {
    types_pb2.DT_DOUBLE: ("<f8", "double_val"),
    types_pb2.DT_FLOAT: ("<f4", "float_val"),
    types_pb2.DT_INT64: ("<i8", "int64_val"),
    types_pb2.DT_INT32: ("<i4", "int_val"),
}


def _value(value):
    """A summary value's tensor: a parsed JSON document or a numeric array.

    Decoded here rather than by `tensorboard.util.tensor_util`, which pulls in
    TensorBoard's TensorFlow stub and its file systems at import (a tenth of
    `mpprof diagnose`'s run time) and copies every array.

    Raises:
        ValueError: the tensor or its JSON text cannot be decoded.
    """
    tensor = value.tensor
    shape = tuple(dim.size for dim in tensor.tensor_shape.dim)
    if tensor.dtype == types_pb2.DT_STRING:
        if shape != () or len(tensor.string_val) != 1:
            raise ValueError(f"a string tensor of shape {list(shape)}, not one JSON text")
        try:
            return json.loads(tensor.string_val[0])
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"not JSON: {e}") from e
    if tensor.dtype not in _NUMERIC_DTYPES:
        raise ValueError(f"a tensor of {types_pb2.DataType.Name(tensor.dtype)}, not numbers")
    if any(size < 0 for size in shape):
        raise ValueError(f"a tensor of shape {list(shape)}")
    layout, field = _NUMERIC_DTYPES[tensor.dtype]
    count = math.prod(shape)
    if tensor.tensor_content:
        if len(tensor.tensor_content) != count * np.dtype(layout).itemsize:
            raise ValueError(f"{len(tensor.tensor_content)} bytes for shape {list(shape)}")
        return np.frombuffer(tensor.tensor_content, layout).reshape(shape)
    values = np.asarray(getattr(tensor, field), dtype=layout)
    if len(values) == 1 and count > 1:
        values = np.repeat(values, count)  # a proto may give one value for all
    if len(values) != count:
        raise ValueError(f"{len(values)} values for shape {list(shape)}")
    return values.reshape(shape)
