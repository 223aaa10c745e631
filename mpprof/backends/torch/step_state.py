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

The host reads are those of the JAX backend's step state
(`mpprof.backends.jax.step_state`), so that its loss-scale series and loss
watch read both alike. The counts are plain Python numbers, each step's
update a few additions (a numpy table costs microseconds a step more), and
each ring a numpy array written only on an event.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mpprof.backends.optimizer_usage import OptimizerUsage, applied_steps
from mpprof.backends.patching import Patches
from mpprof.backends.step_state_base import NOT_BUILT, StepStateBase
from mpprof.records import schema


def host_value(variable) -> float:
    """A Keras variable's (or tensor's) value as a Python float, wherever it lives."""
    value = getattr(variable, "value", variable)
    return float(value.detach().to("cpu", torch.float64)) if isinstance(
        value, torch.Tensor) else float(np.asarray(value))


def host_array(value) -> np.ndarray:
    """A tensor (or Keras variable, or array) on the host as a NumPy array,
    in a dtype NumPy has (bfloat16 as float32). Directly: Keras'
    `convert_to_numpy` goes through `np.array(tensor)`, which NumPy 2 warns
    about for torch tensors."""
    value = getattr(value, "value", value)
    if not isinstance(value, torch.Tensor):
        return np.asarray(value)
    value = value.detach()
    if value.dtype == torch.bfloat16:
        value = value.float()
    return value.cpu().numpy()


@dataclass
class _Block:
    """One followed optimizer's counts and, under loss scaling, its event ring
    ([capacity, 4]: step, scale before, scale after, kind)."""

    # A Keras optimizer on torch (a LossScaleOptimizer where growth_steps).
    optimizer: Any
    growth_steps: int = 0  # (0: no loss scaling)
    ring: np.ndarray | None = None
    applied: int = 0
    skipped: int = 0
    events: int = 0
    scale: float = 1.0
    counter: int = 0

    @property
    def step(self) -> int:
        """Steps run: apply calls plus skipped steps."""
        return self.applied + self.skipped


