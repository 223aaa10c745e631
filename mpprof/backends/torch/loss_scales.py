"""The loss scale of every LossScaleOptimizer a PyTorch train step uses, one
series each: the JAX backend's collector (`mpprof.backends.step_state_loss_scales`,
shared), over the step's host counters
(`mpprof.backends.torch.step_state`), whose interface is JAX's step state's.
"""

from __future__ import annotations

from mpprof.backends.optimizer_usage import applied_steps
from mpprof.backends.step_state_loss_scales import LossScales
from mpprof.backends.torch.step_state import host_value


class TorchLossScales(LossScales):
    """As `mpprof.backends.step_state_loss_scales.LossScales`; an optimizer's steps
    before the fit's first are read from its variables, wherever they live."""

    def step_of(self, use) -> int | None:
        state = self._step_state
        if (state.arrays is None and state.follows(use.optimizer)
                and use.name not in self.by_name):
            return int(host_value(applied_steps(use.optimizer)))
        return super().step_of(use)
