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

from mpprof.records import schema


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
    columns = len(schema.LOSS_SCALE_EVENT_COLUMNS)
    overflow_events = np.array(
        [(step, before, before * 0.5, schema.EVENT_OVERFLOW) for step, before in overflows],
        np.float64,
    ).reshape(-1, columns)
    if not 0 <= start.counter < growth_steps:
        return overflow_events, False  # not a state Keras 3's rule reaches
    rows: list[tuple] = []
    step, counter, scale = start.step, start.counter, np.float32(start.scale)

    def run_finite(steps: int) -> None:
        nonlocal counter, scale
        # The k-th finite step (from 0) grows the scale when the counter it
        # finds is growth_steps - 1; after a growth the counter is 0 again.
        for k in range(growth_steps - 1 - counter, steps, growth_steps):
            rows.append((step + k, float(scale), float(scale * 2), schema.EVENT_GROWTH))
            scale = np.float32(scale * 2)
        counter = (counter + steps) % growth_steps

    for overflow_step, before, after, kind in overflow_events:
        overflow_step = int(overflow_step)
        if overflow_step < step:
            return overflow_events, False
        run_finite(overflow_step - step)
        if float(scale) != before:
            return overflow_events, False
        rows.append((overflow_step, before, after, kind))
        step, counter, scale = overflow_step + 1, 0, np.float32(after)
    if end.step < step:
        return overflow_events, False
    run_finite(end.step - step)
    if counter != end.counter or float(scale) != end.scale:
        return overflow_events, False
    return np.array(rows, np.float64).reshape(-1, columns), True
