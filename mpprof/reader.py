"""Reads mpprof records back from a logdir into plain Python and numpy values.

Every front end (CLI, HTML report, TensorBoard plugin) reads through here.
Only mpprof's own event files are read (the writer marks them with
`EVENT_FILE_SUFFIX`), so a logdir full of histograms stays cheap to read.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import posixpath
import struct

import numpy as np
import tensorflow as tf
from tensorboard.compat.proto import event_pb2
from tensorboard.util import tensor_util

from mpprof import schema


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
        return self.events[self.events[:, 3] == kind]

    @property
    def overflows(self) -> np.ndarray:
        """[k, 3]: step, scale before, scale after of each overflow."""
        return self._kind(schema.EVENT_OVERFLOW)[:, :3]

    @property
    def growths(self) -> np.ndarray:
        """[k, 3]: step, scale before, scale after of each growth."""
        return self._kind(schema.EVENT_GROWTH)[:, :3]

    @property
    def overflow_steps(self) -> np.ndarray:
        return self.overflows[:, 0].astype(np.int64)

    @property
    def skipped_steps(self) -> int:
        return len(self.overflows)

    @property
    def first_step(self) -> int:
        return int(self.progress[0, 0]) if len(self.progress) else 0

    @property
    def steps_run(self) -> int:
        """Steps run up to the last read, skipped steps included."""
        last = int(self.progress[-1, 0]) if len(self.progress) else 0
        if len(self.events):
            last = max(last, int(self.events[-1, 0]) + 1)
        return last

    @property
    def initial_scale(self) -> float:
        if len(self.progress):
            return float(self.progress[0, 1])
        return float(self.events[0, 1]) if len(self.events) else float("nan")

    @property
    def final_scale(self) -> float:
        if len(self.events) and (
            not len(self.progress) or self.events[-1, 0] >= self.progress[-1, 0]
        ):
            return float(self.events[-1, 2])
        return float(self.progress[-1, 1]) if len(self.progress) else float("nan")

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
        steps.extend(self.events[:, 0].tolist())
        scales.extend(self.events[:, 2].tolist())
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

    def forward_overflowed(self) -> np.ndarray:
        """[steps, layers] bool: output non-finite or beyond the policy's max."""
        return (self.forward["nonfinite_frac"] > 0) | (self.forward["abs_max"] > self.policy_max)

    def first_forward_offender(self, sample: int) -> int | None:
        """The first layer in call order whose output overflowed at `sample`."""
        hits = np.flatnonzero(self.forward_overflowed()[sample])
        return int(hits[0]) if len(hits) else None

    def first_backward_offender(self, sample: int) -> int | None:
        """The first layer, from the loss backwards, whose incoming gradient
        was non-finite at `sample`."""
        hits = np.flatnonzero(self.backward["nonfinite_frac"][sample] > 0)
        return int(hits[-1]) if len(hits) else None


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
        return values[self.samples[:, 2] == device]


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
        events = self._stacked(schema.LOSS_SCALE_EVENTS, 4)
        progress = self._stacked(schema.LOSS_SCALE_PROGRESS, 3)
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
        sample_steps = joined[schema.NUMERICS_STEP][:, 0]
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
            steps=step_rows[:, 0].astype(np.int64),
            loss=step_rows[:, 1],
            loss_scale=step_rows[:, 2],
            forensic=step_rows[:, 3] > 0,
            steps_covered=step_rows[:, 4].astype(np.int64),
            forward=_shares(stacked(schema.NUMERICS_FORWARD)),
            backward=_shares(stacked(schema.NUMERICS_BACKWARD)),
            forward_hist=stacked(schema.NUMERICS_FORWARD_HIST),
            backward_hist=stacked(schema.NUMERICS_BACKWARD_HIST),
            variable_grads=_shares(stacked(schema.NUMERICS_GRADIENTS)),
            unscaled_variable_grads=_shares(stacked(schema.NUMERICS_UNSCALED_GRADIENTS)),
        )

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


def _unique_rows(rows: np.ndarray) -> np.ndarray:
    """Sorted by the first column; a row read twice is kept once."""
    if not len(rows):
        return rows
    return np.unique(rows, axis=0)


def list_runs(logdir: str | os.PathLike) -> list[str]:
    """Names of the runs under `logdir` that hold mpprof records, sorted.

    A run's name is its directory relative to `logdir` ("." for logdir
    itself), as TensorBoard names runs.
    """
    logdir = _existing_logdir(logdir)
    runs = set()
    for directory, _, files in tf.io.gfile.walk(logdir):
        if any(_is_mpprof_event_file(name) for name in files):
            relative = os.path.relpath(directory, logdir) if "://" not in logdir else (
                posixpath.relpath(directory, logdir)
            )
            runs.add(relative.replace(os.sep, "/"))
    return sorted(runs)


