"""Keras 3 loss-scale growth events, derived from the overflows instead of
counted on every step.

Keras 3's LossScaleOptimizer doubles its scale on a finite step exactly when
`step_counter == dynamic_growth_steps - 1` (the counter then restarts at 0,
as it does on every overflow; other finite steps add 1). Given where the
scale and counter stood at one read, every overflow since (recorded in the
step, exact to the step) and where they stand at the next read, the growth
steps in between follow by arithmetic. Deriving them on the host spares
every finite step the in-graph comparison and `tf.cond` that would record
them (a device-to-host sync per step under XLA on a GPU).

Every derivation is checked: each overflow must find the scale the
derivation expects, and the derived counter and scale must equal the ones
read. A window that fails (the scale or counter changed by something other
than the optimizer's own update, steps run outside the profiled fit, or
another Keras' rule) gets no growth events, and the collector says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpprof import schema


@dataclass(frozen=True)
class ScaleState:
    """Where a LossScaleOptimizer stood at a read.

    Attributes:
        step: the next step it will run (iterations plus skipped steps).
        counter: its `step_counter` (finite steps since the last change).
        scale: its `dynamic_scale` (a float32 value).
    """

    step: int
    counter: int
    scale: float


def growth_events(start: ScaleState, overflows: np.ndarray, end: ScaleState,
                  growth_steps: int) -> tuple[np.ndarray, bool]:
    """The overflow and growth events from `start` to `end`, in step order.

    Args:
        start: the state at the earlier read.
        overflows: float64 [n, 2], (step, scale_before) of each overflow
            since, in the order they happened.
        end: the state at this read.
        growth_steps: the optimizer's `dynamic_growth_steps`.

    Returns:
        (events float64 [m, 4] with `schema.LOSS_SCALE_EVENT_COLUMNS`,
        whether the derivation agreed with every overflow and with `end`).
        When it did not, the events are the overflows alone.
    """
    overflow_events = [(step, before, before * 0.5, schema.EVENT_OVERFLOW)
                       for step, before in overflows]
    rows: list[tuple] = []
    step, counter, scale = start.step, start.counter, np.float32(start.scale)
    consistent = True

    def run_finite(steps: int) -> None:
        nonlocal counter, scale
        # The k-th finite step (from 0) grows the scale when the counter it
        # finds is growth_steps - 1; after a growth the counter is 0 again.
        first = growth_steps - 1 - counter if counter < growth_steps else steps
        for k in range(first, steps, growth_steps):
            rows.append((step + k, float(scale), float(scale * 2), schema.EVENT_GROWTH))
            scale = np.float32(scale * 2)
        counter = (counter + steps) % growth_steps if counter < growth_steps else counter + steps

    for (overflow_step, before, after, kind) in overflow_events:
        overflow_step = int(overflow_step)
        if overflow_step < step:
            consistent = False
            break
        run_finite(overflow_step - step)
        consistent = consistent and float(scale) == before
        rows.append((overflow_step, before, after, kind))
        step, counter, scale = overflow_step + 1, 0, np.float32(after)
    if consistent and end.step >= step:
        run_finite(end.step - step)
        consistent = counter == end.counter and float(scale) == end.scale
    else:
        consistent = False
    chosen = rows if consistent else overflow_events
    columns = len(schema.LOSS_SCALE_EVENT_COLUMNS)
    return np.array(chosen, np.float64).reshape(-1, columns), consistent
