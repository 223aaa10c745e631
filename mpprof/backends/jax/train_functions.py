"""The train function of a profiled JAX fit, and how each call runs.

Keras' JAX `fit` calls `model.train_function(state, iterator)` and gets
`(logs, state)`; the function it made before `on_train_begin` jits
`train_step` with the state donated and, under `steps_per_execution=N`,
calls it N times from Python. While a fit is profiled, `model.train_function`
is the profiler's dispatcher, which runs mpprof's own jit of the same
`train_step` (`StepState.step_function`: the model's step plus mpprof's
counters, which leave it as a second donated state) the same way, so every
step runs one compiled function, as in Keras' own fit.

Per-layer numerics are not measured on JAX yet: there is no instrumented
function, and `instrumented_off` says why (the run context's numerics state).
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from mpprof.recording.patching import Patches

NUMERICS_UNAVAILABLE = (
    "per-layer numerics are not implemented on the JAX backend yet: no step is "
    "sampled (the loss scale, overflows, the loss check and the inventory are recorded)"
)


class TrainFunctions:
    """Makes and runs the profiled train function.

    Args:
        model: the model, whose `train_function` fit made just before.
        keras_api: the model's `mpprof.backends.jax.backend.JaxBackend`.
        instrumented: whether per-layer numerics were asked for.
    """

    def __init__(self, model, keras_api, instrumented: bool):
        self._model = model
        self._api = keras_api
        self.plain = None
        self.instrumented = None
        self.instrumented_off: str | None = NUMERICS_UNAVAILABLE if instrumented else None
        self._state = None

    def install(self, dispatcher: Callable, patches: Patches) -> None:
        """Makes the profiled step and puts `dispatcher` in
        `model.train_function` (undone by `patches.restore`)."""
        model = self._model
        self._state = self._api.step_state
        self._state.start()
        update_metrics = getattr(model, "_update_metrics_variables", None)
        if callable(update_metrics):
            state = self._state

            def update_metrics_variables(metrics_variables, unscaled_loss, *args, **kwargs):
                # Keras' train_step hands the step's unscaled loss here,
                # outside the gradient trace: the loss check reads it.
                state.capture_loss(unscaled_loss)
                return update_metrics(metrics_variables, unscaled_loss, *args, **kwargs)

            patches.set(model, "_update_metrics_variables", update_metrics_variables)
        step = self._state.step_function(model.train_step)
        if model.run_eagerly or not model.jit_compile:
            self.plain = step
        else:
            self.plain = jax.jit(step, donate_argnums=(0, 1),
                                 out_shardings=self._out_shardings())
        patches.set(model, "train_function", dispatcher)

    def _out_shardings(self):
        """As Keras' own step: the state keeps the distribution's layout."""
        import keras

        if keras.distribution.distribution() is None:
            return None
        return (None, self._model._get_state_sharding_spec(), None)

    def run_plain(self, state, iterator, *, on_abort: Callable[[], None]):
        """Runs one call (`steps_per_execution` steps); returns (logs, state)."""
        step, table = self.plain, self._state.arrays
        try:
            logs, state, table = step(state, table, next(iterator))
            for _ in range(self._model.steps_per_execution - 1):
                try:
                    data = next(iterator)
                except StopIteration:
                    break  # the epoch's last, partial call
                logs, state, table = step(state, table, data)
        except StopIteration:
            raise  # the end of the data: fit ends the epoch
        except BaseException:
            on_abort()
            raise
        self._state.update(table)
        return logs, state

    def run_instrumented(self, state, iterator, *, on_abort, on_failure):
        return self.run_plain(state, iterator, on_abort=on_abort)

    def release(self) -> None:
        self.plain = self.instrumented = None
