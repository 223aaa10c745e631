"""Loss scale, overflow and growth events, exact to the step.

Keras 3's LossScaleOptimizer branches, inside the traced train step, to
`_stateful_handle_non_finite_grads` (overflow: skip, halve) or
`_stateful_handle_finite_grads` (apply; double after `dynamic_growth_steps`).
Wrapping the first at instance level lets the graph itself append each
overflow (its step and the scale it found) to a ring buffer of variables, so
the host reads the buffer only at flush points and no step pays for a
device-to-host copy. Finite steps run nothing of mpprof's: the growths
between two reads follow from the overflows and the optimizer's state
(`loss_scale_growth`), checked at every read.

When that private method is missing (another Keras), the collector falls
back to reading the scale and the apply calls on the host after every batch; it
is then exact only with `steps_per_execution=1`, and the run context says so.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from mpprof.backends.loss_scale_growth import ScaleState, growth_events
from mpprof.backends.loss_scale_records import keras_3_settings
from mpprof.backends.optimizer_usage import applied_steps
from mpprof.backends.patching import Patches
from mpprof.backends.step_origin import KERAS_3_UNKNOWN_ORIGIN, Origin
from mpprof.backends.traced_guard import TracedGuard
from mpprof.records import schema

_FINITE = "_stateful_handle_finite_grads"
_NON_FINITE = "_stateful_handle_non_finite_grads"

# Windows named in the run context when growths could not be derived.
_MAX_WINDOWS_NAMED = 20

MODE_GRAPH = "graph_counters"
MODE_HOST = "host_polling"
MODE_ABSENT = "absent"


class LossScaleSeries:
    """Records the loss scale of a Keras 3 `LossScaleOptimizer`.

    The step axis counts every train step, skipped ones included: it equals
    the optimizer's apply calls (`optimizers.applied_steps`) plus the
    skipped steps seen by this collector, which starts from those skipped
    before its first fit when they are known (`start_from`).

    Args:
        optimizer: the model's (built) LossScaleOptimizer.
        strategy: the model's distribution strategy (variables are created in
            its scope).
        capacity: events the ring buffer holds between two reads; must exceed
            the steps run between reads.
    """

    # Finite steps record nothing in the graph: the growths are derived at
    # each read (`loss_scale_growth`).
    derives_growth = True
    # What an unknown count of skipped steps before the first fit means.
    unknown_origin_means = KERAS_3_UNKNOWN_ORIGIN

    def __init__(self, optimizer, strategy, capacity: int):
        self.optimizer = optimizer
        self.capacity = int(capacity)
        # Only the overflow branch is wrapped; the growth derivation relies on
        # the finite one being Keras 3's: without either, another Keras.
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
        # Where the optimizer stood at the last read, and the steps between
        # which growth events could not be derived.
        self._last_read: ScaleState | None = None
        self.unverified_growth: list[tuple[int, int]] = []
        # Runs this collector's own ops inside the traced step.
        self.traced = TracedGuard()
        self._last_polled: tuple[int, float] | None = None
        # Where the count of skipped steps started (`start_from`).
        self.origin: Origin | None = None

    def nothing_ran(self) -> bool:
        """Whether no train step ran this optimizer yet: a skipped step leaves
        the apply calls alone but halves the scale, and only applied steps
        grow it back."""
        return not self.optimizer.built or (
            int(applied_steps(self.optimizer).numpy()) == 0
            and self.scale() == float(self.optimizer.initial_scale))

    def start_from(self, origin: Origin) -> None:
        """Starts counting skipped steps from `origin.skipped` (before the
        first fit; unknown counts from 0)."""
        self.origin = origin
        self._skipped.assign(origin.skipped or 0)

    def settings(self) -> dict:
        opt = self.optimizer
        settings = {
            "mode": self.mode,
            **keras_3_settings(opt),
            "buffer_capacity": self.capacity,
            "dropped_events": self.dropped_events,
        }
        if self.mode == MODE_GRAPH:
            settings["growth_events"] = "derived from the overflows, checked at every read"
            if self.unverified_growth:
                settings["growth_events_missing_between_steps"] = [
                    list(window) for window in self.unverified_growth[:_MAX_WINDOWS_NAMED]
                ]
        return settings

    def install(self, patches: Patches) -> None:
        """Wraps the optimizer's overflow branch (undone by `patches.restore`)."""
        if self.mode != MODE_GRAPH:
            return
        opt = self.optimizer
        non_finite = getattr(opt, _NON_FINITE)

        def record_overflow():
            # Read before the optimizer halves the scale: automatic control
            # dependencies keep program order per variable.
            scale_before = tf.cast(tf.convert_to_tensor(opt.dynamic_scale), tf.float64)
            self._append(self.graph_step(), scale_before, 0.5 * scale_before,
                         schema.EVENT_OVERFLOW)
            self._skipped.assign_add(1)

        def handle_non_finite_grads():
            self.traced(record_overflow)
            return non_finite()

        patches.set(opt, _NON_FINITE, handle_non_finite_grads)

    def graph_step(self) -> tf.Tensor:
        applied = tf.cast(tf.convert_to_tensor(applied_steps(self.optimizer)), tf.int64)
        return applied + self._skipped

    def _append(self, step, scale_before, scale_after, kind) -> tf.Operation:
        row = tf.stack([tf.cast(step, tf.float64), scale_before, scale_after,
                        tf.constant(kind, tf.float64)])
        slot = tf.math.floormod(self._event_count, self.capacity)
        # (A MirroredVariable has no scatter_nd_update.)
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
        return self.steps_given_skipped(self.skipped_steps())

    def steps_given_skipped(self, skipped: int) -> int:
        """Steps run so far if `skipped` of them were skipped (a host read)."""
        return int(applied_steps(self.optimizer).numpy()) + skipped

    def read(self) -> tuple[np.ndarray, np.ndarray]:
        """New events since the last read, and the progress row now.

        Returns (events [n, 4], progress [3]); see `schema`.
        """
        if self.mode == MODE_HOST:
            self._poll()
        count = int(self._event_count.numpy())
        new = count - self._events_read
        lost = max(0, new - self.capacity)
        self.dropped_events += lost
        new -= lost
        buffer = self._events.numpy()
        slots = np.arange(count - new, count) % self.capacity
        self._events_read = count
        events = buffer[slots]
        progress = np.array([
            self.current_step(),
            self.scale(),
            self.skipped_steps(),
        ], dtype=np.float64)
        if self.mode == MODE_GRAPH and self.derives_growth:
            events = self._with_growths(events, complete=not lost)
        return events, progress

    def _with_growths(self, overflows: np.ndarray, complete: bool) -> np.ndarray:
        """The overflows read, with the growths derived since the last read
        (none when `complete` is False: some overflows were overwritten)."""
        column = schema.LOSS_SCALE_EVENT_COLUMN
        now = ScaleState(self.current_step(), self._counter(), self.scale())
        start, self._last_read = self._last_read, now
        if start is None:
            return overflows  # the first read: where the derivation starts
        events, consistent = growth_events(
            start, overflows[:, [column.step, column.scale_before]], now,
            int(self.optimizer.dynamic_growth_steps),
        )
        if consistent and complete:
            return events
        self.unverified_growth.append((start.step, now.step))
        return overflows

    def scale_tensor(self) -> tf.Tensor:
        """The current scale inside the graph; the initial one until the
        optimizer has built its variables (a custom step builds it late)."""
        if not self.optimizer.built:
            return tf.constant(float(self.optimizer.initial_scale))
        return tf.convert_to_tensor(self.optimizer.dynamic_scale)

    def scale(self) -> float:
        # The optimizer builds its variables on the first step's trace.
        if not self.optimizer.built:
            return float(self.optimizer.initial_scale)
        return float(self.optimizer.dynamic_scale.numpy())

    def _counter(self) -> int:
        if not self.optimizer.built:
            return 0
        return int(self.optimizer.step_counter.numpy())

    def poll_if_host_mode(self) -> None:
        if self.mode == MODE_HOST:
            self._poll()

    def _poll(self) -> None:
        """Host fallback: infers events from the scale and the apply calls."""
        applied = int(applied_steps(self.optimizer).numpy())
        scale = self.scale()
        if self._last_polled is not None:
            last_applied, last_scale = self._last_polled
            step = last_applied + int(self._skipped.numpy())
            if scale < last_scale:
                self._host_append(step, last_scale, scale, schema.EVENT_OVERFLOW)
                self._skipped.assign_add(1)
            elif scale > last_scale:
                self._host_append(step, last_scale, scale, schema.EVENT_GROWTH)
        self._last_polled = (applied, scale)

    def _host_append(self, step, before, after, kind) -> None:
        slot = int(self._event_count.numpy()) % self.capacity
        self._events[slot].assign([step, before, after, kind])
        self._event_count.assign_add(1)
