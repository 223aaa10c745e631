"""Loss scale, overflow and growth events of tf-keras's LossScaleOptimizer.

tf-keras (Keras 2) keeps the dynamic loss scale in a `_DynamicLossScaleState`
(`optimizer._loss_scale`): `current_loss_scale` and `counter` variables and an
`update(grads)` method that the optimizer calls inside the traced step with
the gradients AFTER they were all-reduced across replicas, and that returns
whether they were all finite. That finiteness decides the skip, so wrapping
`update` at instance level records exactly the steps the optimizer skipped,
also under MirroredStrategy and MultiWorkerMirroredStrategy.

Two differences from Keras 3 shape the records:

- `iterations` advances on a skipped step too, so the step axis is
  `iterations` itself (not iterations plus skipped steps);
- the scale has a floor of 1: an overflow at scale 1 leaves it at 1, so a
  skip is known from `update`'s verdict (or, on the host, from the counter
  resetting without growth), never from the scale alone.

When `_loss_scale.update` is missing (another tf-keras), the collector polls
`loss_scale` and `dynamic_counter` on the host after every batch: exact only
with `steps_per_execution=1`, and the run context says so.
"""

from __future__ import annotations

import tensorflow as tf

from mpprof.backends.patching import Patches
from mpprof.backends.tensorflow.loss_scale_series import MODE_GRAPH, MODE_HOST, LossScaleSeries
from mpprof.records import schema

# The private method of tf-keras's `_DynamicLossScaleState` that is wrapped.
_UPDATE = "update"

SKIP_DECIDED_BY = (
    "tf-keras _DynamicLossScaleState.update: finiteness of the gradients after "
    "the all-reduce across replicas"
)


class TfKerasLossScaleSeries(LossScaleSeries):
    """Records the loss scale of a tf-keras `LossScaleOptimizer`.

    Same records and reading interface as `LossScaleSeries`.

    Args:
        optimizer: the model's tf-keras LossScaleOptimizer (V2 or V3).
        strategy: the model's distribution strategy (variables are created in
            its scope).
        capacity: events the ring buffer holds between two reads.
    """

    # `update` records growths in the step (tf-keras's scale has a floor,
    # and its counter another rule).
    derives_growth = False
    unknown_origin_means = (
        "the step axis is exact (iterations counts skipped steps); the skipped "
        "steps recorded leave out those before this profiler's first fit"
    )

    def __init__(self, optimizer, strategy, capacity: int):
        super().__init__(optimizer, strategy, capacity)
        self.mode = MODE_GRAPH if callable(getattr(self._state, _UPDATE, None)) else MODE_HOST
        self._last_counter: int | None = None

    @property
    def _state(self):
        """The `_DynamicLossScaleState`, or None for a fixed loss scale."""
        return getattr(self.optimizer, "_loss_scale", None) if self.optimizer.dynamic else None

    def settings(self) -> dict:
        opt = self.optimizer
        growth_steps = opt.dynamic_growth_steps
        return {
            "mode": self.mode if opt.dynamic else "fixed_scale",
            "dynamic": bool(opt.dynamic),
            "initial_scale": float(opt.initial_scale),
            "dynamic_growth_steps": None if growth_steps is None else int(growth_steps),
            "scale_floor": 1.0,
            "inner_optimizer": type(opt.inner_optimizer).__name__,
            "skip_decided_by": SKIP_DECIDED_BY,
            "buffer_capacity": self.capacity,
            "dropped_events": self.dropped_events,
        }

    def install(self, patches: Patches) -> None:
        if self.mode != MODE_GRAPH or self._state is None:
            return
        state = self._state
        update = getattr(state, _UPDATE)

        def state_before():
            return (self.graph_step(),
                    tf.cast(tf.convert_to_tensor(state.current_loss_scale), tf.float64))

        def recording_update(grads):
            # Reads before `update` see the values the step started with:
            # automatic control dependencies keep program order per variable.
            before = self.traced(state_before)
            update_op, is_finite = update(grads)
            if before is None:
                return update_op, is_finite
            recorded = self.traced(lambda: record(update_op, is_finite, *before))
            if update_op is None or recorded is None:  # eager: everything already ran
                return update_op, is_finite
            return tf.group(update_op, recorded), is_finite

        def record(update_op, is_finite, step, scale_before):
            with tf.control_dependencies([update_op] if update_op is not None else []):
                scale_after = tf.cast(tf.convert_to_tensor(state.current_loss_scale), tf.float64)

            def on_finite():
                return tf.cond(
                    scale_after > scale_before,
                    lambda: self._append(step, scale_before, scale_after, schema.EVENT_GROWTH),
                    tf.no_op,
                )

            def on_overflow():
                self._append(step, scale_before, scale_after, schema.EVENT_OVERFLOW)
                self._skipped.assign_add(1)
                return tf.no_op()

            return tf.cond(tf.cast(is_finite, tf.bool), on_finite, on_overflow)

        patches.set(state, _UPDATE, recording_update)

    def graph_step(self) -> tf.Tensor:
        # tf-keras advances `iterations` on skipped steps as well.
        return tf.cast(tf.convert_to_tensor(self.optimizer.iterations), tf.int64)

    def current_step(self) -> int:
        return int(self.optimizer.iterations.numpy())

    def steps_given_skipped(self, skipped: int) -> int:
        return self.current_step()

    def nothing_ran(self) -> bool:
        return self.current_step() == 0

    def scale_tensor(self) -> tf.Tensor:
        return tf.convert_to_tensor(self.optimizer.loss_scale)

    def scale(self) -> float:
        return float(self.optimizer.loss_scale.numpy())

    def _poll(self) -> None:
        """Host fallback: an overflow resets the counter without growing the scale."""
        if self._state is None:
            return
        iterations = int(self.optimizer.iterations.numpy())
        scale = self.scale()
        counter = int(self.optimizer.dynamic_counter.numpy())
        if self._last_polled is not None:
            last_iterations, last_scale = self._last_polled
            if scale > last_scale:
                self._host_append(last_iterations, last_scale, scale, schema.EVENT_GROWTH)
            elif iterations > last_iterations and (
                scale < last_scale or counter <= self._last_counter
            ):
                self._host_append(last_iterations, last_scale, scale, schema.EVENT_OVERFLOW)
                self._skipped.assign_add(1)
        self._last_polled = (iterations, scale)
        self._last_counter = counter
