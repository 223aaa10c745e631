"""mpprof's own state inside the JAX train step: counters and event rings.

Keras' JAX `fit` runs `train_step(state, data)` jitted with the state
donated; a LossScaleOptimizer decides inside it (`stateless_apply`, an
`ops.cond`) whether its update is applied or skipped, and logs nothing. The
profiled step is the model's own `train_step` traced in a function of
mpprof's (`StepState.step_function`) that also takes and returns a small
state of its own, one array donated like Keras' state.

Each optimizer the step may apply (the compiled one, a GAN's `g_opt` and
`d_opt`) is followed through its `stateless_apply`, wrapped at instance
level: the wrapper sees the optimizer variables going in and coming out, as
traced values, wherever the step keeps them (Keras' `state[2]`, a GAN's
`state[1]`). An update that left the apply count alone was skipped (an
overflow, at that optimizer's step: applied + skipped), one whose scale grew
is a growth. Per optimizer the state holds its skipped steps, events
written, apply calls, loss scale and growth counter, and (for a
LossScaleOptimizer) a ring of events [step, scale before, scale after,
kind]; for the step, the steps with a non-finite loss, the first such step
(-1: none) and the last loss. Every number is computed in the step and read
by the host only at flush points (one device-to-host copy for every
collector), so each event is dated exactly, also under
`steps_per_execution > 1`, without a sync. Counts are float32: exact up to
2**24 steps.

An update applied inside a nested transformation of the step (`lax.scan`,
`lax.cond`) cannot leave it: that optimizer is not followed, and says why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpprof.backends.base import ALARM_LOGS_KEY
from mpprof.backends.optimizer_usage import OptimizerUsage, applied_steps
from mpprof.backends.patching import Patches
from mpprof.backends.step_state_base import NOT_BUILT, StepStateBase
from mpprof.records import schema

# mpprof's state is ONE float32 array [rows, 4] (each array a jitted
# function takes and returns costs dispatch time; each op an XLA:CPU thunk):
# row 0 takes the ring writes of steps without an event, row 1 the loss
# check, then two rows per followed optimizer, then the rings of the
# LossScaleOptimizers. The counter rows are contiguous: one write a step.
SCRATCH_ROW, LOSS_ROW, BLOCK_START = 0, 1, 2
# Columns of LOSS_ROW.
NONFINITE, FIRST_NONFINITE, LAST_LOSS = range(3)
# Columns of an optimizer's first row, and of its second.
SKIPPED, EVENTS, APPLIED = range(3)
SCALE, COUNTER = range(2)

NESTED = ("applied inside a nested transformation of the train step (lax.scan, "
          "lax.cond, a vmap): its updates cannot leave it, so its scale and skips "
          "are not followed")


def _index_of(variables: list, variable) -> int | None:
    return next((i for i, v in enumerate(variables) if v is variable), None)


@dataclass
class _Block:
    """Where one followed optimizer's counters live, and its variables' places."""

    optimizer: Any
    row: int  # its first counter row
    ring: int | None  # its ring's first row (a LossScaleOptimizer's only)
    applied: int  # positions in `optimizer.variables`
    scale: int | None
    counter: int | None


class _Trace:
    """What one trace of the step carries between the optimizers' wrappers."""

    def __init__(self, table):
        self.table = table
        self.jax_trace = getattr(table, "_trace", None)
        # By optimizer id: its two counter rows as the step leaves them, and
        # its step before the step's first update.
        self.rows: dict[int, list] = {}
        self.step_of: dict[int, object] = {}
        self.loss = None


