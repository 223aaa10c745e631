"""Keras 3 on JAX: the `Backend` the recording core asks
(`mpprof.backends.protocol` says what each factory's object must do).

How JAX answers it:

- the train function is `train_function(state, iterator) -> (logs, state)`
  with the state donated; the profiled one is mpprof's own jit of Keras'
  `train_step` with a small state of mpprof's beside it
  (`step_state.StepState`), which records each optimizer's overflows and
  growths (seen through its `stateless_apply`) and the loss check inside the
  step, read only at flush points;
- the optimizer updates through `stateless_apply`; the model's variables hold
  the state only at epoch ends (Keras writes it back then), so nothing reads
  them during an epoch;
- the alarm is read one call late (`call_alarm`);
- per-layer numerics run in a second jitted step that returns the statistics
  as outputs (`numerics_taps`), or, for a model with its own `train_step`,
  its step traced with taps that send them by host callbacks
  (`numerics_callbacks`);
- replay captures copy what the donated step received before it runs
  (`replay_capture`);
- float8 scales and amax histories are read at flush points from the Keras
  state the last call returned, not from the variables (`float8`); float8
  shares on sampled steps leave the instrumented step as outputs, as the
  per-layer numerics do (`float8_shares`);
- the XProf window waits for the device before it starts and stops its
  trace (`kernels`).
"""

from __future__ import annotations

from mpprof.backends.jax import (
    call_alarm,
    context,
    float8,
    float8_shares,
    hardware,
    kernels,
    replay_capture,
)
from mpprof.backends.jax.custom_step import overrides_train_step
from mpprof.backends.jax.numerics_callbacks import CallbackTaps
from mpprof.backends.jax.numerics_taps import NumericsTaps
from mpprof.backends.jax.precision_tracer import PrecisionTracer
from mpprof.backends.jax.step_state import StepState
from mpprof.backends.jax.train_functions import TrainFunctions
from mpprof.backends.keras3 import StepStateBackend
from mpprof.backends.layer_casts import LayerCallPatch
from mpprof.backends.step_state_health import LossWatch, RunHealth
from mpprof.backends.step_state_loss_scales import LossScales
from mpprof.backends.step_state_series import LossScaleSeries
from mpprof.backends.worker_role import WorkerRole


class JaxBackend(StepStateBackend):
    """What mpprof needs from Keras 3 on JAX. One instance per fit: it holds
    the fit's `StepState`."""

    name = "jax"
    step_state: StepState | None
    numerics: NumericsTaps | None
    replay: replay_capture.ReplayCapture | None
    loss_scale_series = LossScaleSeries
    loss_watch = LossWatch
    LossScales = LossScales
    RunHealth = RunHealth
    ReplayCapture = replay_capture.ReplayCapture
    TrainFunctions = TrainFunctions
    PrecisionTracer = PrecisionTracer
    LayerCallPatch = LayerCallPatch
    StepState = StepState
    run_context = staticmethod(context.run_context)
    hardware_facts = staticmethod(hardware.hardware_facts)
    profile_window = staticmethod(kernels.ProfileWindow)
    apply_method = "stateless_apply"
    # The alarm is in the logs, but read one call late (`call_alarm`).
    alarm_in_logs = False
    # keras.distribution on jax.distributed: one job, one fit per process.
    fits_across_workers = True

    def __init__(self, model):
        super().__init__(model)
        # Collectors that measure in the instrumented step (they register
        # themselves; `numerics_taps.NumericsTaps` runs them).
        self.step_taps: list = []

    @property
    def numerics_taps(self):
        """Makes the numerics taps (`NumericsSamples` calls it with the
        model and its strategy): they register with this backend."""
        return lambda model, strategy: (
            CallbackTaps if overrides_train_step(model) else NumericsTaps)(model, self)

    def CallAlarm(self, counters, host_reads_needed) -> call_alarm.CallAlarm:
        """The call alarm (a factory, as the protocol's class attributes are),
        compared from the count this fit's step state starts at."""
        return call_alarm.CallAlarm(counters, host_reads_needed, start=self._alarm_start)

    def Float8State(self, model, loss_scales) -> float8.Float8State:
        """The float8 collector (a factory, as `CallAlarm`): it reads the
        Keras state from this fit's step state."""
        return float8.Float8State(model, loss_scales, self)

    def Float8Shares(self, model, sampling: bool) -> float8_shares.Float8Shares:
        """The float8 shares collector (a factory, as `CallAlarm`): its taps
        run in this fit's instrumented step."""
        return float8_shares.Float8Shares(model, sampling, self)

    def _alarm_start(self) -> int | None:
        state = self.step_state
        return None if state is None else (sum(state.start_skipped.values())
                                           + state.start_nonfinite)

    def worker_role(self, model) -> WorkerRole:
        return context.worker_role()

    def logs_of(self, result):
        """fit calls `train_function(state, iterator)` and gets `(logs, state)`."""
        return result[0] if isinstance(result, tuple) else result

    def steps_per_execution(self, model) -> int:
        return int(getattr(model, "steps_per_execution", 1) or 1)

    def fixed_steps_per_execution(self, model) -> int | None:
        return self.steps_per_execution(model)
