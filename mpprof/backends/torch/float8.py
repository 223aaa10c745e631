"""The float8 layers' delayed scaling on PyTorch: scales, amax history, clipping.

Keras' float8 layers keep each scale and amax history in a variable; on
PyTorch the variables hold the current values at all times (the step runs
eagerly on them), so the collector reads them at flush points, in one copy
to the host. The replay of the steps between two flushes is the shared one
(`mpprof.backends.float8_replay`).
"""

from __future__ import annotations

import numpy as np
import torch

from mpprof.backends.float8_replay import DelayedScalingState
from mpprof.backends.patching import Patches


class Float8State(DelayedScalingState):
    """Records the float8 layers' scales and amax histories at each flush
    (arguments: as `mpprof.backends.float8_replay.DelayedScalingState`)."""

    def install(self, fit, patches: Patches) -> None:
        if self._layers:
            self._start(fit)

    def _read(self) -> list[tuple[float, np.ndarray]] | None:
        with torch.no_grad():
            values = [variable.value.detach().to("cpu", torch.float64).numpy()
                      for pair in self._variables for variable in pair]
        return [(float(values[i].reshape(-1)[0]), values[i + 1].reshape(-1))
                for i in range(0, len(values), 2)]
