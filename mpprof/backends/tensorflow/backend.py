"""Keras 3 on TensorFlow: the `Backend` the recording core asks.

Keras 3 and tf-keras (`mpprof.backends.tf_keras.backend`) differ in where
the loss passes through the optimizer, how the loss scale is kept and what
an optimizer's update method is called; both train on TensorFlow, so the
tf-keras backend builds on this one.
"""

from __future__ import annotations

from mpprof.backends.keras3 import Keras3Backend
from mpprof.backends.tensorflow import (
    call_alarm,
    context,
    hardware,
    keras_flavors,
    kernels,
    replay_capture,
)
from mpprof.backends.tensorflow.float8 import Float8State
from mpprof.backends.tensorflow.float8_shares import Float8Shares
from mpprof.backends.tensorflow.layer_calls import LayerCallPatch
from mpprof.backends.tensorflow.loss_scale_series import LossScaleSeries
from mpprof.backends.tensorflow.loss_scales import LossScales
from mpprof.backends.tensorflow.loss_watch import LossWatch
from mpprof.backends.tensorflow.numerics_taps import NumericsTaps
from mpprof.backends.tensorflow.precision_tracer import PrecisionTracer
from mpprof.backends.tensorflow.run_health import RunHealth
from mpprof.backends.tensorflow.train_functions import TrainFunctions


class TensorFlowBackend(Keras3Backend):
    """What mpprof needs from Keras 3 on TensorFlow."""

    name = "tensorflow"
    traceback_filters = ("keras.src.utils.traceback_utils",
                         "tensorflow.python.util.traceback_utils")
    loss_scale_series = LossScaleSeries
    loss_watch = LossWatch
    numerics_taps = NumericsTaps
    # The collectors and drivers of a fit (see `base.Backend`).
    LossScales = LossScales
    RunHealth = RunHealth
    Float8State = Float8State
    Float8Shares = Float8Shares
    ReplayCapture = replay_capture.ReplayCapture
    TrainFunctions = TrainFunctions
    CallAlarm = call_alarm.CallAlarm
    PrecisionTracer = PrecisionTracer
    LayerCallPatch = LayerCallPatch
    run_context = staticmethod(context.run_context)
    hardware_facts = staticmethod(hardware.hardware_facts)
    profile_window = staticmethod(kernels.ProfileWindow)
    # The optimizer method every update of the weights goes through
    # (`OptimizerUsage` watches it).
    apply_method = "apply"
    # Whether the train step reports the call alarm in its logs
    # (`call_alarm`): Keras 3 turns every call's logs into Python numbers
    # anyway, and its loss watchers date the first non-finite loss from the
    # alarm on the host.
    alarm_in_logs = True
    # Keras 3's fit fails across workers (`mpprof.recording.distributed`).
    fits_across_workers = False
    # Where the flavour keeps the traced function behind
    # `model.train_function` (None: nowhere else; tf-keras: its own).
    traced_train_function_attribute: str | None = None

    def steps_per_execution(self, model) -> int:
        return keras_flavors.steps_per_execution(model)

    def fixed_steps_per_execution(self, model) -> int | None:
        return keras_flavors.fixed_steps_per_execution(model)
