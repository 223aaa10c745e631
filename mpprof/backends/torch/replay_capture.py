"""Replay captures on PyTorch: not taken yet.

On TensorFlow and JAX a sampled step that overflowed or lost its loss is
saved (its batch and weights) for `mpprof replay`, which ranks the layers by
what computing each in float32 changes. PyTorch has no replay engine yet
(an op-by-op replay through a `TorchDispatchMode` is the plan): the
collector says so in the run context when captures were asked for.
"""

from __future__ import annotations

from mpprof.backends.collector import Collector


class ReplayCapture(Collector):
    """Takes no capture on PyTorch; says why (arguments: as
    `mpprof.backends.jax.replay_capture.ReplayCapture`)."""

    name = "replay_capture"

    def __init__(self, budget: int, backend, loss_scales, health, instrumenting,
                 **settings):
        self.budget = budget

    def wrap_train_step(self, fit, patches) -> None:
        """(Nothing to wrap.)"""

    def context(self) -> dict:
        if self.budget == 0:
            return {"state": "off", "reason": "replay_budget=0", "budget": 0}
        return {"state": "unavailable", "budget": self.budget, "reason": (
            "replay captures are not taken on PyTorch yet (no replay engine replays a "
            "PyTorch step); train on TensorFlow or JAX to capture a step for "
            "`mpprof replay`")}
