"""The loss scale of a Keras 3 LossScaleOptimizer, exact to the step, from a
step state's ring of its events (JAX's in-step table; PyTorch's host
counters keep its layout and subclass this: `mpprof.backends.torch.loss_scale_series`).
Imports no framework.

On JAX the optimizer runs `stateless_apply`: a skipped step leaves the apply
count alone and halves the scale, inside the jitted step, with no Python
method to wrap. The step itself records each overflow and growth of each
followed optimizer in that optimizer's ring (`mpprof.backends.jax.step_state`);
this collector reads one optimizer's at flush points. The step axis counts
every step, skipped ones included: apply calls plus skipped steps, as on
TensorFlow.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpprof.backends.loss_scale_records import keras_3_settings
from mpprof.backends.optimizer_usage import applied_steps
from mpprof.backends.step_origin import KERAS_3_UNKNOWN_ORIGIN, Origin

MODE_STEP_STATE = "step_state"


class LossScaleSeries:
    """Records one LossScaleOptimizer's scale from the step's own state.

    Args:
        optimizer: a (built) LossScaleOptimizer the step follows.
        step_state: the fit's `StepState` (replaced by `attach` each fit).
        capacity: events the ring holds between two reads.
    """

    # The growths are recorded by the step, not derived.
    derives_growth = False
    mode = MODE_STEP_STATE
    unknown_origin_means = KERAS_3_UNKNOWN_ORIGIN

    def __init__(self, optimizer, step_state, capacity: int):
        self.optimizer = optimizer
        self.capacity = int(capacity)
        self.dropped_events = 0
        self.origin: Origin | None = None
        self._skipped = 0  # host copy, kept across fits
        self._events_read = 0
        self._state: Any = None  # the fit's StepState
        self.attach(step_state)

    def attach(self, step_state) -> None:
        """Counts on in a new fit's step state (its ring starts empty)."""
        self._state = step_state
        self._events_read = 0
        step_state.start_skipped[id(self.optimizer)] = self._skipped

    def nothing_ran(self) -> bool:
        """Whether no train step ran this optimizer yet (read from the
        variables: called before the fit's first step)."""
        return not self.optimizer.built or (
            int(np.asarray(applied_steps(self.optimizer).value)) == 0
            and self.scale() == float(self.optimizer.initial_scale))

    def start_from(self, origin: Origin) -> None:
        self.origin = origin
        self._skipped = origin.skipped or 0
        self._state.start_skipped[id(self.optimizer)] = self._skipped

    def settings(self) -> dict:
        opt = self.optimizer
        return {
            "mode": self.mode,
            **keras_3_settings(opt),
            "buffer_capacity": self.capacity,
            "dropped_events": self.dropped_events,
            "growth_events": "recorded by the step (its scale before and after)",
        }

    def skipped_steps(self) -> int:
        if self._state.arrays is None:
            return self._skipped
        self._skipped = self._state.skipped(self.optimizer)
        return self._skipped

    def current_step(self) -> int:
        if self._state.arrays is None:
            return self.steps_given_skipped(self._skipped)
        return self._state.steps_run(self.optimizer)

    def steps_given_skipped(self, skipped: int) -> int:
        """Apply calls plus `skipped` (before the fit's state exists: from
        the variables)."""
        if self._state.arrays is None:
            return int(np.asarray(applied_steps(self.optimizer).value)) + skipped
        return self._state.applied(self.optimizer) + skipped

    def scale(self) -> float:
        if self._state.arrays is None:
            return float(np.asarray(self.optimizer.dynamic_scale.value))
        return self._state.scale(self.optimizer)

    def read(self) -> tuple[np.ndarray, np.ndarray]:
        """New events since the last read, and the progress row now."""
        count, ring = self._state.events(self.optimizer)
        new = count - self._events_read
        lost = max(0, new - self.capacity)
        self.dropped_events += lost
        new -= lost
        slots = np.arange(count - new, count) % self.capacity
        self._events_read = count
        progress = np.array([self.current_step(), self.scale(), self.skipped_steps()],
                            dtype=np.float64)
        return ring[slots], progress
