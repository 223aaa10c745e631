"""mpprof's own counters of the PyTorch train step, on the host.

Keras' PyTorch `fit` calls `train_step(data)` eagerly, once per step, from
Python. A LossScaleOptimizer decides in Python whether its update is applied
(`ops.cond` on PyTorch is `if finite:`, which waits for the gradients' check
anyway) and calls `_stateful_handle_finite_grads` or
`_stateful_handle_non_finite_grads` on itself. Both are wrapped at instance
level: the counts of applied and skipped steps, each overflow and growth and
the scale after it are known on the host as the step runs, without a read of
the device beyond the one Keras makes. A growth is the finite step that
finds the step counter at `dynamic_growth_steps - 1` (Keras' rule); the
counter is mirrored on the host from its value at the fit's start, and the
scale after an event is read from the variable (events are rare). Any other
optimizer counts its `apply` calls.

The loss: the unscaled loss each step hands to its loss metrics (Keras' own
`_loss_tracker`, named "loss", or a custom step's "..._loss" trackers) is
kept, detached, and checked at the next read (a flush, an alarm, a sample):
one stacked check for all the steps since, exact to the step, with no
per-step wait on a GPU.

The counts are kept in the JAX backend's table layout
(`mpprof.backends.jax.step_state`: the same rows and columns), so that the
loss-scale series and the loss watch read them the same way on both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from mpprof.recording.optimizer_usage import OptimizerUsage, applied_steps
from mpprof.recording.patching import Patches
from mpprof.records import schema

SCRATCH_ROW, LOSS_ROW, BLOCK_START = 0, 1, 2
NONFINITE, FIRST_NONFINITE, LAST_LOSS = range(3)
SKIPPED, EVENTS, APPLIED = range(3)
SCALE, COUNTER = range(2)


def host_value(variable) -> float:
    """A Keras variable's (or tensor's) value as a Python float, wherever it lives."""
    value = getattr(variable, "value", variable)
    return float(value.detach().to("cpu", torch.float64)) if isinstance(
        value, torch.Tensor) else float(np.asarray(value))


@dataclass
class _Block:
    """One followed optimizer: its counter rows and, under loss scaling, its ring."""

    optimizer: object
    row: int
    ring: int | None
    growth_steps: int = 0


class StepState:
    """The counters of one fit's steps, kept on the host.

    Args:
        usage: the fit's `OptimizerUsage` (every built candidate is followed;
            the primary one dates the loss check).
        capacity: events each ring holds between two reads.
        is_loss_scale: tells a LossScaleOptimizer.
    """

    def __init__(self, usage: OptimizerUsage, capacity: int,
                 is_loss_scale: Callable[[object], bool]):
        self.capacity = int(capacity)
        self._usage = usage
        self._blocks: dict[int, _Block] = {}
        self.unfollowed: dict[int, str] = {}
        row = BLOCK_START
        for use in usage.uses:
            optimizer = use.optimizer
            if not getattr(optimizer, "built", True):
                self.unfollowed[id(optimizer)] = "not built before the fit"
                continue
            growth = int(optimizer.dynamic_growth_steps) if is_loss_scale(optimizer) else 0
            self._blocks[id(optimizer)] = _Block(optimizer, row, None, growth)
            row += 2
        for block in self._blocks.values():
            if block.growth_steps:
                block.ring, row = row, row + self.capacity
        self._rows = row
        self.start_skipped: dict[int, int] = {}
        self.start_nonfinite = 0
        self.start_first_nonfinite = -1
        # The table (None before `start`): the counters are current at all
        # times but for the losses not yet checked (`_pending_losses`).
        self.arrays: np.ndarray | None = None
        self._pending_losses: list[tuple[int, torch.Tensor]] = []
        self.loss_watched: bool | None = None
        # The losses handed over in the step under way (several: a GAN's).
        self._step_losses: list = []
        self._primary: _Block | None = None

    def follows(self, optimizer) -> bool:
        return id(optimizer) in self._blocks

    def install(self, patches: Patches) -> None:
        """Wraps each followed optimizer's update methods (undone by `patches`)."""
        for block in self._blocks.values():
            optimizer = block.optimizer
            if block.growth_steps:
                finite = optimizer._stateful_handle_finite_grads
                nonfinite = optimizer._stateful_handle_non_finite_grads

                def on_finite(*args, _original=finite, _block=block, **kwargs):
                    grows = self._counter_before(_block) == _block.growth_steps - 1
                    result = _original(*args, **kwargs)
                    self._applied(_block, grew=grows)
                    return result

                def on_nonfinite(*args, _original=nonfinite, _block=block, **kwargs):
                    result = _original(*args, **kwargs)
                    self._skipped(_block)
                    return result

                patches.set(optimizer, "_stateful_handle_finite_grads", on_finite)
                patches.set(optimizer, "_stateful_handle_non_finite_grads", on_nonfinite)
            else:
                apply = optimizer.apply

                def on_apply(*args, _original=apply, _block=block, **kwargs):
                    result = _original(*args, **kwargs)
                    self._applied(_block, grew=False)
                    return result

                patches.set(optimizer, "apply", on_apply)

    def start(self) -> None:
        """The table at the start of the fit, from the variables."""
        table = np.zeros((self._rows, 4), np.float64)
        table[LOSS_ROW, :3] = [self.start_nonfinite, self.start_first_nonfinite, np.nan]
        for key, block in self._blocks.items():
            optimizer = block.optimizer
            table[block.row, :3] = [self.start_skipped.get(key, 0), 0,
                                    host_value(applied_steps(optimizer))]
            if block.growth_steps:
                table[block.row + 1, :2] = [host_value(optimizer.dynamic_scale),
                                            host_value(optimizer.step_counter)]
            else:
                table[block.row + 1, SCALE] = 1.0
        self.arrays = table
        self._pending_losses.clear()

    # The step, as it runs.

    def _counter_before(self, block: _Block) -> float:
        return self.arrays[block.row + 1, COUNTER]

    def _step_of(self, block: _Block) -> int:
        row = self.arrays[block.row]
        return int(row[APPLIED] + row[SKIPPED])

    def _event(self, block: _Block, kind: float, scale_after: float) -> None:
        table = self.arrays
        counts = table[block.row]
        slot = block.ring + int(counts[EVENTS]) % self.capacity
        table[slot] = [self._step_of(block), table[block.row + 1, SCALE], scale_after, kind]
        counts[EVENTS] += 1
        table[block.row + 1, SCALE] = scale_after

    def _applied(self, block: _Block, *, grew: bool) -> None:
        table = self.arrays
        if block.growth_steps:
            if grew:
                self._event(block, schema.EVENT_GROWTH,
                            host_value(block.optimizer.dynamic_scale))
                table[block.row + 1, COUNTER] = 0
            else:
                table[block.row + 1, COUNTER] += 1
        table[block.row, APPLIED] += 1

    def _skipped(self, block: _Block) -> None:
        self._event(block, schema.EVENT_OVERFLOW, host_value(block.optimizer.dynamic_scale))
        self.arrays[block.row, SKIPPED] += 1
        self.arrays[block.row + 1, COUNTER] = 0

    def capture_loss(self, loss) -> None:
        """A loss the step handed to a loss metric (before its update)."""
        if isinstance(loss, torch.Tensor):
            self._step_losses.append(loss.detach())

    def begin_step(self) -> None:
        self._step_losses = []

    def end_step(self) -> None:
        """After a step: keeps its loss (the sum of its losses) under the
        primary optimizer's step before the update."""
        losses = self._step_losses
        self.loss_watched = bool(losses) or bool(self.loss_watched)
        if not losses:
            return
        loss = losses[0].float().sum() if len(losses) == 1 else torch.stack(
            [x.float().sum() for x in losses]).sum()
        self._pending_losses.append((self._loss_step(), loss))

    def _loss_step(self) -> int:
        """The step the loss check dates: the primary optimizer's, before
        this step's update (its count now, less the update just made)."""
        block = self._primary_block()
        return 0 if block is None else self._step_of(block) - 1

    def _primary_block(self) -> _Block | None:
        primary = self._usage.primary()
        if primary is not None and id(primary.optimizer) in self._blocks:
            return self._blocks[id(primary.optimizer)]
        return next(iter(self._blocks.values()), None)

    def read(self) -> np.ndarray:
        """The table, with the losses of the steps since the last read checked
        (one stacked check)."""
        pending = self._pending_losses
        if pending:
            self._pending_losses = []
            values = torch.stack([loss for _, loss in pending]).to("cpu", torch.float64).numpy()
            row = self.arrays[LOSS_ROW]
            bad = ~np.isfinite(values)
            if bad.any():
                row[NONFINITE] += int(bad.sum())
                if row[FIRST_NONFINITE] < 0:
                    row[FIRST_NONFINITE] = pending[int(np.argmax(bad))][0]
            row[LAST_LOSS] = values[-1]
        return self.arrays

    def nonfinite_so_far(self) -> int:
        """Skipped steps plus non-finite losses, checked now: the call alarm."""
        table = self.read()
        return int(table[LOSS_ROW, NONFINITE]) + self.all_skipped(table)

    # Host reads: the interface of `mpprof.backends.jax.step_state.StepState`.

    def _block(self, optimizer) -> _Block:
        return self._blocks[id(optimizer)]

    def skipped(self, optimizer) -> int:
        return int(self.arrays[self._block(optimizer).row, SKIPPED])

    def applied(self, optimizer) -> int:
        return int(self.arrays[self._block(optimizer).row, APPLIED])

    def steps_run(self, optimizer) -> int:
        return self._step_of(self._block(optimizer))

    def scale(self, optimizer) -> float:
        return float(self.arrays[self._block(optimizer).row + 1, SCALE])

    def counter(self, optimizer) -> int:
        return int(self.arrays[self._block(optimizer).row + 1, COUNTER])

    def events(self, optimizer) -> tuple[int, np.ndarray]:
        table, block = self.arrays, self._block(optimizer)
        return int(table[block.row, EVENTS]), table[block.ring:block.ring + self.capacity].copy()

    def all_skipped(self, table: np.ndarray | None = None) -> int:
        table = self.arrays if table is None else table
        return int(sum(table[b.row, SKIPPED] for b in self._blocks.values()))

    def last_loss(self) -> float:
        return float(self.read()[LOSS_ROW, LAST_LOSS])

    def nonfinite(self) -> int:
        return int(self.read()[LOSS_ROW, NONFINITE])

    def first_nonfinite(self) -> int | None:
        first = int(self.read()[LOSS_ROW, FIRST_NONFINITE])
        return None if first < 0 else first

    def primary_overflows(self) -> tuple[int, set[int]] | None:
        primary = self._usage.primary()
        block = self._blocks.get(id(primary.optimizer)) if primary is not None else None
        if block is None or block.ring is None:
            return None
        written, ring = self.events(block.optimizer)
        rows = ring if written >= self.capacity else ring[:written]
        return (self.steps_run(block.optimizer),
                {int(r[0]) for r in rows if r[3] == schema.EVENT_OVERFLOW})
