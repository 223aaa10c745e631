"""The one seam between mpprof and the Keras a model belongs to.

Keras 3 (on its TensorFlow backend) and tf-keras (Keras 2) differ in where
the loss passes through the optimizer, how the loss scale is kept and what
an optimizer's update method is called. Everything mpprof's callback needs
to know about that difference is asked of a `KerasApi`; `keras_api_for`
chooses it once per fit, and no other part of the callback branches on the
flavour.

A model of another Keras backend (JAX, PyTorch) cannot be profiled yet:
`check_backend` says so before any training work.
"""

from __future__ import annotations

import os

from mpprof import tf_keras_support
from mpprof.collectors.health import LossHealthCollector
from mpprof.collectors.loss_scale import LossScaleCollector, is_loss_scale_optimizer
from mpprof.collectors.numerics import NumericsCollector
from mpprof.collectors.tf_keras_health import TfKerasLossHealthCollector
from mpprof.collectors.tf_keras_loss_scale import TfKerasLossScaleCollector
from mpprof.collectors.tf_keras_numerics import TfKerasNumericsCollector


class UnsupportedBackendError(RuntimeError):
    """Keras runs on a backend mpprof cannot profile yet."""


def check_backend() -> None:
    """Raises `UnsupportedBackendError` unless Keras 3 runs on TensorFlow.

    tf-keras always runs on TensorFlow; a tf-keras model does not depend on
    `KERAS_BACKEND`, so only Keras 3's own backend is checked.
    """
    import keras

    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise UnsupportedBackendError(
            "mpprof.MixedPrecisionProfiler needs Keras' TensorFlow backend "
            f"(KERAS_BACKEND is {os.environ.get('KERAS_BACKEND', backend)!r}). "
            "Set KERAS_BACKEND=tensorflow before importing keras, or train without "
            "the profiler."
        )


class KerasApi:
    """What mpprof needs from Keras 3 (the default flavour)."""

    flavor = tf_keras_support.KERAS_3
    loss_scale_collector = LossScaleCollector
    loss_health_collector = LossHealthCollector
    numerics_collector = NumericsCollector
    # The optimizer method every update of the weights goes through, and the
    # methods a train step hands its loss to (`OptimizerUsage` watches them).
    apply_method = "apply"
    loss_methods: tuple[str, ...] = ("scale_loss",)
    # Whether the train step reports the call alarm in its logs
    # (`mpprof.call_alarm`): Keras 3 turns every call's logs into Python
    # numbers anyway, and its loss watchers date the first non-finite loss
    # from the alarm on the host.
    alarm_in_logs = True

    def is_optimizer(self, value) -> bool:
        import keras

        return isinstance(value, keras.optimizers.Optimizer)

    def is_loss_scale_optimizer(self, optimizer) -> bool:
        return is_loss_scale_optimizer(optimizer)

    @property
    def callback_list_class(self) -> type:
        import keras

        return keras.callbacks.CallbackList

    @property
    def tensorboard_class(self) -> type:
        import keras

        return keras.callbacks.TensorBoard

    # Whether this flavour's fit runs across worker processes
    # (MultiWorkerMirroredStrategy); Keras 3's fails upstream.
    fits_across_workers = False
    # Where the flavour keeps the tf.function behind `model.train_function`,
    # which its own callbacks read (None: nowhere else).
    traced_train_function_attribute: str | None = None

    def candidate_optimizers(self, model) -> list[tuple[str, object]]:
        """The optimizers a train step may use, each with the name it is known by.

        The compiled `model.optimizer` ("optimizer") and every optimizer held
        in an attribute of the model (a GAN's `self.g_opt`, `self.d_opt`):
        which of them a step really uses is only known once it is traced
        (`mpprof.collectors.optimizers.OptimizerUsage`).
        """
        found: list[tuple[str, object]] = []
        if self.is_optimizer(model.optimizer):
            found.append(("optimizer", model.optimizer))
        for name, value in sorted(vars(model).items()):
            if (self.is_optimizer(value) and not name.startswith("_")
                    and all(value is not known for _, known in found)):
                found.append((name, value))
        return found


class TfKerasApi(KerasApi):
    """What differs for a tf-keras (Keras 2) model."""

    flavor = tf_keras_support.TF_KERAS
    loss_scale_collector = TfKerasLossScaleCollector
    loss_health_collector = TfKerasLossHealthCollector
    numerics_collector = TfKerasNumericsCollector
    # Every tf-keras update goes through `apply_gradients` (`minimize` calls
    # it). tf-keras optimizers have no `scale_loss`: its train step hands the
    # loss to `minimize`, a custom step to a LossScaleOptimizer's
    # `get_scaled_loss` (which `minimize` calls in turn).
    apply_method = "apply_gradients"
    loss_methods = ("minimize", "get_scaled_loss")
    # tf-keras need not wait for a call's logs, and its loss watchers keep
    # the first non-finite step in-graph: no alarm in the logs.
    alarm_in_logs = False

    fits_across_workers = True
    # tf-keras's TensorBoard(write_graph=True) writes this function's graph.
    traced_train_function_attribute = "train_tf_function"

    def is_optimizer(self, value) -> bool:
        return tf_keras_support.is_optimizer(value)

    def is_loss_scale_optimizer(self, optimizer) -> bool:
        return tf_keras_support.is_loss_scale_optimizer(optimizer)

    @property
    def callback_list_class(self) -> type:
        return tf_keras_support.tf_keras_module().callbacks.CallbackList

    @property
    def tensorboard_class(self) -> type:
        return tf_keras_support.tf_keras_module().callbacks.TensorBoard


def keras_api_for(model) -> KerasApi:
    """The `KerasApi` of the Keras `model` belongs to."""
    return TfKerasApi() if tf_keras_support.is_tf_keras(model) else KerasApi()
