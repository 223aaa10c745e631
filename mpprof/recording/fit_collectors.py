"""The collectors of one fit, built from the settings and the fit's backend."""

from __future__ import annotations

import functools
import posixpath
from dataclasses import dataclass

from mpprof.backends import protocol, step_origin
from mpprof.backends.base import Backend
from mpprof.backends.optimizer_usage import OptimizerUsage
from mpprof.backends.worker_role import WorkerRole
from mpprof.recording.across_fits import AcrossFits
from mpprof.recording.collectors.gpu_host import HostRecorder
from mpprof.recording.collectors.inventory import Inventory
from mpprof.recording.collectors.numerics_samples import NumericsSamples
from mpprof.recording.guard import Guard
from mpprof.recording.settings import Settings


@dataclass
class FitCollectors:
    """Every collector of a fit, by concern (`all` gives their hook order).

    Attributes:
        sampling: the collectors whose in-graph taps run on sampled calls.
    """

    inventory: Inventory
    loss_scales: protocol.LossScales
    health: protocol.RunHealth
    numerics: NumericsSamples
    host: HostRecorder
    float8_state: protocol.Collector
    float8_shares: protocol.SamplingCollector
    replay: protocol.ReplayCapture

    @property
    def all(self) -> list[protocol.Collector]:
        return [self.inventory, self.loss_scales, self.health, self.numerics, self.host,
                self.float8_state, self.float8_shares, self.replay]

    @property
    def sampling(self) -> list[protocol.SamplingCollector]:
        return [self.numerics, self.float8_shares]


def build(backend: Backend, model, settings: Settings, across_fits: AcrossFits, guard: Guard,
          role: WorkerRole, usage: OptimizerUsage, profiler) -> FitCollectors:
    """The collectors of the fit `model` begins (`profiler`: the callback,
    whose sibling callbacks may own the XProf profiler)."""
    numerics: list[NumericsSamples] = []

    def instrumenting() -> bool:
        """Whether the step being traced is the instrumented one."""
        return numerics[0].instrumenting

    strategy = backend.distribute_strategy(model)
    capacity = 2 * (settings.flush_every_steps + backend.steps_per_execution(model))
    inventory = Inventory(backend, model, guard)
    loss_scales = backend.LossScales(
        backend, usage, strategy, capacity, across_fits.loss_scales,
        functools.cache(lambda: step_origin.read_earlier(settings.log_dir)),
    )
    health = backend.RunHealth(backend, usage, strategy, loss_scales.graph_step_of,
                               across_fits.health, instrumenting)
    numerics.append(NumericsSamples(
        backend.numerics_taps, inventory, loss_scales, health,
        {"every": settings.numerics_every,
         "early_steps": list(across_fits.schedule.early_steps),
         "forensic_budget": settings.forensic_budget,
         "forensic_spacing": settings.forensic_spacing},
    ))
    if across_fits.profile_window is None and settings.profile_steps:
        across_fits.profile_window = backend.profile_window(
            *settings.profile_steps, settings.run_dir)
    window = across_fits.profile_window
    if window is not None and role.worker_run is not None:
        # Each worker traces its own host, into its own run.
        window.run_dir = posixpath.join(settings.run_dir, role.worker_run)
    return FitCollectors(
        inventory=inventory,
        loss_scales=loss_scales,
        health=health,
        numerics=numerics[0],
        host=HostRecorder(settings.gpu_interval, window, profiler, backend),
        float8_state=backend.Float8State(model, loss_scales),
        float8_shares=backend.Float8Shares(model, settings.sampling),
        replay=backend.ReplayCapture(settings.replay_budget, backend, loss_scales, health,
                                     instrumenting, advise_batches=settings.advise_batches,
                                     fit_params=getattr(profiler, "params", None)),
    )
