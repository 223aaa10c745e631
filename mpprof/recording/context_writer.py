"""The run context of one fit: what the run was, written at each flush."""

from __future__ import annotations

from mpprof.backends.base import Backend
from mpprof.backends.worker_role import WorkerRole
from mpprof.recording.across_fits import AcrossFits
from mpprof.recording.fit_collectors import FitCollectors
from mpprof.recording.fit_state import FitState
from mpprof.recording.guard import Guard
from mpprof.recording.routing import RecordRouting
from mpprof.recording.settings import Settings
from mpprof.records import schema

# The profiler's own parts that are not collectors but can fail.
_OWN_PARTS = ("recording", "profiler", "run_context")


class ContextWriter:
    """Writes the run context of one fit into its runs.

    Args:
        backend: the fit's backend (the framework's facts).
        model: the model being trained.
        settings: the profiler's settings.
        across_fits: what the profiler's earlier fits left.
        guard: the profiler's `Guard` (each collector's state).
        role: this process's `WorkerRole`.
        distribution_note: why distributed training is not recorded, if so.
    """

    def __init__(self, backend: Backend, model, settings: Settings, across_fits: AcrossFits,
                 guard: Guard, role: WorkerRole, distribution_note: str | None):
        self._backend = backend
        self._model = model
        self._settings = settings
        self._across_fits = across_fits
        self._guard = guard
        self._role = role
        self._distribution_note = distribution_note

    def write(self, routing: RecordRouting, collectors: FitCollectors | None,
              fit: FitState | None, start_step: int, fit_state: str,
              sigterm_state: str, fit_error: dict | None = None) -> None:
        """Writes the context now (`fit`: None once the fit is over or
        before it began; `fit_error`: what the fit raised, if it did); a
        failure is the guard's, never the fit's."""
        self._guard.run("run_context", self._write, routing, collectors, fit, start_step,
                        fit_state, sigterm_state, fit_error)

    def _write(self, routing, collectors, fit, start_step, fit_state, sigterm_state,
               fit_error) -> None:
        step = fit.step if fit is not None else self._across_fits.last_step or 0
        evidence = None
        if fit is not None and routing.worker is not None:
            health = self._guard.run(collectors.health.name, collectors.health.record,
                                     step) or {}
            evidence = {"steps_run": step,
                        "skipped_steps": collectors.loss_scales.skipped_steps(), **health}
        context = self._context(collectors, fit, start_step, fit_state, sigterm_state)
        if fit_error is not None:
            context["fit_error"] = fit_error
        routing.write_context(context, step, evidence)

    def _context(self, collectors: FitCollectors | None, fit: FitState | None,
                 start_step: int, fit_state: str, sigterm_state: str) -> dict:
        states = {c.name: self._guard.context(c.name, c.context())
                  for c in (collectors.all if collectors is not None else [])}
        if fit is not None:
            states[collectors.numerics.name].setdefault(
                "forensic_used", self._across_fits.schedule.forensic_used
            )
            kernels = collectors.host.kernels_context()
            if kernels is not None:
                states["kernels"] = self._guard.context(collectors.host.name, kernels)
        for name in _OWN_PARTS:
            if not self._guard.ok(name):
                states[name] = self._guard.context(name, {})
        step = start_step if fit is not None else self._across_fits.last_step or 0
        context = self._backend.run_context(
            self._model, collectors=states,
            hardware=collectors.host.hardware if fit is not None else None,
            step=step, fit_count=self._across_fits.fit_count,
        )
        if fit is not None:
            context["optimizers"] = fit.usage.describe()
            primary = fit.usage.primary() if fit.usage.traced else None
            if primary is not None:
                context["optimizer"] = type(primary.optimizer).__name__
        context["fit_state"] = fit_state
        context["records_reach_disk"] = {
            "every_steps": self._settings.flush_every_steps,
            "every_seconds": self._settings.flush_every_seconds,
            "on_sigterm": sigterm_state,
        }
        context["distributed"] = self._role.describe(schema.TRAIN_RUN)
        if self._distribution_note is not None:
            context["distributed"]["note"] = self._distribution_note
        return context
