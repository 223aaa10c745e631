"""Where a PyTorch train step hands over its loss: Keras' own step gives its
unscaled loss to `model._loss_tracker` (a `Mean` named "loss"); a keras.io
style custom `train_step` gives its losses to trackers named "loss" or
"..._loss". mpprof wraps every such metric's `update_state` and hands the
value to the step state, as on JAX (`mpprof.backends.loss_metrics`, shared: on
PyTorch it wraps Keras' own step's tracker too). A step that updates no such
metric leaves its loss unwatched (the run context says so).
"""

from __future__ import annotations

from mpprof.backends.loss_metrics import watch_loss_metrics

__all__ = ["overrides_train_step", "watch_loss_metrics"]


def overrides_train_step(model) -> bool:
    """Whether `model`'s `train_step` is not Keras' own PyTorch step."""
    from keras.src.backend.torch.trainer import TorchTrainer

    return type(model).train_step is not TorchTrainer.train_step

