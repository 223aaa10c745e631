"""The loss of every train step, checked inside the traced step.

Keras 3's train step hands the loss to `optimizer.scale_loss` on every step
(whatever the optimizer). Wrapping it at instance level records, in
variables, the last loss, the first step whose loss was non-finite and how
many were: exact to the step, and without a host read per step (Keras' own
batch logs hold a running mean that stays NaN once it was, and reading them
every batch would stall the pipeline).
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from mpprof.guard import TracedGuard
from mpprof.patching import Patches


class LossHealthCollector:
    """Watches the loss through `optimizer.scale_loss`.

    Args:
        optimizer: the model's Keras 3 optimizer.
        strategy: the model's distribution strategy (variables live in its
            scope; under several replicas, the first replica's loss is kept).
        step: returns the current train step as a tensor, inside the graph.
    """

    def __init__(self, optimizer, strategy, step: Callable[[], tf.Tensor]):
        self.optimizer = optimizer
        self.available = callable(getattr(optimizer, "scale_loss", None))
        # Runs this collector's own ops inside the traced step.
        self.traced = TracedGuard()
        self._step = step
        with strategy.scope():
            self._last_loss = tf.Variable(0.0, trainable=False, name="mpprof_last_loss")
            self._first_nonfinite = tf.Variable(
                -1, dtype=tf.int64, trainable=False, name="mpprof_first_nonfinite_loss_step"
            )
            self._nonfinite_steps = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="mpprof_nonfinite_loss_steps"
            )

    def install(self, patches: Patches) -> None:
        """Wraps `optimizer.scale_loss` (undone by `patches.restore`)."""
        if not self.available:
            return
        scale_loss = self.optimizer.scale_loss

        def watched_scale_loss(loss):
            self.traced(lambda: self._watch(tf.cast(tf.reduce_sum(loss), tf.float32)))
            return scale_loss(loss)

        patches.set(self.optimizer, "scale_loss", watched_scale_loss)

    def _watch(self, loss: tf.Tensor) -> None:
        # Element-wise updates instead of a tf.cond: a cond costs more per
        # step than the two small writes it would save.
        nonfinite = tf.logical_not(tf.math.is_finite(loss))
        first = self._first_nonfinite
        step = tf.cast(self._step(), tf.int64)
        self._last_loss.assign(loss)
        first.assign(tf.where(tf.logical_and(nonfinite, first < 0), step, first))
        self._nonfinite_steps.assign_add(tf.cast(nonfinite, tf.int64))

    def last_loss(self) -> float:
        return float(self._last_loss.numpy())

    def read(self) -> dict:
        """{"first_nonfinite_loss_step": int | None, "nonfinite_loss_steps": int}."""
        first = int(self._first_nonfinite.numpy())
        return {
            "first_nonfinite_loss_step": first if first >= 0 else None,
            "nonfinite_loss_steps": int(self._nonfinite_steps.numpy()),
        }
