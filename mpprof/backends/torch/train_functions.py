"""The train function of a profiled PyTorch fit, and how each call runs.

Keras' PyTorch `fit` calls `model.train_function(data)` once per step (it
refuses `steps_per_execution > 1`) and gets the logs; the function runs
`train_step` eagerly (or under `torch.compile` with `jit_compile=True`).
While a fit is profiled, `model.train_function` is the profiler's
dispatcher, which calls Keras' own function: every step runs Keras' code.
The step state (`step_state`) counts as the step runs; around each call it
is told where a step begins and ends (to keep the step's loss).

A sampled call is the same function with the layer wrappers' hooks switched
on (`layer_calls.LayerCallPatch.active`): the numerics taps measure as the
step runs (`numerics_taps`), so its weights and updates are those of a plain
step. The first call runs with them on too: it fills the precision
inventory. A forensic sample is of the call after the overflowed step, as
on TensorFlow (the host knows of an overflow as soon as the step returns).
"""

from __future__ import annotations

from collections.abc import Callable

from mpprof.backends.patching import Patches
from mpprof.backends.torch.custom_step import watch_loss_metrics
from mpprof.backends.torch.step_state import StepState
from mpprof.backends.traced_guard import describe_error


class TrainFunctions:
    """Makes and runs the profiled train function.

    Args:
        model: the model, whose `train_function` fit made just before.
        backend: the model's `mpprof.backends.torch.backend.TorchBackend`.
        instrumented: whether per-layer numerics were asked for.
    """

    def __init__(self, model, backend, instrumented: bool):
        self._model = model
        self._backend = backend
        self.plain: Callable | None = None
        # The same function, run with the layer hooks on (a marker for the core).
        self.instrumented: Callable | None = None
        self._wants_instrumented = bool(instrumented)
        self.instrumented_off: str | None = None
        self.replayed = None  # (samples are always of the call's own step)
        self._state: StepState | None = None
        self._first = True

    def install(self, dispatcher: Callable, patches: Patches) -> None:
        """Starts the step state and puts `dispatcher` in `model.train_function`
        (undone by `patches.restore`)."""
        model = self._model
        state = self._state = self._backend.step_state
        state.install(patches)
        state.start()
        watch_loss_metrics(model, state, patches)
        if model.train_function is None:
            model.make_train_function()
        self.plain = model.train_function
        if self._backend.layer_patch is not None:
            self._backend.layer_patch.active = False  # on for the calls that need it
        if self._wants_instrumented:
            if getattr(model, "jit_compile", False):
                self.instrumented_off = (
                    "jit_compile=True: the step runs under torch.compile, whose graph "
                    "the layer hooks would break; per-layer numerics need jit_compile=False")
            else:
                self.instrumented = self.plain
        patches.set(model, "train_function", dispatcher)

    def run_plain(self, data, *, on_abort: Callable[[], None]):
        """Runs one call (one step); returns its logs."""
        state = self._state
        state.begin_step()
        if self._first:
            self._first = False
            return self._hooked(data, on_abort)
        try:
            logs = self.plain(data)
        except BaseException:
            on_abort()
            raise
        state.end_step()
        return logs

    def _hooked(self, data, on_abort):
        patch = self._backend.layer_patch
        if patch is not None:
            patch.active = True
        try:
            logs = self.plain(data)
        except BaseException:
            on_abort()
            raise
        finally:
            if patch is not None:
                patch.active = False
        self._state.end_step()
        return logs

    def run_instrumented(self, data, *, on_abort: Callable[[], None],
                         on_failure: Callable[[str], None], forensic: bool = False):
        """Runs one sampled call: the plain function with the layer hooks on,
        then hands the sample to the numerics collector."""
        self._state.begin_step()
        self._first = False
        numerics = self._backend.numerics
        numerics.begin_sample()
        replay = self._backend.replay  # the replay capture, when one is on
        if replay is not None:
            replay.before_sampled(data)
        logs = self._hooked(data, on_abort)
        if replay is not None:
            replay.after_sampled()
        try:
            numerics.end_sample()
        except Exception as error:  # noqa: BLE001 - mpprof's failure must not stop fit
            self.instrumented = None
            on_failure(f"the numerics sample failed: {describe_error(error)}")
        return logs

    def release(self) -> None:
        self.plain = self.instrumented = None