def event_files(logdir: str | os.PathLike, run: str) -> list[str]:
    """Paths of the mpprof event files of `run` (a name from `list_runs`), sorted.

    Raises NoMpprofDataError for a name that is not a run under `logdir`
    (absolute paths and ".." included) or a run without mpprof records.
    """
    logdir = _existing_logdir(logdir)
    parts = run.split("/")
    if run.startswith("/") or "\\" in run or ".." in parts or "" in parts:
        raise NoMpprofDataError(f"No run {run!r} in {logdir}")
    path = logdir if run == "." else posixpath.join(logdir, run)
    if not tf.io.gfile.isdir(path):
        raise NoMpprofDataError(f"No run {run!r} in {logdir}")
    files = sorted(f for f in tf.io.gfile.listdir(path) if _is_mpprof_event_file(f))
    if not files:
        raise NoMpprofDataError(f"Run {run!r} in {logdir} holds no mpprof records")
    return [posixpath.join(path, name) for name in files]


def read_run(logdir: str | os.PathLike, run: str) -> Run:
    """Reads one run; raises NoMpprofDataError if it holds no mpprof records."""
    files = event_files(logdir, run)
    records: dict[str, list[Record]] = {}
    warnings: list[str] = []
    for path in files:
        _read_event_file(path, records, warnings)
    for found in records.values():
        found.sort(key=lambda r: (r.wall_time, r.step))
    return Run(name=run, path=posixpath.dirname(files[0]), records=records, warnings=warnings)


def read_logdir(logdir: str | os.PathLike) -> dict[str, Run]:
    """Reads every mpprof run under `logdir`, keyed by run name."""
    runs = list_runs(logdir)
    if not runs:
        raise NoMpprofDataError(
            f"{os.fspath(logdir)} holds no mpprof records. Record a run with "
            "model.fit(..., callbacks=[mpprof.MixedPrecisionProfiler(log_dir=...)]) "
            "and point mpprof at that log_dir."
        )
    return {run: read_run(logdir, run) for run in runs}


def _is_mpprof_event_file(name: str) -> bool:
    return "tfevents" in name and name.endswith(schema.EVENT_FILE_SUFFIX)


def _existing_logdir(logdir: str | os.PathLike) -> str:
    logdir = os.fspath(logdir)
    if not tf.io.gfile.isdir(logdir):
        raise LogdirNotFoundError(
            f"Logdir {logdir!r} does not exist: pass the log_dir given to "
            "mpprof.MixedPrecisionProfiler."
        )
    return logdir


def _read_event_file(path: str, records: dict, warnings: list[str]) -> None:
    """Reads one event file record by record (TFRecord framing: length (8
    bytes), its CRC (4), payload, payload CRC (4)); CRCs are not checked, a
    payload that does not parse is reported and skipped."""
    try:
        size = tf.io.gfile.stat(path).length
        with tf.io.gfile.GFile(path, "rb") as f:
            offset = 0
            while header := f.read(12):
                (length,) = struct.unpack_from("<Q", header) if len(header) == 12 else (-1,)
                fits = 0 <= length <= size - offset - 16
                body = f.read(length + 4) if fits else b""
                if not fits or len(body) < length + 4:
                    warnings.append(
                        f"{path}: ends in an incomplete record at byte {offset} (still "
                        "being written, or truncated); read what came before it"
                    )
                    return
                _parse_event(body[:length], path, offset, records, warnings)
                offset += 12 + length + 4
    except (OSError, tf.errors.OpError) as e:
        warnings.append(f"{path}: cannot be read ({e}); skipped")


def _parse_event(payload: bytes, path: str, offset: int, records: dict,
                 warnings: list[str]) -> None:
    try:
        event = event_pb2.Event.FromString(payload)
        for value in event.summary.value:
            _collect(value, event, records)
    except Exception as e:  # noqa: BLE001 - corrupt bytes raise anything
        warnings.append(f"{path}: corrupt record at byte {offset} ({e}); skipped")


def _collect(value, event, records: dict) -> None:
    record = schema.record_for_tag(value.tag)
    if record is None:
        return
    if value.metadata.plugin_data.plugin_name:
        schema.parse_plugin_content(value.metadata.plugin_data.content)
    array = tensor_util.make_ndarray(value.tensor)
    if array.dtype == object:
        parsed = json.loads(array.item().decode())
    else:
        parsed = array
    records.setdefault(record, []).append(
        Record(step=event.step, wall_time=event.wall_time, value=parsed)
    )
