"""What every Keras 3 backend answers alike: Keras' own optimizer, callback
list and TensorBoard classes (tf-keras has its own:
`mpprof.backends.tf_keras.backend`)."""

from __future__ import annotations

from mpprof.backends import base
from mpprof.backends.flavor import KERAS_3


class Keras3Backend(base.Backend):
    """The `Backend` hooks that Keras 3 answers the same on every backend."""

    flavor = KERAS_3
    traceback_filters: tuple[str, ...] = ("keras.src.utils.traceback_utils",)

    def is_optimizer(self, value) -> bool:
        import keras

        return isinstance(value, keras.optimizers.Optimizer)

    @property
    def callback_list_class(self) -> type:
        import keras

        return keras.callbacks.CallbackList

    @property
    def tensorboard_class(self) -> type:
        import keras

        return keras.callbacks.TensorBoard
