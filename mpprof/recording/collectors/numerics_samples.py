"""Numerics samples: taken by `NumericsTaps` on the steps the schedule
picks, batched here for writing.

The collector is made at the first sample (its statistics tables need the
built model). Its tables are read once per sampled call; the rows wait on
the host and are written as one [samples, ...] array per record at flush
points (one write per record instead of one per sample).
"""

from __future__ import annotations

import math

import numpy as np

from mpprof.backends import protocol
from mpprof.backends.collector import Collector
from mpprof.backends.patching import Patches
from mpprof.dtypes import DTYPE_MAX
from mpprof.records import schema

# Samples waiting for the next flush, at most.
MAX_PENDING_SAMPLES = 64

class NumericsSamples(Collector):
    """Turns the collector's readings into NUMERICS_* records.

    Args:
        collector_class: the Keras flavour's `NumericsTaps` class.
        inventory: the `Inventory` whose layer wrappers the collector hooks.
        loss_scales: the `LossScales` (the primary scale unscales gradients).
        health: the `RunHealth` (the sampled step's loss).
        settings: the profiler's numerics settings, for the run context.
    """

    name = "numerics"

    def __init__(self, collector_class, inventory, loss_scales, health, settings: dict):
        self._collector_class = collector_class
        self._inventory = inventory
        self._loss_scales = loss_scales
        self._health = health
        self._settings = settings
        self.collector: protocol.NumericsTaps | None = None
        self._pending: list[dict[str, np.ndarray]] = []
        self._layout_written: dict | None = None
        self._forensic_used = 0
        # The notes of forensic samples of earlier steps' batches (JAX).
        self._replayed: list[dict] = []
        self._patches: Patches | None = None
        self._off_reason: str | None = None

    def install(self, fit, patches: Patches) -> None:
        # The collector is made at the first sample; its optimizer wrappers
        # go through the fit's patches then.
        self._patches = patches

    def prepare(self, fit) -> bool:
        """Makes the collector before the first sampled call."""
        if self.collector is None:
            model = fit.model
            # (A JAX model has no distribute_strategy: its collector needs none.)
            collector = self._collector_class(model, getattr(model, "distribute_strategy", None))
            for use in fit.usage.used():
                # Each optimizer's gradients are unscaled by its own scale.
                collector.wrap_optimizer(
                    use.optimizer, self._loss_scales.scale_of(use.name), self._patches
                )
            self._inventory.add_hook(self.name, collector)
            self.collector = collector
        return True

    @property
    def instrumenting(self) -> bool:
        """Whether the call under way (and so a train function traced now)
        is the instrumented one."""
        return self.collector is not None and self.collector.instrumenting

    def instrument(self, on: bool) -> None:
        if self.collector is not None:
            self.collector.instrumenting = on

    def after_sample(self, fit) -> None:
        """Reads the sample the call just made recorded."""
        self._forensic_used = fit.schedule.forensic_used
        sample = self.collector.read()
        # The loss comes from the health watchers, but for a sample of an
        # earlier step's batch (whose step is not the call's).
        own_loss = sample.pop("loss", math.nan)
        max_value = DTYPE_MAX.get(fit.model.dtype_policy.compute_dtype, DTYPE_MAX["float32"])
        layout = self.collector.layout(max_value)
        if layout != self._layout_written:
            self.flush(fit)  # samples of the old layout go first
            fit.writer.write_json(schema.NUMERICS_LAYOUT, layout, fit.sample_step)
            self._layout_written = layout
        loss = self._health.last_loss() if fit.guard.ok(self._health.name) else math.nan
        covered = fit.step - fit.sample_step
        if fit.replayed_sample is not None:
            loss, covered = own_loss, 1
            self._replayed.append(fit.replayed_sample)
        scale = self._loss_scales.scale_value()
        sample[schema.NUMERICS_STEP] = np.array([
            fit.sample_step, loss, scale, float(fit.forensic), covered,
        ])
        self._pending.append(sample)
        if len(self._pending) >= MAX_PENDING_SAMPLES:
            self.flush(fit)

    def flush(self, fit) -> None:
        """Writes the pending samples, each record as one [samples, ...] array."""
        if not self._pending:
            return
        samples, self._pending = self._pending, []
        step = int(samples[0][schema.NUMERICS_STEP][0])
        for record in samples[0]:
            fit.writer.write_array(record, np.stack([s[record] for s in samples]), step)

    def switch_off(self, reason: str) -> None:
        """No sample will be taken in this fit, for `reason` (the run context
        says it)."""
        self._off_reason = reason

    def context(self) -> dict:
        if self._settings.get("every") is None:
            return {"state": "off", "reason": "numerics_every=None"}
        if self._off_reason is not None:
            return {"state": "off", "reason": self._off_reason, **self._settings}
        entry = {"state": "ok", **self._settings, "forensic_used": self._forensic_used}
        if self._replayed:
            entry["forensic_of_earlier_steps"] = {
                "how": ("the instrumented step evaluated, beside the sampled call, on the "
                        "kept batch of the overflowed step, with the state (weights, loss "
                        "scale) at the call (state_of_step); weights_of_step: the step "
                        "whose weights those are (the overflowed one when every step "
                        "since was skipped)"),
                "samples": self._replayed,
            }
        return entry
