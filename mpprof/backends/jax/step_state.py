"""mpprof's own state inside the JAX train step: counters and an event ring.

Keras' JAX `fit` runs `train_step(state, data)` jitted with the state
donated; the LossScaleOptimizer decides inside it (`stateless_apply`, an
`ops.cond`) whether a step is applied or skipped, and logs nothing. The
profiled step is Keras' own `train_step` traced in a function of mpprof's
(`StepState.step_function`) that also takes and returns a small state of
its own, one array donated like Keras' state:
skipped steps, events written, steps with a non-finite loss, the first such
step (-1: none); the loss scale, its growth counter, the last loss and the
optimizer's apply calls; and a ring of loss-scale events [step, scale
before, scale after, kind] (one float32 table, below).

Each step compares the optimizer variables it was given (`state[2]`) with
those it returns: a LossScaleOptimizer step that left the apply count alone
was skipped (an overflow, at step applied + skipped), one whose scale grew
is a growth. Every number is computed in the step and read by the host only
at flush points (one device-to-host copy for every collector), so the step
is dated exactly, also under `steps_per_execution > 1`, without a sync.
Counts are float32: exact up to 2**24 steps.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from mpprof.recording.optimizer_usage import applied_steps
from mpprof.records import schema

# mpprof's state is ONE float32 array [capacity + 3, 4] (each array a jitted
# function takes and returns costs dispatch time; each op an XLA:CPU thunk):
# row 0 takes the writes of steps without an event, rows 1-2 the counters,
# rows 3.. the ring. Counts are exact in float32 up to 2**24.
SCRATCH_ROW, COUNT_ROW, SCALE_ROW, RING_START = 0, 1, 2, 3
# Columns of COUNT_ROW and SCALE_ROW.
SKIPPED, EVENTS, NONFINITE, FIRST_NONFINITE = range(4)
SCALE, COUNTER, LAST_LOSS, APPLIED = range(4)
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
        # The device table the last call returned (the one given to it is
        # donated; a call may set it directly), and the host copy of one.
        self.arrays: tuple | None = None
        self._host: np.ndarray | None = None
        self._host_of = None  # the `arrays` `_host` copies
        # Keras' state [trainable, non-trainable, optimizer, metrics
        # variables] the last call returned beside `arrays` (None before the
        # first call): what flushes read the model's variables from during
        # an epoch (`mpprof.backends.jax.float8`). Donated to the next call.
        self.keras_state = None
        # The unscaled loss of the step being traced (`capture_loss`), and
        # whether the traced step had one (None: not traced yet).
        self._loss = None
        self.loss_watched: bool | None = None
        # The trace of the step being traced: a loss from an inner trace
        # (inside a user's value_and_grad) cannot leave it, and is ignored.
        self._step_trace = None

    def start(self) -> None:
        """The device state at the start of the fit (before the first step:
        the model's variables still hold the values)."""
        table = np.zeros((RING_START + self.capacity, 4), np.float32)
        table[COUNT_ROW] = [self.start_skipped, 0, self.start_nonfinite,
                            self.start_first_nonfinite]
        counter = int(np.asarray(self._optimizer.step_counter.value)) if self.loss_scale else 0
        table[SCALE_ROW] = [self.variable_scale(), counter, np.nan,
                            int(np.asarray(applied_steps(self._optimizer).value))]
        self.arrays = jnp.asarray(table)
        self._host, self._host_of = table, self.arrays

    def variable_scale(self) -> float:
        if not self.loss_scale:
            return 1.0
        return float(np.asarray(self._optimizer.dynamic_scale.value))

    def capture_loss(self, loss) -> None:
        """Called while the step is traced with its unscaled loss. Several
        losses in one step (a GAN's) are checked as their sum: non-finite
        when any of them is."""
        if getattr(loss, "_trace", None) is not self._step_trace:
            return
        loss = jnp.sum(jnp.asarray(loss, jnp.float32))
        self._loss = loss if self._loss is None else self._loss + loss

    def update(self, arrays: tuple, keras_state) -> None:
        """The states a call returned (those given to it are donated)."""
        self.arrays = arrays
        self.keras_state = keras_state
        self._host = None

    def read(self) -> np.ndarray:
        """The table on the host: one copy per call at most (it waits for
        the last call to finish)."""
        if self._host is None or self._host_of is not self.arrays:
            self._host = np.asarray(jax.device_get(self.arrays))
            self._host_of = self.arrays
        return self._host

    def step_function(self, train_step: Callable) -> Callable:
        """`train_step(state, data)` as `step(state, table, data) ->
        (logs, state, table)`, with this state's updates traced in."""
        applied_index, scale_index = self._applied_index, self._scale_index
        counter_index, capacity = self._counter_index, self.capacity

        def step(state, table, data):
            self._loss, self._step_trace = None, getattr(table, "_trace", None)
            logs, new_state = train_step(state, data)
            before, after = state[2], new_state[2]
            applied_before = jnp.asarray(before[applied_index], jnp.float32)
            applied_after = jnp.asarray(after[applied_index], jnp.float32)
            counts, scales = table[COUNT_ROW], table[SCALE_ROW]
            skipped = events = jnp.float32(0)
            this_step = applied_before + counts[SKIPPED]
            scale_after, counter = scales[SCALE], scales[COUNTER]
            if scale_index is not None:
                scale_before = jnp.asarray(before[scale_index], jnp.float32)
                scale_after = jnp.asarray(after[scale_index], jnp.float32)
                counter = jnp.asarray(after[counter_index], jnp.float32)
                # A step that left the apply count alone was skipped.
                skipped = (applied_after == applied_before).astype(jnp.float32)
                grew = (scale_after > scale_before).astype(jnp.float32) * (1 - skipped)
                events = skipped + grew
                kind = skipped * schema.EVENT_OVERFLOW + grew * schema.EVENT_GROWTH
                # Steps without an event write to the scratch row.
                slot = jnp.where(events > 0,
                                 RING_START + jnp.mod(counts[EVENTS], capacity).astype(jnp.int32),
                                 SCRATCH_ROW)
                table = jax.lax.dynamic_update_slice(
                    table, jnp.stack([this_step, scale_before, scale_after, kind])[None],
                    (slot, 0))
            nonfinite, first, last_loss = jnp.float32(0), counts[FIRST_NONFINITE], scales[LAST_LOSS]
            loss, self._loss = self._loss, None
            self.loss_watched = loss is not None
            if loss is not None:
                last_loss = jnp.sum(jnp.asarray(loss, jnp.float32))
                nonfinite = jnp.logical_not(jnp.isfinite(last_loss)).astype(jnp.float32)
                first = jnp.where((first < 0) & (nonfinite > 0), this_step, first)
            counts = jnp.stack([counts[SKIPPED] + skipped, counts[EVENTS] + events,
                                counts[NONFINITE] + nonfinite, first])
            scales = jnp.stack([scale_after, counter, last_loss, applied_after])
            table = jax.lax.dynamic_update_slice(table, jnp.stack([counts, scales]),
                                                 (COUNT_ROW, 0))
            if isinstance(logs, dict):
                # The call alarm, read by the host when its step is done
                # (`mpprof.backends.jax.call_alarm`); not donated.
                logs = {**logs, ALARM_KEY: counts[SKIPPED] + counts[NONFINITE]}
            return logs, new_state, table

        return step

    # Host reads (one copy per call, `read`).

    def skipped(self) -> int:
        return int(self.read()[COUNT_ROW, SKIPPED])

    def applied(self) -> int:
        return int(self.read()[SCALE_ROW, APPLIED])

    def steps_run(self) -> int:
        """Steps run so far: apply calls plus skipped steps."""
        return self.applied() + self.skipped()

    def scale(self) -> float:
        return float(self.read()[SCALE_ROW, SCALE])

    def counter(self) -> int:
        return int(self.read()[SCALE_ROW, COUNTER])

    def last_loss(self) -> float:
        return float(self.read()[SCALE_ROW, LAST_LOSS])

    def nonfinite(self) -> int:
        return int(self.read()[COUNT_ROW, NONFINITE])

    def first_nonfinite(self) -> int | None:
        first = int(self.read()[COUNT_ROW, FIRST_NONFINITE])
        return None if first < 0 else first

    def events(self) -> tuple[int, np.ndarray]:
        """(events written so far, the ring [capacity, 4])."""
        table = self.read()
        return int(table[COUNT_ROW, EVENTS]), table[RING_START:].astype(np.float64)
