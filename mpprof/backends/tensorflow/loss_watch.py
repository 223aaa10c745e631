"""The loss of every train step, checked inside the traced step.

Keras 3's train step hands the loss to `optimizer.scale_loss` on every step
(whatever the optimizer). Wrapping it at instance level counts, in a
variable, the steps whose loss was non-finite: four ops per step, no read of
the step number and no branch. The train step reports that count, with the
skipped steps, in its logs (`mpprof.backends.tensorflow.call_alarm`), so the host learns which
call first had a non-finite loss without a read of its own: the step itself
when each call runs one step (Keras' default), else the call's steps. (Keras'
own batch logs hold a running mean that stays NaN once it was: it counts
nothing, and a custom step logs what it likes.) The loss itself is kept only
by the instrumented step, for its sample.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from mpprof.backends.patching import Patches
from mpprof.backends.traced_guard import TracedGuard


class LossWatch:
    """Watches the loss through `optimizer.scale_loss`.

    Args:
        optimizer: the model's Keras 3 optimizer.
        strategy: the model's distribution strategy (variables live in its
            scope; under several replicas, the first replica's loss is kept).
        step: returns the current train step as a tensor, inside the graph
            (used where the step number is tracked in-graph: tf-keras).

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
        # The steps of the first call whose loss was non-finite, (first,
        # last), and how many of them were; set on the host by `note_calls`
        # (kept across fits).
        self._first_calls: tuple[int, int] | None = None
        self._first_count: int | None = None
        self._counted = 0
        with strategy.scope():
            self._last_loss = tf.Variable(0.0, trainable=False, name="mpprof_last_loss")
            self._nonfinite_steps = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="mpprof_nonfinite_loss_steps"
            )

    def install(self, patches: Patches) -> None:
        """Wraps `optimizer.scale_loss` (undone by `patches.restore`)."""
        if not self.available:
            return
        self._counted = self.nonfinite_steps()
        scale_loss = self.optimizer.scale_loss

        def watched_scale_loss(loss):
            self.traced(lambda: self._watch(loss))
            return scale_loss(loss)

        patches.set(self.optimizer, "scale_loss", watched_scale_loss)

    @property
    def nonfinite_counter(self) -> tf.Variable:
        """The in-graph count of steps whose loss was non-finite."""
        return self._nonfinite_steps

    def _watch(self, loss: tf.Tensor) -> tf.Tensor:
        """Runs on every step: the fewest ops, no tf.cond (a cond costs more
        per step than the writes it would save, and under XLA on a GPU it
        waits for its predicate on the host), and no read of a variable the
        step writes (each orders the step's ops around it). Returns whether
        the loss was non-finite."""
        loss = tf.convert_to_tensor(loss)
        if loss.shape.rank != 0:
            loss = tf.reduce_sum(loss)
        loss = tf.cast(loss, tf.float32)  # no op when it is float32 already
        nonfinite = tf.logical_not(tf.math.is_finite(loss))
        self._nonfinite_steps.assign_add(tf.cast(nonfinite, tf.int64))
        if self.instrumenting():
            self._last_loss.assign(loss)
        return nonfinite

    def note_calls(self, first_step: int, last_step: int) -> None:
        """After calls that may have had a non-finite loss (the train step's
        alarm rose), steps `first_step` to `last_step`: a host read, which
        dates the first non-finite loss when it is among them (none once
        it is dated)."""
        if self._first_calls is not None:
            return
        counted = self.nonfinite_steps()
        if counted > self._counted:
            self._first_calls = (first_step, last_step)
            self._first_count = counted - self._counted
        self._counted = counted

    def nonfinite_steps(self) -> int:
        """Steps whose loss was non-finite so far (a host read)."""
        return int(self._nonfinite_steps.numpy())

    def last_loss(self) -> float:
        """The loss of the last instrumented step."""
        return float(self._last_loss.numpy())

    def read(self) -> dict:
        """{"first_nonfinite_loss_step": int | None, "first_nonfinite_loss_step_last":
        int | None, "first_nonfinite_loss_count": int | None,
        "nonfinite_loss_steps": int}: the first non-finite loss came at a step
        from the first to the last (equal: exact), and that many of those
        steps had one."""
        first, last = self._first_calls or (None, None)
        return {
            "first_nonfinite_loss_step": first,
            "first_nonfinite_loss_step_last": last,
            "first_nonfinite_loss_count": self._first_count,
            "nonfinite_loss_steps": self.nonfinite_steps(),
        }
