"""`Run`: everything mpprof recorded in one run directory, and its views."""

from __future__ import annotations

import dataclasses
import functools
import posixpath

import numpy as np

from mpprof.records import float8 as float8_records
from mpprof.records import run_context, schema
from mpprof.records import views as record_views
from mpprof.records.event_file import Record, series_key
from mpprof.records.float8 import Float8
from mpprof.records.run_context import RunContext
from mpprof.records.views import Gpu, LossScale, Numerics


@dataclasses.dataclass
class Run:
    """Everything mpprof recorded in one run directory."""

    name: str
    path: str
    records: dict[str, list[Record]]
    warnings: list[str]
    # How each writer's fit ended, from its fit-end file (see
    # `schema.fit_end_name`), newest writer last; empty for older logs.
    fit_ends: list[dict] = dataclasses.field(default_factory=list)
    # "@<host>-<pid>" where this run is one of several fits that wrote into
    # `path` at once (`run_files.split_writers`), else "".
    writer_suffix: str = ""
    # What could not be read of each damaged event file (`event_file.Loss`).
    losses: list = dataclasses.field(default_factory=list)

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

        Records that stop early because a file is damaged (a length that
        fails its checksum, a file cut short: `losses`) cut the run short
        too, whatever the fit did: what can be read ends there.

        Returns:
            None, or `{"fit_state": "running"|"failed", "step": the largest
            step of any record, "wall_time": the latest record's time}`; for
            damaged files, "fit_state" is how the fit itself ended, as far as
            known, and "unreadable" says how much of which file was lost.
        """
        state = self.context.fit_state
        end = self.fit_ends[-1] if self.fit_ends else {}
        # A write that failed (a full disk) leaves a record cut short at the
        # end: the fit-end file says so, and `recording_stopped` says why.
        lost = [loss for loss in self.losses
                if loss.stops_early and not end.get("recording_stopped")]
        if lost and self.last_record is not None:
            step, wall_time = self.last_record
            return {"fit_state": end.get("fit_state") or state or "unknown", "step": step,
                    "wall_time": wall_time,
                    "unreadable": "; ".join(f"{loss.file}: {loss.describe()}" for loss in lost)}
        if state in (None, run_context.FIT_ENDED) or self.last_record is None:
            return None
        # The records stop early when a full disk stopped them: the fit-end
        # file, reserved at the start, says whether the fit itself ended.
        if end.get("fit_state") == run_context.FIT_ENDED:
            return None
        if end.get("fit_state") == run_context.FIT_FAILED:
            state = run_context.FIT_FAILED
        step, wall_time = self.last_record
        return {"fit_state": state, "step": step, "wall_time": wall_time}

    @property
    def recording_stopped(self) -> dict | None:
        """When a failed write (a full disk) stopped the records while the fit
        went on: `{"reason", "records_until_step", "fit_state" (how the fit
        ended), "fit_step" (its last step), "wall_time" (its end)}`, else None.
        """
        end = self.fit_ends[-1] if self.fit_ends else {}
        if not end.get("recording_stopped"):
            return None
        return {
            "reason": str(end["recording_stopped"]),
            "records_until_step": self.last_record[0] if self.last_record else None,
            "fit_state": end.get("fit_state"),
            "fit_step": end.get("step"),
            "wall_time": end.get("wall_time"),
        }

    @property
    def fit_outcome(self) -> str:
        """How the run's (latest) fit stands: "ended", "failed", "cut_short"
        (it never recorded its end: killed, or still training; or its
        records stop early at a damaged file), or "unknown"
        (a run recorded before mpprof said, or nothing readable)."""
        stopped = self.cut_short
        if stopped is not None:
            return (run_context.FIT_FAILED if stopped["fit_state"] == run_context.FIT_FAILED
                    else "cut_short")
        return run_context.FIT_ENDED if self.context.fit_state else "unknown"

    @property
    def context(self) -> RunContext:
        """The latest run context (`RunContext`, empty when none was read)."""
        return RunContext(self.latest(schema.RUN_CONTEXT))

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
        if context.run_role != "worker":
            return None
        distributed = context.distributed
        return {
            "index": distributed.get("worker_index"),
            "role": distributed.get("role"),
            "model_run": posixpath.dirname(self.name) or ".",
            "evidence": context.worker_evidence,
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
            loss_scale = self.context.collector("loss_scale")
            found[str(loss_scale.get("primary", "optimizer"))] = self.loss_scale
        prefix = schema.LOSS_SCALE_PROGRESS + schema.SERIES_SEPARATOR
        for key in sorted(self.records):
            if key.startswith(prefix):
                series = key[len(prefix):]
                found[series] = self._loss_scale_series(series)
        return found

    def _loss_scale_series(self, series: str | None) -> LossScale | None:
        return record_views.loss_scale(
            self._stacked(series_key(schema.LOSS_SCALE_EVENTS, series),
                          len(schema.LOSS_SCALE_EVENT_COLUMNS)),
            self._stacked(series_key(schema.LOSS_SCALE_PROGRESS, series),
                          len(schema.LOSS_SCALE_PROGRESS_COLUMNS)),
        )

    @property
    def health(self) -> dict | None:
        return self.latest(schema.HEALTH)
    @functools.cached_property
    def numerics(self) -> Numerics | None:
        """Per-layer numerics samples; None if the run holds no complete one."""
        return record_views.numerics(self.latest(schema.NUMERICS_LAYOUT), self.records)

    @functools.cached_property
    def float8(self) -> Float8 | None:
        """The float8 layers' scales and amax; None for a run without float8
        layers (or recorded before mpprof recorded them)."""
        return float8_records.float8(self.latest(schema.FLOAT8_LAYOUT), self.records)

    @functools.cached_property
    def gpu(self) -> Gpu | None:
        """GPU samples and kernel share; None if the run recorded no GPU entry."""
        return record_views.gpu(
            self.context.collector("gpu") or None,
            self._stacked(schema.GPU_SAMPLES, len(schema.GPU_SAMPLE_COLUMNS)),
            self.latest(schema.KERNEL_STATS),
        )

    def _stacked(self, record: str, columns: int) -> np.ndarray:
        return record_views.stacked_rows(self.records.get(record, []), columns)
