"""A model with its own `train_step(self, state, data)` on JAX: how mpprof
tells, and where it finds the step's loss.

Keras' own step hands its unscaled loss to `_update_metrics_variables`,
where the profiled step takes it (`train_functions`). A custom step calls
`jax.value_and_grad` itself; its loss leaves that trace as a value, which a
keras.io-style step then gives to its loss metrics (`Mean` trackers named
"loss" or "..._loss", updated through `stateless_update_state`, which calls
`update_state`). mpprof wraps those metrics' `update_state` and checks the
values they receive, in the step, as it checks Keras' own loss: exact to the
step (`mpprof.backends.loss_metrics`, shared with PyTorch). A step that
updates no such metric leaves its loss unwatched (the run context says so).
"""

from __future__ import annotations


def overrides_train_step(model) -> bool:
    """Whether `model`'s `train_step` is not Keras' own JAX step."""
    from keras.src.backend.jax.trainer import JAXTrainer

    return type(model).train_step is not JAXTrainer.train_step
