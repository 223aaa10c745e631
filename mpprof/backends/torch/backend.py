"""Keras 3 on PyTorch: the `Backend` the recording core asks.

What differs from TensorFlow (`mpprof.backends.tensorflow.backend`) and JAX
(`mpprof.backends.jax.backend`):

- the train function is `train_function(data) -> logs`, called once per step
  (Keras refuses `steps_per_execution > 1` on PyTorch), running `train_step`
  eagerly; the profiled one calls it from mpprof's dispatcher
  (`train_functions`);
- there is nothing to trace: a LossScaleOptimizer decides in Python whether
  its update is applied, so each overflow and growth, the skipped steps and
  the scale are counted on the host as the step runs (`step_state`, in the
  JAX step state's layout: the loss-scale series and the loss watch are
  JAX's), and each step's loss is checked at the next read, exact to the
  step, with no wait per step;
- the call alarm is that host count (`call_alarm`);
- the layer wrappers run on every step, their hooks only on the first call
  (the precision inventory) and on sampled calls (the per-layer numerics:
  tensor hooks on the layers' outputs, `numerics_taps`);
- float8 scales and amax histories are read from the variables, which hold
  them at all times (`float8`); a sampled step that went wrong is captured
  for `mpprof replay` (`replay_capture`; the replay engine is
  `replay_engine`, a `TorchDispatchMode` watching every aten op); float8
  shares and the profile window are not taken yet, and the run context says
  so (`float8_shares`, `kernels`).
"""

from __future__ import annotations

from mpprof.backends.keras3 import StepStateBackend
from mpprof.backends.torch import (
    call_alarm,
    context,
    float8,
    float8_shares,
    hardware,
    kernels,
    replay_capture,
)
from mpprof.backends.torch.layer_calls import LayerCallPatch
from mpprof.backends.torch.loss_scale_series import LossScaleSeries
from mpprof.backends.torch.loss_scales import TorchLossScales
from mpprof.backends.torch.numerics_taps import NumericsTaps
from mpprof.backends.torch.precision_tracer import PrecisionTracer
from mpprof.backends.torch.run_health import LossWatch, RunHealth
from mpprof.backends.torch.step_state import StepState
from mpprof.backends.torch.train_functions import TrainFunctions


class TorchBackend(StepStateBackend):
    """What mpprof needs from Keras 3 on PyTorch. One instance per fit: it
    holds the fit's `StepState`, layer patch and numerics collector."""

    name = "torch"
    step_state: StepState | None
    numerics: NumericsTaps | None
    replay: replay_capture.ReplayCapture | None
    loss_scale_series = LossScaleSeries
    loss_watch = LossWatch
    LossScales = TorchLossScales
    RunHealth = RunHealth
    Float8State = float8.Float8State
    Float8Shares = float8_shares.Float8Shares
    ReplayCapture = replay_capture.ReplayCapture
    TrainFunctions = TrainFunctions
    PrecisionTracer = PrecisionTracer
    StepState = StepState
    run_context = staticmethod(context.run_context)
    hardware_facts = staticmethod(hardware.hardware_facts)
    profile_window = staticmethod(kernels.ProfileWindow)
    # Keras' PyTorch step applies through `apply` (`OptimizerUsage` watches it).
    apply_method = "apply"
    alarm_in_logs = False
    fits_across_workers = False

    def __init__(self, model):
        super().__init__(model)
        # The layer wrappers (their hooks run while `active`), once made (it
        # registers itself here).
        self.layer_patch: LayerCallPatch | None = None

    @property
    def numerics_taps(self):
        """Makes the numerics taps (`NumericsSamples` calls it with the
        model and its strategy): they register with this backend."""
        return lambda model, strategy: NumericsTaps(model, self)

    def LayerCallPatch(self, model, hooks) -> LayerCallPatch:
        """The layer wrappers (a factory, as the protocol's class attributes
        are): the train functions switch their hooks on and off."""
        return LayerCallPatch(model, hooks, self)

    def CallAlarm(self, counters, host_reads_needed) -> call_alarm.CallAlarm:
        """The call alarm: this fit's count of skipped steps."""
        return call_alarm.CallAlarm(counters, host_reads_needed, self._skipped)

    def _skipped(self) -> int | None:
        """Skipped steps so far (before the fit's first step: those its
        counts start from, so that an overflow in the first step rings)."""
        state = self.step_state
        if state is None:
            return None
        if state.arrays is None:
            return sum(state.start_skipped.values())
        return state.all_skipped()

    def steps_per_execution(self, model) -> int:
        return 1

    def fixed_steps_per_execution(self, model) -> int | None:
        return 1
