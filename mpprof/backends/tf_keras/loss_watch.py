"""The loss of every tf-keras train step, checked inside the traced step.

tf-keras optimizers have no `scale_loss`. tf-keras's train step hands the loss
to `optimizer.minimize(loss, variables, tape=tape)` instead, for every
optimizer (the LossScaleOptimizer, the new and the legacy ones), and only in
training: `evaluate` never calls it, so validation losses are not counted. A
custom step that takes its own gradients hands the loss to a
LossScaleOptimizer's `get_scaled_loss`, which `minimize` calls too: the loss
is watched in whichever the step called first, once per call of it. A step
that passes its loss through neither is "not watched" (`OptimizerUsage`
sees that, and `RunHealth` reports no value). tf-keras's train step has no
alarm in its logs, so the first non-finite step is kept in-graph, exact to
the step.
"""

from __future__ import annotations

import threading

import tensorflow as tf

from mpprof.backends.patching import Patches
from mpprof.backends.tensorflow.loss_watch import LossWatch

# The first non-finite step until there is one: a minimum needs no branch.
_NEVER = tf.int64.max


class TfKerasLossWatch(LossWatch):
    """`LossWatch` watching tf-keras's `optimizer.minimize` and,
    for a LossScaleOptimizer, `get_scaled_loss`."""

    def __init__(self, optimizer, strategy, step):
        super().__init__(optimizer, strategy, step)
        self.available = callable(getattr(optimizer, "minimize", None))
        # Calls of the watched methods under way in this thread (a
        # MirroredStrategy traces each replica's step in its own): a loss
        # `minimize` watched is not watched again where it calls
        # `get_scaled_loss`.
        self._calls = threading.local()
        with strategy.scope():
            self._first_nonfinite = tf.Variable(
                _NEVER, dtype=tf.int64, trainable=False, name="mpprof_first_nonfinite_loss_step"
            )

    def install(self, patches: Patches) -> None:
        if not self.available:
            return
        for method in ("minimize", "get_scaled_loss"):
            original = getattr(self.optimizer, method, None)
            if callable(original):
                patches.set(self.optimizer, method, self._watching(original))

    def _watching(self, method):
        """`method` (its loss first), watching the loss unless a watched
        method is already under way."""

        def watched(loss, *args, **kwargs):
            depth = getattr(self._calls, "depth", 0)
            if depth == 0:
                loss = self._watched_loss(loss)
            self._calls.depth = depth + 1
            try:
                return method(loss, *args, **kwargs)
            finally:
                self._calls.depth = depth

        return watched

    def _watched_loss(self, loss):
        """`loss`, watched: a tensor now, a callable (which both methods
        accept) when the method calls it."""
        if not callable(loss):
            self.traced(lambda: self._watch(loss))
            return loss

        def watched_loss():
            value = loss()
            self.traced(lambda: self._watch(value))
            return value

        return watched_loss

    def _watch(self, loss: tf.Tensor) -> tf.Tensor:
        nonfinite = super()._watch(loss)
        step = tf.cast(self._step(), tf.int64)
        first = self._first_nonfinite
        first.assign(tf.minimum(first, tf.where(nonfinite, step, _NEVER)))
        return nonfinite

    def note_calls(self, first_step: int, last_step: int) -> None:
        """Nothing to date: the step keeps its first non-finite step."""

    def read(self) -> dict:
        first = int(self._first_nonfinite.numpy())
        first = first if first != _NEVER else None
        return {**super().read(), "first_nonfinite_loss_step": first,
                "first_nonfinite_loss_step_last": first,
                "first_nonfinite_loss_count": None if first is None else 1}
