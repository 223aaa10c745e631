"""The loss scale of every LossScaleOptimizer a train step uses, one series
each, from a step state that counts each optimizer's steps (JAX's in-step
table, `mpprof.backends.jax.step_state`, and PyTorch's host counters,
`mpprof.backends.torch.step_state`, which keeps its interface; this module
imports no framework, and is the JAX backend's `LossScales` as it is).

On JAX, each optimizer the step may apply is followed through its `stateless_apply`
(`mpprof.backends.jax.step_state`), wherever the step keeps its variables:
the compiled optimizer's in Keras' `state[2]`, a GAN's `g_opt` and `d_opt`
wherever its author put them. As on TensorFlow, once the step was traced
only the optimizers it really applied are kept; the primary one (the
compiled optimizer when used, else the first used) is written under the
plain tags, every other one under a series named after its attribute
(`schema.tag_for(record, series)`). An optimizer the step applies where its
update cannot be seen (inside a `lax.scan`) is not followed: the run
context says so, and when it is the primary one the step axis is the host's
count of steps run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mpprof.backends.loss_scale_records import LossScalesBase, series_context, write_series
from mpprof.backends.optimizer_usage import OptimizerUsage, applied_steps
from mpprof.backends.patching import Patches
from mpprof.backends.step_origin import EarlierRecords


class LossScales(LossScalesBase):
    """One loss-scale collector per followed LossScaleOptimizer
    (`mpprof.backends.protocol.LossScales`).

    Args: `LossScalesBase`'s; `keras_api` makes the fit's step state, which
    counts each optimizer's overflows (JAX: inside the jitted step).
    """

    def __init__(self, keras_api, usage: OptimizerUsage, strategy, capacity: int,
                 reuse: dict[int, Any], earlier: Callable[[], EarlierRecords | str]):
        self._step_state = keras_api.make_step_state(capacity, usage)
        super().__init__(keras_api, usage, strategy, capacity, reuse, earlier)

    def _follows(self, use) -> bool:
        return self._step_state.follows(use.optimizer)

    def _new_series(self, keras_api, use, strategy, capacity: int):
        return keras_api.loss_scale_series(use.optimizer, self._step_state, capacity)

    def _reused(self, series) -> None:
        series.attach(self._step_state)

    def install(self, fit, patches: Patches) -> None:
        # (After `TrainFunctions.install`, which starts the step state.)
        self._overflows_seen = self.skipped_steps()
        # Where each scale starts; written at the first flush, once the step
        # was traced and shows which optimizers it uses.
        self._start = {name: c.read()[1] for name, c in self.by_name.items()}

    def flush(self, fit) -> None:
        write_series(fit, self.active(), self.primary(), self._start)

    def active(self) -> dict[str, Any]:
        """The series of the optimizers the step applied (all of them until
        it was traced), unless an update was applied out of sight."""
        unfollowed = self._step_state.unfollowed
        used = {use.name for use in self._usage.used() if id(use.optimizer) not in unfollowed}
        return {name: c for name, c in self.by_name.items() if name in used}

    def unfollowed(self) -> dict[str, str]:
        """The used LossScaleOptimizers whose scale and skips are not
        followed, with the reason, by name."""
        reasons = self._step_state.unfollowed
        return {u.name: reasons[id(u.optimizer)] for u in self._usage.used()
                if u.loss_scale and id(u.optimizer) in reasons}

    def primary(self):
        primary = self._usage.primary()
        return self.active().get(primary.name) if primary is not None else None

    def skipped_counters(self) -> list:
        """(The JAX alarm is made by the step itself: no counters to sum.)"""
        return []

    def step_of(self, use) -> int | None:
        """Steps `use` has run: its apply calls, plus its skipped steps under
        loss scaling; None for an optimizer whose steps are not followed
        (the caller counts steps run itself)."""
        state = self._step_state
        if not state.follows(use.optimizer) or id(use.optimizer) in state.unfollowed:
            return None
        collector = self.by_name.get(use.name)
        if collector is not None:
            return collector.current_step()
        if state.arrays is not None:
            return state.applied(use.optimizer)
        return int(np.asarray(applied_steps(use.optimizer).value))

    def scale_value(self) -> float:
        primary = self.primary()
        return primary.scale() if primary is not None else 1.0

    def context(self) -> dict:
        active, unfollowed = self.active(), self.unfollowed()
        if not active:
            if unfollowed:
                return {"state": "absent", "reason": "; ".join(
                    f"{name}: {reason}" for name, reason in unfollowed.items())}
            return self._absent()
        context = series_context(active, self.primary(), self._replicas)
        if unfollowed:
            context["not_followed"] = unfollowed
        return context

    def graph_step_of(self, name: str):
        """(TensorFlow's in-graph step; the JAX step state dates its own
        events, so nothing asks it here.)"""
        return lambda: None

    def scale_of(self, name: str):
        collector = self.by_name.get(name)
        return collector.scale if collector is not None else (lambda: 1.0)
