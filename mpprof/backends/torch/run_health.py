"""The HEALTH record on PyTorch: is the loss finite, are the weights finite.

The loss is checked from the step's host counters
(`mpprof.backends.torch.step_state`: every step's loss kept and checked at
the next read, exact to the step), so the collector and the loss watch are
the JAX backend's (`mpprof.backends.step_state_health`, shared; the weight
check is each backend's). The weights are checked at epoch ends and when fit ends:
on PyTorch the variables hold them at all times.
"""

from __future__ import annotations

import torch

from mpprof.backends import step_state_health
from mpprof.backends.layer_records import variable_path
from mpprof.backends.step_state_health import LossWatch

__all__ = ["LossWatch", "RunHealth"]


class RunHealth(step_state_health.RunHealth):
    """The loss watch of the step, and the weight check (arguments: as
    `mpprof.backends.tensorflow.run_health.RunHealth`)."""

    def context(self) -> dict:
        entry = super().context()
        if entry.get("state") == "ok":
            entry["loss_checked"] = ("every step's loss, checked at the next read "
                                     "(exact to the step)")
        elif not self._unfollowed_scales():
            entry["reason"] = (
                "the train step handed no loss to a loss metric (Keras' own step hands "
                "it to the 'loss' tracker; a custom train_step to metrics named 'loss' "
                "or '..._loss'): the loss is not watched")
        return entry

    def check_weights(self, model) -> None:
        found = []
        with torch.no_grad():
            for weight in model.weights:
                value = weight.value
                if not value.is_floating_point():
                    continue
                if not bool(torch.isfinite(value).all()):
                    found.append(variable_path(weight))
        self.nonfinite_weights = found
