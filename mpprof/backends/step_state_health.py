"""The HEALTH record from a step state that checks the loss (JAX's in-step
table; PyTorch's host counters, whose backend subclasses this:
`mpprof.backends.torch.run_health`): is the loss finite, are the weights
finite. Imports no framework.

Keras' JAX train step hands its unscaled loss to the model's
`_update_metrics_variables` (outside the gradient trace), and a custom
`train_step` to its loss metrics (`custom_step`); the profiled step takes it
there and checks it in the step itself (`StepState`): the count of
steps with a non-finite loss and the first such step, exact to the step
(also under `steps_per_execution > 1`), read at flush points. The weights
are checked on the host at epoch ends and when fit ends, once Keras has
written the step's state back to the variables.

A step with several losses (a GAN's) is checked on their sum. The record
names the LossScaleOptimizers whose skipped steps catch it
(`loss_guarded_by`: every one the step applies), and the diagnosis excuses
a non-finite loss on a step one of them skipped, as TensorFlow's record is
excused on a step its optimizer skipped.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from mpprof.backends.collector import Collector
from mpprof.backends.health_record import health_record
from mpprof.backends.layer_records import variable_path
from mpprof.backends.optimizer_usage import OptimizerUsage
from mpprof.backends.patching import Patches
from mpprof.records import schema


class LossWatch:
    """The non-finite losses of the steps, across fits."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.available = True
        self.nonfinite = 0
        self.first: int | None = None
        self._state = None

    def attach(self, step_state) -> None:
        self._state = step_state
        step_state.start_nonfinite = self.nonfinite
        step_state.start_first_nonfinite = -1 if self.first is None else self.first

    def watched(self) -> bool:
        """Whether the traced step handed its loss over (unknown until
        traced: assumed)."""
        return self._state is None or self._state.loss_watched is not False

    def read(self) -> dict:
        if self._state is not None and self._state.arrays is not None:
            self.nonfinite = self._state.nonfinite()
            self.first = self._state.first_nonfinite()
        return {
            "first_nonfinite_loss_step": self.first,
            "first_nonfinite_loss_step_last": self.first,
            "first_nonfinite_loss_count": None if self.first is None else 1,
            "nonfinite_loss_steps": self.nonfinite,
        }

    def last_loss(self) -> float:
        return self._state.last_loss() if self._state is not None else math.nan


class RunHealth(Collector):
    """The loss watch of the step, and the weight check
    (`mpprof.backends.protocol.RunHealth`).

    Args:
        keras_api: the fit's `JaxBackend` (its step state counts the
            non-finite losses inside the jitted step).
        usage: the model's `OptimizerUsage`.
        strategy: the backend's stand-in strategy (unused: one process).
        step_of: for an optimizer's name, its step inside the step (unused:
            the step state dates the first non-finite loss).
        reuse: watchers of an earlier fit, by optimizer id (they keep the
            first non-finite step across fits).
        instrumenting: returns whether the step being traced is the
            instrumented one.
    """

    name = "loss_health"

    def __init__(self, keras_api, usage: OptimizerUsage, strategy, step_of, reuse: dict,
                 instrumenting: Callable[[], bool]):
        self._usage = usage
        self.watchers = {}
        state = self._state = keras_api.step_state
        # The loss check is the step's, not an optimizer's: kept by the
        # first candidate, whose watcher the next fit reuses.
        for use in usage.uses[:1]:
            watcher = reuse.get(id(use.optimizer)) or keras_api.loss_watch(use.optimizer)
            watcher.attach(state)
            self.watchers[use.name] = watcher
        self.nonfinite_weights: list[str] = []

    def install(self, fit, patches: Patches) -> None:
        pass

    def flush(self, fit) -> None:
        fit.writer.write_json(schema.HEALTH, self.record(fit.step), fit.step)

    def end(self, fit) -> None:
        self.check_weights(fit.model)

    def _unfollowed_scales(self) -> list[str]:
        """The step's LossScaleOptimizers whose skips are not followed
        (`step_state.StepState.unfollowed`)."""
        unfollowed = self._state.unfollowed
        return [u.name for u in self._usage.used()
                if u.loss_scale and id(u.optimizer) in unfollowed]

    def _guards(self) -> list[str]:
        """The LossScaleOptimizers whose skipped steps catch the watched
        loss: every one the step applies (the loss checked is the sum of
        the step's losses, so a step any of them skipped had its
        non-finite loss caught)."""
        return [u.name for u in self._usage.used() if u.loss_scale]

    def context(self) -> dict:
        unfollowed = self._unfollowed_scales()
        if unfollowed:
            return {"state": "absent", "reason": (
                f"the step's LossScaleOptimizers {', '.join(unfollowed)} are not "
                "followed (see the loss_scale collector): a non-finite loss cannot be "
                "told from a step they skipped, so the loss is not judged")}
        if self.watched() is not None:
            return {"state": "ok", "loss_checked": "in the step (exact to the step)",
                    "loss_guarded_by": self._guards()}
        return {"state": "absent", "reason": (
            "the train step handed no loss to Keras' metrics update nor to a loss "
            "metric (a custom train_step whose metrics are not named 'loss' or "
            "'..._loss'): the loss is not watched on JAX")}

    def nonfinite_counters(self) -> list:
        return []

    def note_calls(self, first_step: int, last_step: int) -> None:
        """(The step dates its own first non-finite loss.)"""

    def watched(self):
        if self._unfollowed_scales():
            return None
        for watcher in self.watchers.values():
            if watcher.watched():
                return watcher
        return None

    def last_loss(self) -> float:
        watcher = self.watched()
        return watcher.last_loss() if watcher is not None else math.nan

    def check_weights(self, model) -> None:
        if any(getattr(w, "_value", 0) is None for w in model.weights):
            # Mid-epoch (a fit that raised inside a step) Keras keeps the
            # state outside the variables: the last check stands.
            return
        found = []
        for weight in model.weights:
            if "float" not in str(weight.dtype):  # float16/32/64, bfloat16, float8
                continue
            if not np.isfinite(np.asarray(weight.value, np.float32)).all():
                found.append(variable_path(weight))
        self.nonfinite_weights = found

    def record(self, step: int) -> dict:
        watcher = self.watched()
        loss = (None if watcher is None
                else {**watcher.read(), "loss_guarded_by": self._guards()})
        return health_record(loss, self.nonfinite_weights, step)

    def by_optimizer(self) -> dict[int, object]:
        return {id(w.optimizer): w for w in self.watchers.values()}
