"""Loss scale, overflow and growth events, exact to the step.

Keras 3's LossScaleOptimizer branches, inside the traced train step, to
`_stateful_handle_non_finite_grads` (overflow: skip, halve) or
`_stateful_handle_finite_grads` (apply; double after `dynamic_growth_steps`).
Wrapping both at instance level lets the graph itself append each overflow and
growth to a ring buffer of variables, so the host reads the buffer only every
`read_every` steps and no step pays for a device-to-host copy. A finite step
that does not grow the scale adds one comparison.

When those private methods are missing (another Keras), the collector falls
back to reading the scale and `iterations` on the host after every batch; it
is then exact only with `steps_per_execution=1`, and the run context says so.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from mpprof import schema
from mpprof.guard import TracedGuard
from mpprof.patching import Patches

_FINITE = "_stateful_handle_finite_grads"
_NON_FINITE = "_stateful_handle_non_finite_grads"

MODE_GRAPH = "graph_counters"
MODE_HOST = "host_polling"
MODE_ABSENT = "absent"


def is_loss_scale_optimizer(optimizer) -> bool:
    import keras

    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


class LossScaleCollector:
    """Records the loss scale of a Keras 3 `LossScaleOptimizer`.

    The step axis counts every train step, skipped ones included: it equals
    `optimizer.iterations` plus the skipped steps seen by this collector.

    Args:
        optimizer: the model's (built) LossScaleOptimizer.
        strategy: the model's distribution strategy (variables are created in
            its scope).
        capacity: events the ring buffer holds between two reads; must exceed
            the steps run between reads.
    """

    def __init__(self, optimizer, strategy, capacity: int):
        self.optimizer = optimizer
        self.capacity = int(capacity)
        hooks_present = all(callable(getattr(optimizer, n, None)) for n in (_FINITE, _NON_FINITE))
        self.mode = MODE_GRAPH if hooks_present else MODE_HOST
        with strategy.scope():
            self._events = tf.Variable(
                tf.zeros((self.capacity, 4), tf.float64), trainable=False,
                name="mpprof_loss_scale_events",
            )
            self._event_count = tf.Variable(0, dtype=tf.int64, trainable=False,
                                            name="mpprof_loss_scale_event_count")
            self._skipped = tf.Variable(0, dtype=tf.int64, trainable=False,
                                        name="mpprof_skipped_steps")
        self._events_read = 0
        self.dropped_events = 0
        # Runs this collector's own ops inside the traced step.
        self.traced = TracedGuard()
        self._last_polled: tuple[int, float] | None = None

    def settings(self) -> dict:
        opt = self.optimizer
        return {
            "mode": self.mode,
            "initial_scale": float(opt.initial_scale),
            "dynamic_growth_steps": int(opt.dynamic_growth_steps),
            "inner_optimizer": type(opt.inner_optimizer).__name__,
            "buffer_capacity": self.capacity,
            "dropped_events": self.dropped_events,
        }

    def install(self, patches: Patches) -> None:
        """Wraps the optimizer's two branches (undone by `patches.restore`)."""
        if self.mode != MODE_GRAPH:
            return
        opt = self.optimizer
        finite = getattr(opt, _FINITE)
        non_finite = getattr(opt, _NON_FINITE)

        def state_before():
            step = self.graph_step()
            scale_before = tf.cast(tf.convert_to_tensor(opt.dynamic_scale), tf.float64)
            return step, scale_before

        def record_growth():
            step, scale_before = state_before()
            self._append(step, scale_before, 2.0 * scale_before, schema.EVENT_GROWTH)
            return tf.no_op()

        def handle_finite_grads(grads, trainable_variables):
            # Decided before the optimizer's own update (which doubles the
            # scale and resets the counter on this step), and the step and
            # scale read only on a growth: a finite step that does not grow
            # the scale adds one read and one comparison.
            self.traced(lambda: tf.cond(
                tf.equal(tf.convert_to_tensor(opt.step_counter), opt.dynamic_growth_steps - 1),
                record_growth, tf.no_op,
            ))
            return finite(grads, trainable_variables)

        def record_overflow(step, scale_before):
            self._append(step, scale_before, 0.5 * scale_before, schema.EVENT_OVERFLOW)
            self._skipped.assign_add(1)

        def handle_non_finite_grads():
            before = self.traced(state_before)
            result = non_finite()
            if before is not None:
                self.traced(lambda: record_overflow(*before))
            return result

        patches.set(opt, _FINITE, handle_finite_grads)
        patches.set(opt, _NON_FINITE, handle_non_finite_grads)

    def graph_step(self) -> tf.Tensor:
        iterations = tf.cast(tf.convert_to_tensor(self.optimizer.iterations), tf.int64)
        return iterations + self._skipped

    def _append(self, step, scale_before, scale_after, kind) -> tf.Operation:
        row = tf.stack([tf.cast(step, tf.float64), scale_before, scale_after,
                        tf.constant(kind, tf.float64)])
        slot = tf.math.floormod(self._event_count, self.capacity)
        self._events.assign(
            tf.tensor_scatter_nd_update(self._events, [[slot]], [row])
        )
        self._event_count.assign_add(1)
        return tf.no_op()

    @property
    def skipped_counter(self) -> tf.Variable:
        """The in-graph count of skipped steps."""
        return self._skipped

    def skipped_steps(self) -> int:
        """Skipped (overflowed) steps counted so far (a host read)."""
        return int(self._skipped.numpy())

    def current_step(self) -> int:
        """Steps run so far (a host read)."""
        return int(self.optimizer.iterations.numpy()) + self.skipped_steps()

    def read(self) -> tuple[np.ndarray, np.ndarray]:
        """New events since the last read, and the progress row now.

        Returns (events [n, 4], progress [3]); see `schema`.
        """
        if self.mode == MODE_HOST:
            self._poll()
        count = int(self._event_count.numpy())
        new = count - self._events_read
        if new > self.capacity:
            self.dropped_events += new - self.capacity
            new = self.capacity
        buffer = self._events.numpy()
        slots = np.arange(count - new, count) % self.capacity
        self._events_read = count
        progress = np.array([
            self.current_step(),
            self._scale(),
            self.skipped_steps(),
        ], dtype=np.float64)
        return buffer[slots], progress

    def scale_tensor(self) -> tf.Tensor:
        """The current scale inside the graph; the initial one until the
        optimizer has built its variables (a custom step builds it late)."""
        if not self.optimizer.built:
            return tf.constant(float(self.optimizer.initial_scale))
        return tf.convert_to_tensor(self.optimizer.dynamic_scale)

    def _scale(self) -> float:
        # The optimizer builds its variables on the first step's trace.
        if not self.optimizer.built:
            return float(self.optimizer.initial_scale)
        return float(self.optimizer.dynamic_scale.numpy())

    def poll_if_host_mode(self) -> None:
        if self.mode == MODE_HOST:
            self._poll()

    def _poll(self) -> None:
        """Host fallback: infers events from the scale and iterations."""
        iterations = int(self.optimizer.iterations.numpy())
        scale = self._scale()
        if self._last_polled is not None:
            last_iterations, last_scale = self._last_polled
            step = last_iterations + int(self._skipped.numpy())
            if scale < last_scale:
                self._host_append(step, last_scale, scale, schema.EVENT_OVERFLOW)
                self._skipped.assign_add(1)
            elif scale > last_scale:
                self._host_append(step, last_scale, scale, schema.EVENT_GROWTH)
        self._last_polled = (iterations, scale)

    def _host_append(self, step, before, after, kind) -> None:
        slot = int(self._event_count.numpy()) % self.capacity
        self._events[slot].assign([step, before, after, kind])
        self._event_count.assign_add(1)
