"""The loss scale of every LossScaleOptimizer a train step uses, one series each.

A model compiled with a LossScaleOptimizer has one series, written under the
plain loss-scale tags. A custom `train_step` may use its own optimizers (a
GAN's `g_opt` and `d_opt`): each LossScaleOptimizer among them gets its own
`LossScaleSeries`, and once the step was traced only those it really
used are kept. The primary one (the compiled optimizer when used, else the
first used) is written under the plain tags, every other one under a series
named after its attribute (`schema.tag_for(record, series)`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from mpprof.backends.loss_scale_records import LossScalesBase, series_context, write_series
from mpprof.backends.optimizer_usage import OptimizerUsage, applied_steps
from mpprof.backends.patching import Patches
from mpprof.backends.step_origin import EarlierRecords
from mpprof.backends.tensorflow.loss_scale_series import MODE_HOST


class LossScales(LossScalesBase):
    """One loss-scale collector per LossScaleOptimizer the step may use.

    Args: `LossScalesBase`'s.
    """

    def __init__(self, keras_api, usage: OptimizerUsage, strategy, capacity: int,
                 reuse: dict[int, Any], earlier: Callable[[], EarlierRecords | str]):
        super().__init__(keras_api, usage, strategy, capacity, reuse, earlier)
        self._active: dict[str, object] | None = None

    def _new_series(self, keras_api, use, strategy, capacity: int):
        return keras_api.loss_scale_series(use.optimizer, strategy, capacity)

    def install(self, fit, patches: Patches) -> None:
        for collector in self.by_name.values():
            collector.traced.on_error = lambda error: fit.guard.fail(self.name, error)
            collector.install(patches)
        self._overflows_seen = self.skipped_steps()
        # Where each scale starts; written once the step was traced and shows
        # which optimizers it uses (and so under which tags).
        self._start = {name: c.read()[1] for name, c in self.by_name.items()}

    @property
    def after_each_call(self) -> bool:
        """Work after every call: polling, for a series in host mode."""
        return any(c.mode == MODE_HOST for c in self.active().values())

    def after_call(self, fit) -> None:
        """Polls the series in host mode."""
        for collector in self.active().values():
            collector.poll_if_host_mode()

    def flush(self, fit) -> None:
        """Reads every used series and writes its new events and progress."""
        if self:
            write_series(fit, self.active(), self.primary(), self._start)

    def active(self) -> dict[str, Any]:
        """The series of optimizers the step uses (all of them until traced;
        asked after every call, so kept once the step was traced)."""
        if self._active is not None:
            return self._active
        used = {use.name for use in self._usage.used()}
        active = {name: c for name, c in self.by_name.items() if name in used}
        if self._usage.traced:
            self._active = active
        return active

    def primary(self):
        """The collector of the primary optimizer, or None when it has no
        loss scale."""
        primary = self._usage.primary()
        return self.by_name.get(primary.name) if primary is not None else None

    def skipped_counters(self) -> list[tf.Variable]:
        """Every series' in-graph count of skipped steps."""
        return [c.skipped_counter for c in self.by_name.values()]

    def skipped_total(self) -> tf.Tensor | None:
        """In-graph sum of every series' skipped steps (None: no series)."""
        counters = [tf.convert_to_tensor(c) for c in self.skipped_counters()]
        if not counters:
            return None
        return counters[0] if len(counters) == 1 else tf.add_n(counters)

    def scale_tensor(self) -> tf.Tensor:
        """The primary optimizer's loss scale inside the graph (1 without one,
        or before its variables exist)."""
        primary = self.primary()
        if primary is None:
            return tf.constant(1.0)
        return primary.scale_tensor()

    def scale_value(self) -> float:
        """The primary optimizer's loss scale now (a host read; 1 without one)."""
        return float(self.scale_tensor().numpy())

    def step_of(self, use) -> int:
        """Steps optimizer `use` has run (a host read): its apply calls, plus
        its skipped steps under loss scaling (Keras 3 does not count them)."""
        collector = self.by_name.get(use.name)
        if collector is not None:
            return collector.current_step()
        return int(applied_steps(use.optimizer).numpy())

    def graph_step_of(self, name: str):
        """For an optimizer's name, a function giving its step in-graph."""
        collector = self.by_name.get(name)
        if collector is not None:
            return collector.graph_step
        optimizer = next(u.optimizer for u in self._usage.uses if u.name == name)
        return lambda: tf.convert_to_tensor(applied_steps(optimizer))

    def scale_of(self, name: str):
        """A function giving optimizer `name`'s loss scale in-graph (1 for an
        optimizer without loss scaling)."""
        collector = self.by_name.get(name)
        if collector is None:
            return lambda: tf.constant(1.0)
        return collector.scale_tensor

    def context(self) -> dict:
        """The run context's "loss_scale" collector state."""
        active = self.active()
        if not active:
            return self._absent()
        return series_context(active, self.primary(), self._replicas)