class StepState(StepStateBase):
    """The counters of one fit's steps, kept on the host (the arguments:
    `StepStateBase`'s, and `is_loss_scale`, which tells a LossScaleOptimizer).
    """

    _blocks: dict[int, _Block]

    def __init__(self, usage: OptimizerUsage, capacity: int,
                 is_loss_scale: Callable[[object], bool]):
        super().__init__(usage, capacity)
        for use in usage.uses:
            optimizer = use.optimizer
            if not getattr(optimizer, "built", True):
                self.unfollowed[id(optimizer)] = NOT_BUILT
                continue
            growth = int(optimizer.dynamic_growth_steps) if is_loss_scale(optimizer) else 0
            self._blocks[id(optimizer)] = _Block(
                optimizer, growth, np.zeros((self.capacity, 4)) if growth else None)
        # Set by `start` (None before): the JAX step state's marker of "the
        # fit's counts exist", which its series and loss watch ask.
        self.arrays: bool | None = None
        self._nonfinite = 0
        self._first_nonfinite = -1
        self._last_loss = math.nan
        # (step, loss) of the steps since the last read, losses on the device.
        self._pending_losses: list[tuple[int, torch.Tensor]] = []
        # The losses handed over in the step under way (several: a GAN's).
        self._step_losses: list = []

    def install(self, patches: Patches) -> None:
        """Wraps each followed optimizer's update methods (undone by `patches`)."""
        for block in self._blocks.values():
            optimizer = block.optimizer
            if block.growth_steps:
                finite = optimizer._stateful_handle_finite_grads
                nonfinite = optimizer._stateful_handle_non_finite_grads

                def on_finite(*args, _original=finite, _block=block, **kwargs):
                    result = _original(*args, **kwargs)
                    self._applied_scaled(_block)
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
                    _block.applied += 1
                    return result

                patches.set(optimizer, "apply", on_apply)

    def start(self) -> None:
        """The counts at the start of the fit, from the variables."""
        self._nonfinite = self.start_nonfinite
        self._first_nonfinite = self.start_first_nonfinite
        self._last_loss = math.nan
        for key, block in self._blocks.items():
            optimizer = block.optimizer
            block.skipped = self.start_skipped.get(key, 0)
            block.events = 0
            block.applied = int(host_value(applied_steps(optimizer)))
            if block.growth_steps:
                block.scale = host_value(optimizer.dynamic_scale)
                block.counter = int(host_value(optimizer.step_counter))
        self._pending_losses.clear()
        self.arrays = True

    # The step, as it runs.

    def _event(self, block: _Block, kind: float) -> None:
        """An overflow or growth at the step under way: the scale after it is
        read from the variable (events are rare)."""
        scale_after = host_value(block.optimizer.dynamic_scale)
        block.ring[block.events % self.capacity] = (block.step, block.scale, scale_after, kind)
        block.events += 1
        block.scale = scale_after

    def _applied_scaled(self, block: _Block) -> None:
        """A LossScaleOptimizer's finite step: a growth where Keras' counter
        stood at `dynamic_growth_steps - 1` before it."""
        if block.counter == block.growth_steps - 1:
            self._event(block, schema.EVENT_GROWTH)
            block.counter = 0
        else:
            block.counter += 1
        block.applied += 1

    def _skipped(self, block: _Block) -> None:
        self._event(block, schema.EVENT_OVERFLOW)
        block.skipped += 1
        block.counter = 0

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
        if not losses:
            if self.loss_watched is None:
                self.loss_watched = False
            return
        self.loss_watched = True
        loss = losses[0] if len(losses) == 1 else torch.stack(
            [x.float().sum() for x in losses]).sum()
        block = self._primary_block()
        self._pending_losses.append((0 if block is None else block.step - 1, loss))

    def _primary_block(self) -> _Block | None:
        primary = self._usage.primary()
        if primary is not None and id(primary.optimizer) in self._blocks:
            return self._blocks[id(primary.optimizer)]
        return next(iter(self._blocks.values()), None)

    def _check_losses(self) -> None:
        """Checks the losses of the steps since the last read (one stacked
        copy to the host)."""
        pending = self._pending_losses
        if not pending:
            return
        self._pending_losses = []
        values = torch.stack([loss.float().sum() for _, loss in pending]).to(
            "cpu", torch.float64).numpy()
        bad = ~np.isfinite(values)
        if bad.any():
            self._nonfinite += int(bad.sum())
            if self._first_nonfinite < 0:
                self._first_nonfinite = pending[int(np.argmax(bad))][0]
        self._last_loss = float(values[-1])

    # Host reads: the interface of `mpprof.backends.jax.step_state.StepState`.

    def skipped(self, optimizer) -> int:
        return self._block(optimizer).skipped

    def applied(self, optimizer) -> int:
        return self._block(optimizer).applied

    def steps_run(self, optimizer) -> int:
        return self._block(optimizer).step

    def scale(self, optimizer) -> float:
        return self._block(optimizer).scale

    def counter(self, optimizer) -> int:
        return self._block(optimizer).counter

    def events(self, optimizer) -> tuple[int, np.ndarray]:
        """(events written so far, a copy of the ring [capacity, 4])."""
        block = self._block(optimizer)
        return block.events, block.ring.copy()

    def primary_counts(self) -> tuple[int, int, float]:
        """The primary optimizer's (applied, skipped, scale) so far (a
        replay capture dates its step by them)."""
        block = self._primary_block()
        return (0, 0, 1.0) if block is None else (block.applied, block.skipped, block.scale)

    def all_skipped(self) -> int:
        return sum(block.skipped for block in self._blocks.values())

    def last_loss(self) -> float:
        self._check_losses()
        return self._last_loss

    def nonfinite(self) -> int:
        self._check_losses()
        return self._nonfinite

    def first_nonfinite(self) -> int | None:
        self._check_losses()
        return None if self._first_nonfinite < 0 else self._first_nonfinite