class StepState(StepStateBase):
    """The counters of one fit's steps, on the device, and their host copy
    (the arguments: `StepStateBase`'s, and `is_loss_scale`, which tells a
    LossScaleOptimizer).
    """

    _blocks: dict[int, _Block]

    def __init__(self, usage: OptimizerUsage, capacity: int,
                 is_loss_scale: Callable[[object], bool]):
        super().__init__(usage, capacity)
        row = BLOCK_START
        for use in usage.uses:
            optimizer = use.optimizer
            variables = list(optimizer.variables)
            applied = _index_of(variables, applied_steps(optimizer)) \
                if getattr(optimizer, "built", True) else None
            if applied is None:
                self.unfollowed[id(optimizer)] = NOT_BUILT
                continue
            scale = counter = None
            if is_loss_scale(optimizer):
                scale = _index_of(variables, optimizer.dynamic_scale)
                counter = _index_of(variables, optimizer.step_counter)
            self._blocks[id(optimizer)] = _Block(optimizer, row, None, applied, scale, counter)
            row += 2
        for block in self._blocks.values():
            if block.scale is not None:
                block.ring, row = row, row + self.capacity
        self._rows = row
        # The device table the last call returned (the one given to it is
        # donated; a call may set it directly), and the host copy of one.
        self.arrays: Any = None  # (a tuple of device arrays, or one array)
        self._host: np.ndarray | None = None
        self._host_of: Any = None  # the `arrays` `_host` copies
        # Keras' state [trainable, non-trainable, optimizer, metrics
        # variables] the last call returned beside `arrays` (None before the
        # first call): what flushes read the model's variables from during
        # an epoch (`mpprof.backends.jax.float8`). Donated to the next call.
        self.keras_state = None
        self._trace: _Trace | None = None

    def install(self, patches: Patches) -> None:
        """Wraps each followed optimizer's `stateless_apply` (undone by
        `patches.restore`): the update it returns is counted in the step
        being traced."""
        for block in self._blocks.values():
            original = block.optimizer.stateless_apply

            def stateless_apply(optimizer_variables, grads, trainable_variables,
                                _original=original, _block=block):
                trainable, new = _original(optimizer_variables, grads, trainable_variables)
                if self._trace is not None:
                    self._count(_block, optimizer_variables, new)
                return trainable, new

            patches.set(block.optimizer, "stateless_apply", stateless_apply)

    def start(self) -> None:
        """The device state at the start of the fit (before the first step:
        the model's variables still hold the values)."""
        table = np.zeros((self._rows, 4), np.float32)
        table[LOSS_ROW, :3] = [self.start_nonfinite, self.start_first_nonfinite, np.nan]
        for key, block in self._blocks.items():
            optimizer = block.optimizer
            table[block.row, :3] = [self.start_skipped.get(key, 0), 0,
                                    int(np.asarray(applied_steps(optimizer).value))]
            if block.scale is not None:
                table[block.row + 1, :2] = [float(np.asarray(optimizer.dynamic_scale.value)),
                                            int(np.asarray(optimizer.step_counter.value))]
            else:
                table[block.row + 1, SCALE] = 1.0
        self.arrays = jnp.asarray(table)
        self._host, self._host_of = table, self.arrays

    def capture_loss(self, loss) -> None:
        """Called while the step is traced with its unscaled loss. Several
        losses in one step (a GAN's) are checked as their sum: non-finite
        when any of them is."""
        trace = self._trace
        if trace is None or getattr(loss, "_trace", None) is not trace.jax_trace:
            return  # a loss from an inner trace (a user's value_and_grad) cannot leave it
        loss = jnp.sum(jnp.asarray(loss, jnp.float32))
        trace.loss = loss if trace.loss is None else trace.loss + loss

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

    # The traced step.

    def _count(self, block: _Block, before: list, after: list) -> None:
        """One update of `block`'s optimizer, inside the step being traced."""
        trace, key = self._trace, id(block.optimizer)
        applied_after = after[block.applied]
        if getattr(applied_after, "_trace", None) is not trace.jax_trace:
            self.unfollowed[key] = NESTED
            return
        applied_before = jnp.asarray(before[block.applied], jnp.float32)
        applied_after = jnp.asarray(applied_after, jnp.float32)
        table = trace.table
        counts, scales = trace.rows.get(key) or (table[block.row], table[block.row + 1])
        this_step = applied_before + counts[SKIPPED]
        trace.step_of.setdefault(key, this_step)
        skipped = events = jnp.float32(0)
        if block.scale is not None:
            scale_before = jnp.asarray(before[block.scale], jnp.float32)
            scale_after = jnp.asarray(after[block.scale], jnp.float32)
            # An update that left the apply count alone was skipped.
            skipped = (applied_after == applied_before).astype(jnp.float32)
            grew = (scale_after > scale_before).astype(jnp.float32) * (1 - skipped)
            events = skipped + grew
            kind = skipped * schema.EVENT_OVERFLOW + grew * schema.EVENT_GROWTH
            # Updates without an event write to the scratch row.
            slot = jnp.where(events > 0, block.ring + jnp.mod(
                counts[EVENTS], self.capacity).astype(jnp.int32), SCRATCH_ROW)
            trace.table = jax.lax.dynamic_update_slice(
                table, jnp.stack([this_step, scale_before, scale_after, kind])[None], (slot, 0))
            scales = jnp.stack([scale_after, jnp.asarray(after[block.counter], jnp.float32),
                                scales[2], scales[3]])
        counts = jnp.stack([counts[SKIPPED] + skipped, counts[EVENTS] + events,
                            applied_after, counts[3]])
        trace.rows[key] = [counts, scales]

    def _loss_step(self, trace: _Trace):
        """The step the loss check dates: the primary optimizer's (as the
        step axis), before this step's update."""
        table = trace.table
        for use in self._usage.applied():
            if id(use.optimizer) in trace.step_of:
                return trace.step_of[id(use.optimizer)]
        block = next(iter(self._blocks.values()), None)
        if block is None:
            return jnp.float32(0)
        return table[block.row, APPLIED] + table[block.row, SKIPPED]

    def step_function(self, train_step: Callable) -> Callable:
        """`train_step(state, data)` as `step(state, table, data) ->
        (logs, state, table)`, with this state's updates traced in."""
        blocks = list(self._blocks.values())

        def step(state, table, data):
            trace = self._trace = _Trace(table)
            try:
                logs, new_state = train_step(state, data)
            finally:
                self._trace = None
            table = trace.table
            loss_row = table[LOSS_ROW]
            nonfinite, first, last_loss = (jnp.float32(0), loss_row[FIRST_NONFINITE],
                                           loss_row[LAST_LOSS])
            self.loss_watched = trace.loss is not None
            if trace.loss is not None:
                last_loss = trace.loss
                nonfinite = jnp.logical_not(jnp.isfinite(last_loss)).astype(jnp.float32)
                first = jnp.where((first < 0) & (nonfinite > 0), self._loss_step(trace),
                                  first)
            rows = [jnp.stack([loss_row[NONFINITE] + nonfinite, first, last_loss,
                               loss_row[3]])]
            skipped = rows[0][NONFINITE]
            for block in blocks:
                counts, scales = trace.rows.get(id(block.optimizer)) or (
                    table[block.row], table[block.row + 1])
                rows += [counts, scales]
                skipped = skipped + counts[SKIPPED]
            table = jax.lax.dynamic_update_slice(table, jnp.stack(rows), (LOSS_ROW, 0))
            if isinstance(logs, dict):
                # The call alarm: every skipped step and non-finite loss so
                # far, read by the host when its step is done
                # (`mpprof.backends.jax.call_alarm`); not donated.
                logs = {**logs, ALARM_LOGS_KEY: skipped}
            return logs, new_state, table

        return step

    # Host reads (one copy per call, `read`).

    def skipped(self, optimizer) -> int:
        return int(self.read()[self._block(optimizer).row, SKIPPED])

    def applied(self, optimizer) -> int:
        return int(self.read()[self._block(optimizer).row, APPLIED])

    def steps_run(self, optimizer) -> int:
        """Steps `optimizer` has run so far: apply calls plus skipped steps."""
        row = self.read()[self._block(optimizer).row]
        return int(row[APPLIED]) + int(row[SKIPPED])

    def scale(self, optimizer) -> float:
        return float(self.read()[self._block(optimizer).row + 1, SCALE])

    def counter(self, optimizer) -> int:
        return int(self.read()[self._block(optimizer).row + 1, COUNTER])

    def events(self, optimizer) -> tuple[int, np.ndarray]:
        """(events written so far, the ring [capacity, 4])."""
        table, block = self.read(), self._block(optimizer)
        ring = table[block.ring:block.ring + self.capacity]
        return int(table[block.row, EVENTS]), ring.astype(np.float64)

    def all_skipped(self, table: np.ndarray | None = None) -> int:
        """Skipped steps of every followed optimizer (in `table`, default
        the last call's)."""
        table = self.read() if table is None else table
        return int(sum(table[b.row, SKIPPED] for b in self._blocks.values()))

    def last_loss(self) -> float:
        return float(self.read()[LOSS_ROW, LAST_LOSS])

    def nonfinite(self) -> int:
        return int(self.read()[LOSS_ROW, NONFINITE])

    def first_nonfinite(self) -> int | None:
        first = int(self.read()[LOSS_ROW, FIRST_NONFINITE])
        return None if first < 0 else first

    def primary_in(self, table: np.ndarray) -> tuple[int, int, float]:
        """(apply calls, skipped steps, loss scale) in `table` of the primary
        optimizer, the step axis ((0, 0, 1.0) when it is not followed)."""
        primary = self._usage.primary()
        block = self._blocks.get(id(primary.optimizer)) if primary is not None else None
        if block is None:
            return 0, 0, 1.0
        row = table[block.row]
        return int(row[APPLIED]), int(row[SKIPPED]), float(table[block.row + 1, SCALE])

    def primary_overflows(self) -> tuple[int, set[int]] | None:
        """(steps run, the steps still in its ring that overflowed) of the
        primary optimizer, in the last call's table; None when it has no
        followed loss scale."""
        primary = self._usage.primary()
        block = self._blocks.get(id(primary.optimizer)) if primary is not None else None
        if block is None or block.ring is None:
            return None
        written, ring = self.events(block.optimizer)
        rows = ring if written >= self.capacity else ring[:written]
        return (self.steps_run(block.optimizer),
                {int(r[0]) for r in rows if r[3] == schema.EVENT_OVERFLOW})
