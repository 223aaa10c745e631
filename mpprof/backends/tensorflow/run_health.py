"""The HEALTH record: is the loss finite, are the weights finite.

The loss is watched inside the traced step where it passes through an
optimizer (`LossWatch`, one per optimizer the step may use); the
weights are checked on the host at epoch ends and when fit ends. A loss that
never passed through a watched optimizer is "not watched": the record then
says so and holds no value for it, rather than a number nobody measured.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import tensorflow as tf

from mpprof.backends.collector import Collector
from mpprof.backends.health_record import health_record
from mpprof.backends.layer_records import variable_path
from mpprof.backends.optimizer_usage import OptimizerUsage
from mpprof.backends.patching import Patches
from mpprof.backends.tensorflow import keras_flavors
from mpprof.records import schema


class RunHealth(Collector):
    """Loss watchers for the step's optimizers, and the weight check.

    Args:
        keras_api: the fit's `Backend` (`mpprof.backends.base`).
        usage: the model's `OptimizerUsage`.
        strategy: the model's distribution strategy.
        step_of: for an optimizer's name, a function giving its step in-graph.
        reuse: watchers of an earlier fit, by optimizer id (they keep the
            first non-finite step across fits).
        instrumenting: returns whether the step being traced is the
            instrumented one (whose loss the watchers keep for its sample).
    """

    name = "loss_health"

    def __init__(self, keras_api, usage: OptimizerUsage, strategy, step_of, reuse: dict,
                 instrumenting: Callable[[], bool]):
        self._usage = usage
        self._instrumenting = instrumenting
        self.watchers = {}
        for use in usage.uses:
            watcher = reuse.get(id(use.optimizer))
            if watcher is None:
                watcher = keras_api.loss_watch(
                    use.optimizer, strategy, step_of(use.name)
                )
            self.watchers[use.name] = watcher
        self.nonfinite_weights: list[str] = []

    def install(self, fit, patches: Patches) -> None:
        for watcher in self.watchers.values():
            watcher.instrumenting = self._instrumenting
            watcher.traced.on_error = lambda error: fit.guard.fail(self.name, error)
            watcher.install(patches)

    def flush(self, fit) -> None:
        fit.writer.write_json(schema.HEALTH, self.record(fit.step), fit.step)

    def end(self, fit) -> None:
        self.check_weights(fit.model)

    def context(self) -> dict:
        if self.watched() is not None:
            return {"state": "ok"}
        return {"state": "absent", "reason": "no loss passed through a watched optimizer"}

    def nonfinite_counters(self) -> list[tf.Variable]:
        """Every available watcher's in-graph count of non-finite losses."""
        return [w.nonfinite_counter for w in self.watchers.values() if w.available]

    def note_calls(self, first_step: int, last_step: int) -> None:
        """After calls whose alarm rang: each watcher dates its first
        non-finite loss when it is among steps `first_step` to `last_step`."""
        for watcher in self.watchers.values():
            if watcher.available:
                watcher.note_calls(first_step, last_step)

    def watched(self):
        """The watcher of the loss the record reports (the primary optimizer's
        when the step scaled its loss, else the first one that saw a loss), or
        None when no loss passed through a watched optimizer."""
        uses = self._usage.used()
        primary = self._usage.primary()
        if primary is not None:
            uses = [primary] + [u for u in uses if u is not primary]
        for use in uses:
            watcher = self.watchers.get(use.name)
            saw_loss = use.scale_loss_called is not False
            if watcher is not None and watcher.available and saw_loss:
                return watcher
        return None

    def last_loss(self) -> float:
        """The last instrumented step's loss, NaN when no loss was watched."""
        watcher = self.watched()
        return watcher.last_loss() if watcher is not None else math.nan

    def check_weights(self, model) -> None:
        self.nonfinite_weights = [
            variable_path(w) for w in model.weights
            if keras_flavors.is_float_variable(w)
            and not bool(tf.reduce_all(tf.math.is_finite(tf.convert_to_tensor(w))))
        ]

    def record(self, step: int) -> dict:
        """The HEALTH record as of `step`."""
        watcher = self.watched()
        return health_record(None if watcher is None else watcher.read(),
                             self.nonfinite_weights, step)

    def by_optimizer(self) -> dict[int, object]:
        return {id(w.optimizer): w for w in self.watchers.values()}
