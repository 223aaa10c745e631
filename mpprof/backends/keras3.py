"""What every Keras 3 backend answers alike: Keras' own optimizer,
LossScaleOptimizer, callback list and TensorBoard classes (tf-keras has its
own: `mpprof.backends.tf_keras.backend`); and what the backends whose fit
keeps its counts in mpprof's step state (JAX, PyTorch) hold alike
(`StepStateBackend`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mpprof.backends import base
from mpprof.backends.flavor import KERAS_3
from mpprof.backends.worker_role import SingleProcess


class Keras3Backend(base.Backend):
    """The `Backend` hooks that Keras 3 answers the same on every backend."""

    flavor = KERAS_3
    traceback_filters: tuple[str, ...] = ("keras.src.utils.traceback_utils",)
    # Keras 3's train steps hand their loss to the LossScaleOptimizer's
    # `scale_loss` (`OptimizerUsage` watches it).
    loss_methods: tuple[str, ...] = ("scale_loss",)

    def is_optimizer(self, value) -> bool:
        import keras

        return isinstance(value, keras.optimizers.Optimizer)

    def is_loss_scale_optimizer(self, optimizer) -> bool:
        import keras

        return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)

    @property
    def callback_list_class(self) -> type:
        import keras

        return keras.callbacks.CallbackList

    @property
    def tensorboard_class(self) -> type:
        import keras

        return keras.callbacks.TensorBoard


class StepStateBackend(Keras3Backend):
    """A Keras 3 backend whose fit counts each optimizer's steps in its own
    `StepState` (JAX: inside the jitted step; PyTorch: on the host), the
    state `step_state_loss_scales`, `step_state_series` and
    `step_state_health` read. One instance per fit: it holds the fit's step
    state, and the collectors that register themselves with it. Its fit
    runs in one process under no `tf.distribute` strategy.

    A subclass names its `StepState(usage, capacity, is_loss_scale)`.
    """

    StepState: Callable[..., Any]

    def __init__(self, model):
        self.step_state: Any = None
        self._model = model
        # The numerics collector, once the first sample made it.
        self.numerics: Any = None
        # The replay capture, while one is on (it registers itself).
        self.replay: Any = None

    def make_step_state(self, capacity: int, usage):
        """The fit's step state (made once, by the loss-scale collectors),
        following each of `usage`'s optimizers."""
        if self.step_state is None:
            self.step_state = self.StepState(usage, capacity, self.is_loss_scale_optimizer)
        return self.step_state

    def distribute_strategy(self, model):
        return SingleProcess()
