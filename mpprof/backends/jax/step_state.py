"""mpprof's own state inside the JAX train step: counters and an event ring.

Keras' JAX `fit` runs `train_step(state, data)` jitted with the state
donated; the LossScaleOptimizer decides inside it (`stateless_apply`, an
`ops.cond`) whether a step is applied or skipped, and logs nothing. The
profiled step is Keras' own `train_step` traced in a function of mpprof's
(`StepState.step_function`) that also takes and returns a small state of
its own, two arrays donated like Keras' state:

- `ints` (int32): skipped steps, events written, steps with a non-finite
  loss, the first such step (-1: none), the optimizer's apply calls;
- `floats` (float32): row 0 the loss scale, its growth counter and the last
  loss; rows 1.. a ring of loss-scale events [step, scale before, scale
  after, kind].

Each step compares the optimizer variables it was given (`state[2]`) with
those it returns: a LossScaleOptimizer step that left the apply count alone
was skipped (an overflow, at step applied + skipped), one whose scale grew
is a growth. Every number is computed in the step and read by the host only
at flush points (one device-to-host copy for every collector), so the step
is dated exactly, also under `steps_per_execution > 1`, without a sync.
Integers are int32 and ring steps float32: exact up to 2**24 steps.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from mpprof.recording.collectors.optimizers import applied_steps
from mpprof.records import schema

# Positions in `ints`.
SKIPPED, EVENTS, NONFINITE, FIRST_NONFINITE, APPLIED = range(5)
# Positions in row 0 of `floats`.
SCALE, COUNTER, LAST_LOSS = range(3)
# The key of the call alarm in the step's logs (taken out before Keras sees them).
ALARM_KEY = "_mpprof_alarm"


def _index_of(variables: list, variable) -> int | None:
    return next((i for i, v in enumerate(variables) if v is variable), None)


class StepState:
    """The counters of one fit's steps, on the device, and their host copy.

    Args:
        model: the compiled model (its `optimizer` is the one whose
            variables the step passes in `state[2]`).
        capacity: events the ring holds between two reads.
        loss_scale: whether the optimizer is a LossScaleOptimizer.
    """

    def __init__(self, model, capacity: int, loss_scale: bool):
        self.capacity = int(capacity)
        self.loss_scale = loss_scale
        self._optimizer = model.optimizer
        variables = list(self._optimizer.variables)
        self._applied_index = _index_of(variables, applied_steps(self._optimizer))
        self._scale_index = self._counter_index = None
        if loss_scale:
            self._scale_index = _index_of(variables, self._optimizer.dynamic_scale)
            self._counter_index = _index_of(variables, self._optimizer.step_counter)
        # Where the counts start (the collectors of earlier fits set them).
        self.start_skipped = 0
        self.start_nonfinite = 0
        self.start_first_nonfinite = -1
        self.arrays: tuple | None = None
        self._host: tuple[np.ndarray, np.ndarray] | None = None
        # The unscaled loss of the step being traced (`capture_loss`), and
        # whether the traced step had one (None: not traced yet).
        self._loss = None
        self.loss_watched: bool | None = None

    def start(self) -> None:
        """The device state at the start of the fit (before the first step:
        the model's variables still hold the values)."""
        ints = np.zeros(5, np.int32)
        ints[SKIPPED] = self.start_skipped
        ints[NONFINITE] = self.start_nonfinite
        ints[FIRST_NONFINITE] = self.start_first_nonfinite
        ints[APPLIED] = int(np.asarray(applied_steps(self._optimizer).value))
        floats = np.zeros((self.capacity + 1, 4), np.float32)
        floats[0, SCALE] = self.variable_scale()
        if self.loss_scale:
            floats[0, COUNTER] = int(np.asarray(self._optimizer.step_counter.value))
        floats[0, LAST_LOSS] = np.nan
        self.arrays = (jnp.asarray(ints), jnp.asarray(floats))
        self._host = (ints, floats)

    def variable_scale(self) -> float:
        if not self.loss_scale:
            return 1.0
        return float(np.asarray(self._optimizer.dynamic_scale.value))

    def capture_loss(self, loss) -> None:
        """Called while the step is traced with its unscaled loss."""
        self._loss = loss

    def update(self, arrays: tuple) -> None:
        """The state a call returned (the one given to it is donated)."""
        self.arrays = arrays
        self._host = None

    def read(self) -> tuple[np.ndarray, np.ndarray]:
        """(ints, floats) on the host: one copy per call at most (it waits
        for the last call to finish)."""
        if self._host is None:
            self._host = tuple(np.asarray(a) for a in jax.device_get(self.arrays))
        return self._host

    def step_function(self, train_step: Callable) -> Callable:
        """`train_step(state, data)` as `step(state, mp_state, data) ->
        (logs, state, mp_state)`, with this state's updates traced in."""
        applied_index, scale_index = self._applied_index, self._scale_index
        counter_index, capacity = self._counter_index, self.capacity

        def step(state, mp_state, data):
            self._loss = None
            logs, new_state = train_step(state, data)
            ints, floats = mp_state
            before, after = state[2], new_state[2]
            applied_before = jnp.asarray(before[applied_index]).astype(jnp.int32)
            applied_after = jnp.asarray(after[applied_index]).astype(jnp.int32)
            this_step = applied_before + ints[SKIPPED]
            row0 = floats[0]
            if scale_index is not None:
                scale_before = jnp.asarray(before[scale_index], jnp.float32)
                scale_after = jnp.asarray(after[scale_index], jnp.float32)
                skipped = applied_after == applied_before
                grew = jnp.logical_and(jnp.logical_not(skipped), scale_after > scale_before)
                event = jnp.logical_or(skipped, grew)
                kind = jnp.where(skipped, schema.EVENT_OVERFLOW, schema.EVENT_GROWTH)
                row = jnp.stack([this_step.astype(jnp.float32), scale_before, scale_after,
                                 jnp.asarray(kind, jnp.float32)])
                slot = 1 + ints[EVENTS] % capacity
                floats = floats.at[slot].set(jnp.where(event, row, floats[slot]))
                ints = ints.at[EVENTS].add(event.astype(jnp.int32))
                ints = ints.at[SKIPPED].add(skipped.astype(jnp.int32))
                row0 = row0.at[SCALE].set(scale_after)
                row0 = row0.at[COUNTER].set(
                    jnp.asarray(after[counter_index]).astype(jnp.float32))
            loss, self._loss = self._loss, None
            self.loss_watched = loss is not None
            if loss is not None:
                loss = jnp.sum(jnp.asarray(loss, jnp.float32))
                nonfinite = jnp.logical_not(jnp.isfinite(loss))
                first = ints[FIRST_NONFINITE]
                ints = ints.at[FIRST_NONFINITE].set(
                    jnp.where(jnp.logical_and(first < 0, nonfinite), this_step, first))
                ints = ints.at[NONFINITE].add(nonfinite.astype(jnp.int32))
                row0 = row0.at[LAST_LOSS].set(loss)
            ints = ints.at[APPLIED].set(applied_after)
            floats = floats.at[0].set(row0)
            if isinstance(logs, dict):
                # The call alarm: what the host compares, one call late
                # (`mpprof.backends.jax.call_alarm`); not donated.
                logs = {**logs, ALARM_KEY: ints[SKIPPED] + ints[NONFINITE]}
            return logs, new_state, (ints, floats)

        return step

    # Host reads (after `read`).

    def skipped(self) -> int:
        return int(self.read()[0][SKIPPED])

    def applied(self) -> int:
        return int(self.read()[0][APPLIED])

    def steps_run(self) -> int:
        """Steps run so far: apply calls plus skipped steps."""
        ints = self.read()[0]
        return int(ints[APPLIED]) + int(ints[SKIPPED])

    def scale(self) -> float:
        return float(self.read()[1][0, SCALE])

    def counter(self) -> int:
        return int(self.read()[1][0, COUNTER])

    def last_loss(self) -> float:
        return float(self.read()[1][0, LAST_LOSS])

    def nonfinite(self) -> int:
        return int(self.read()[0][NONFINITE])

    def first_nonfinite(self) -> int | None:
        first = int(self.read()[0][FIRST_NONFINITE])
        return None if first < 0 else first

    def events(self) -> tuple[int, np.ndarray]:
        """(events written so far, the ring [capacity, 4])."""
        ints, floats = self.read()
        return int(ints[EVENTS]), floats[1:].astype(np.float64)
