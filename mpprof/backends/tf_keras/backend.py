"""tf-keras (Keras 2) models: the `Backend` the recording core asks."""

from __future__ import annotations

from mpprof.backends.flavor import TF_KERAS
from mpprof.backends.tensorflow.backend import TensorFlowBackend
from mpprof.backends.tf_keras import support
from mpprof.backends.tf_keras.loss_scale_series import TfKerasLossScaleSeries
from mpprof.backends.tf_keras.loss_watch import TfKerasLossWatch
from mpprof.backends.tf_keras.numerics_taps import TfKerasNumericsTaps


class TfKerasBackend(TensorFlowBackend):
    """What differs for a tf-keras (Keras 2) model."""

    flavor = TF_KERAS
    loss_scale_series = TfKerasLossScaleSeries
    loss_watch = TfKerasLossWatch
    numerics_taps = TfKerasNumericsTaps
    # Every tf-keras update goes through `apply_gradients` (`minimize` calls
    # it). tf-keras optimizers have no `scale_loss`: its train step hands the
    # loss to `minimize`, a custom step to a LossScaleOptimizer's
    # `get_scaled_loss` (which `minimize` calls in turn).
    apply_method = "apply_gradients"
    loss_methods = ("minimize", "get_scaled_loss")
    # tf-keras need not wait for a call's logs, and its loss watchers keep
    # the first non-finite step in-graph: no alarm in the logs.
    alarm_in_logs = False
    traceback_filters = ("tf_keras.src.utils.traceback_utils",
                         "tensorflow.python.util.traceback_utils")

    fits_across_workers = True
    # tf-keras's TensorBoard(write_graph=True) writes this function's graph.
    traced_train_function_attribute = "train_tf_function"

    def is_optimizer(self, value) -> bool:
        return support.is_optimizer(value)

    def is_loss_scale_optimizer(self, optimizer) -> bool:
        return support.is_loss_scale_optimizer(optimizer)

    @property
    def callback_list_class(self) -> type:
        return support.tf_keras_module().callbacks.CallbackList

    @property
    def tensorboard_class(self) -> type:
        return support.tf_keras_module().callbacks.TensorBoard
