"""The loss of every train step, checked inside the traced step.

Keras 3's train step hands the loss to `optimizer.scale_loss` on every step
(whatever the optimizer). Wrapping it at instance level records, in
variables, the first step whose loss was non-finite and how many were: exact
to the step, and without a host read per step (Keras' own batch logs hold a
running mean that stays NaN once it was, and reading them every batch would
stall the pipeline). The loss itself is kept only by the instrumented step,
for its sample.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from mpprof.guard import TracedGuard
from mpprof.patching import Patches

# The first non-finite step until there is one: a minimum needs no branch.
_NEVER = tf.int64.max


class LossHealthCollector:
    """Watches the loss through `optimizer.scale_loss`.

    Args:
        optimizer: the model's Keras 3 optimizer.
        strategy: the model's distribution strategy (variables live in its
            scope; under several replicas, the first replica's loss is kept).
        step: returns the current train step as a tensor, inside the graph.

    Attributes:
        instrumenting: returns whether the step being traced is the
            instrumented one (which keeps its loss); set before `install`.
    """

    def __init__(self, optimizer, strategy, step: Callable[[], tf.Tensor]):
        self.optimizer = optimizer
        self.available = callable(getattr(optimizer, "scale_loss", None))
        # Runs this collector's own ops inside the traced step.
        self.traced = TracedGuard()
        self._step = step
        self.instrumenting: Callable[[], bool] = lambda: False
        with strategy.scope():
            self._last_loss = tf.Variable(0.0, trainable=False, name="mpprof_last_loss")
            self._first_nonfinite = tf.Variable(
                _NEVER, dtype=tf.int64, trainable=False, name="mpprof_first_nonfinite_loss_step"
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
            self.traced(lambda: self._watch(loss))
            return scale_loss(loss)

        patches.set(self.optimizer, "scale_loss", watched_scale_loss)

    def _watch(self, loss: tf.Tensor) -> None:
        """Runs on every step: the fewest ops, and no tf.cond (a cond costs
        more per step than the small writes it would save, and under XLA on
        a GPU it waits for its predicate on the host)."""
        loss = tf.convert_to_tensor(loss)
        if loss.shape.rank != 0:
            loss = tf.reduce_sum(loss)
        loss = tf.cast(loss, tf.float32)  # no op when it is float32 already
        nonfinite = tf.logical_not(tf.math.is_finite(loss))
        step = tf.cast(self._step(), tf.int64)
        first = self._first_nonfinite
        first.assign(tf.minimum(first, tf.where(nonfinite, step, _NEVER)))
        self._nonfinite_steps.assign_add(tf.cast(nonfinite, tf.int64))
        if self.instrumenting():
            self._last_loss.assign(loss)

    def last_loss(self) -> float:
        """The loss of the last instrumented step."""
        return float(self._last_loss.numpy())

    def read(self) -> dict:
        """{"first_nonfinite_loss_step": int | None, "nonfinite_loss_steps": int}."""
        first = int(self._first_nonfinite.numpy())
        return {
            "first_nonfinite_loss_step": first if first != _NEVER else None,
            "nonfinite_loss_steps": int(self._nonfinite_steps.numpy()),
        }
