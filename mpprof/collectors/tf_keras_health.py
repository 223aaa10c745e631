"""The loss of every tf-keras train step, checked inside the traced step.

tf-keras optimizers have no `scale_loss`; tf-keras's train step hands the loss
to `optimizer.minimize(loss, variables, tape=tape)` instead, for every
optimizer (the LossScaleOptimizer, the new and the legacy ones), and only in
training: `evaluate` never calls it, so validation losses are not counted.
tf-keras's train step has no alarm in its logs, so the first non-finite
step is kept in-graph, exact to the step.
"""

from __future__ import annotations

import tensorflow as tf

from mpprof.collectors.health import LossHealthCollector
from mpprof.patching import Patches

# The first non-finite step until there is one: a minimum needs no branch.
_NEVER = tf.int64.max


class TfKerasLossHealthCollector(LossHealthCollector):
    """`LossHealthCollector` watching tf-keras's `optimizer.minimize`."""

    def __init__(self, optimizer, strategy, step):
        super().__init__(optimizer, strategy, step)
        self.available = callable(getattr(optimizer, "minimize", None))
        with strategy.scope():
            self._first_nonfinite = tf.Variable(
                _NEVER, dtype=tf.int64, trainable=False, name="mpprof_first_nonfinite_loss_step"
            )

    def install(self, patches: Patches) -> None:
        if not self.available:
            return
        minimize = self.optimizer.minimize

        def watched_minimize(loss, var_list, *args, **kwargs):
            if not callable(loss):  # a loss callable is traced by minimize itself
                self.traced(lambda: self._watch(loss))
            return minimize(loss, var_list, *args, **kwargs)

        patches.set(self.optimizer, "minimize", watched_minimize)

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
