"""The loss scale of a Keras 3 LossScaleOptimizer on PyTorch, exact to the step.

The step's host counters (`mpprof.backends.torch.step_state`) hold each
overflow and growth in the optimizer's ring, in the JAX backend's layout, so
the series is JAX's (`mpprof.backends.step_state_series`, shared); only its
reads of the variables before the fit's first step differ: a PyTorch variable
may live on a GPU.
"""

from __future__ import annotations

from mpprof.backends import step_state_series
from mpprof.backends.optimizer_usage import applied_steps
from mpprof.backends.torch.step_state import host_value


class LossScaleSeries(step_state_series.LossScaleSeries):
    """Records one LossScaleOptimizer's scale from the step's host counters
    (arguments: as `mpprof.backends.step_state_series.LossScaleSeries`)."""

    mode = "host_counters"

    def nothing_ran(self) -> bool:
        return not self.optimizer.built or (
            host_value(applied_steps(self.optimizer)) == 0
            and self.scale() == float(self.optimizer.initial_scale))

    def steps_given_skipped(self, skipped: int) -> int:
        if self._state.arrays is None:
            return int(host_value(applied_steps(self.optimizer))) + skipped
        return self._state.applied(self.optimizer) + skipped

    def scale(self) -> float:
        if self._state.arrays is None:
            return host_value(self.optimizer.dynamic_scale)
        return self._state.scale(self.optimizer)

    def settings(self) -> dict:
        return {**super().settings(),
                "growth_events": "recorded as the step runs (Keras' growth rule, on the host)"}
