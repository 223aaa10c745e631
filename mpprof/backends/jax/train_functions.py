"""The train function of a profiled JAX fit, and how each call runs.

Keras' JAX `fit` calls `model.train_function(state, iterator)` and gets
`(logs, state)`; the function it made before `on_train_begin` jits
`train_step` with the state donated and, under `steps_per_execution=N`,
calls it N times from Python. While a fit is profiled, `model.train_function`
is the profiler's dispatcher, which runs mpprof's own jit of the same
`train_step` (`StepState.step_function`: the model's step plus mpprof's
counters, which leave it as a second donated state) the same way, so every
step runs one compiled function, as in Keras' own fit.

On sampled calls the dispatcher runs the instrumented function instead: the
numerics collector's `instrumented_train_step` (`mpprof.backends.jax.numerics_taps`)
in the same wrapper, jitted on its first sampled call, for the call's first
step; the call's other steps (`steps_per_execution > 1`) run plain.

A forensic sample (armed by an overflow) would come a call or more late:
fit dispatches ahead and the call alarm is read only once its step is done
(`call_alarm`). So the dispatcher keeps the last `KEPT_BATCHES` batches (fit
donates the state, never the data) and, when a forensic sample is due, reads
the step table (a sampled call waits for the device anyway), picks the
overflowed step whose batch is still kept, and evaluates the instrumented
step on that batch with the current state in a second jit that donates
nothing; only its numerics sample is kept (its state, step table and metrics
are dropped, so training and mpprof's counts are those of the plain run).
The call itself runs plain.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from mpprof.backends.jax.custom_step import overrides_train_step
from mpprof.backends.jax.numerics_taps import SAMPLE_KEY
from mpprof.backends.loss_metrics import watch_loss_metrics
from mpprof.backends.patching import Patches
from mpprof.backends.traced_guard import describe_error

# Batches kept for a forensic sample: past the host's usual lag behind the
# device (a few calls; the alarm is read at most every few ms).
KEPT_BATCHES = 8


class _Lazy:
    """The instrumented function before its first sampled call builds it."""


@dataclass
class ReplayedSample:
    """A forensic sample evaluated on an earlier, overflowed step's batch.

    Attributes:
        step: the overflowed step whose batch was evaluated.
        state_of_step: the step whose state (weights, loss scale) it ran
            with: the sampled call's.
        weights_of_step: the step whose weights those are: `step` when every
            step since was skipped (the weights it saw), else `state_of_step`.
    """

    step: int
    state_of_step: int
    weights_of_step: int

    def note(self) -> dict:
        return {"step": self.step, "state_of_step": self.state_of_step,
                "weights_of_step": self.weights_of_step}


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
        self.plain: Callable[..., Any] | None = None
        # Built at the first sampled call, once the numerics collector exists.
        self.instrumented: Any = _Lazy() if instrumented else None
        self.instrumented_off: str | None = None
        self._instrumented_ran = False
        self._state: Any = None  # the fit's StepState
        # Steps per call, fixed when Keras made its function before the fit.
        self._steps = 1
        # The last batches, as (index among the fit's batches, batch).
        self._kept: deque = deque(maxlen=KEPT_BATCHES)
        self._batches = 0  # batches run so far: the next one's index
        # The indices of the kept batches sampled as they ran: a forensic
        # sample does not evaluate them again (their values are recorded).
        self._sampled_indices: deque = deque(maxlen=KEPT_BATCHES)
        # The instrumented step without donation (built at its first need).
        self._detached: Callable[..., Any] | None = None
        self._sampled_through = -1  # the newest overflowed step sampled
        # The last sampled call's sample, when it was of an earlier step.
        self.replayed: ReplayedSample | None = None

    def install(self, dispatcher: Callable, patches: Patches) -> None:
        """Makes the profiled step and puts `dispatcher` in
        `model.train_function` (undone by `patches.restore`)."""
        model = self._model
        self._state = self._api.step_state
        self._state.install(patches)
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
        if overrides_train_step(model):
            # Its own step: its loss reaches its loss metrics instead.
            watch_loss_metrics(model, self._state, patches)
        # Read now: during an epoch Keras' state lives outside the variables.
        self._shardings = self._out_shardings()
        self.plain = self._compiled(model.train_step)
        self._steps = int(getattr(model, "steps_per_execution", 1) or 1)
        patches.set(model, "train_function", dispatcher)

    def _keep(self, data) -> None:
        self._kept.append((self._batches, data))
        self._batches += 1

    def _compiled(self, train_step: Callable, donate: bool = True) -> Callable:
        """`train_step` with the step state, jitted as Keras jits its own
        (without `donate`: its inputs stay valid)."""
        step = self._state.step_function(train_step)
        if self._model.run_eagerly or not self._model.jit_compile:
            return step
        return jax.jit(step, donate_argnums=(0, 1) if donate else (),
                       out_shardings=self._shardings)

    def _out_shardings(self):
        """As Keras' own step: the state keeps the distribution's layout."""
        import keras

        if keras.distribution.distribution() is None:
            return None
        return (None, self._model._get_state_sharding_spec(), None)

    def run_plain(self, state, iterator, *, on_abort: Callable[[], None]):
        """Runs one call (`steps_per_execution` steps); returns (logs, state).
        Most calls: one step, the least Python between Keras and the jit."""
        if self._steps != 1:
            return self._run(self.plain, state, iterator, None, on_abort)
        step_state = self._state
        try:
            data = next(iterator)
            self._keep(data)
            logs, state, step_state.arrays = self.plain(state, step_state.arrays, data)
            step_state.keras_state = state
        except StopIteration:
            raise  # the end of the data: fit ends the epoch
        except BaseException:
            on_abort()
            raise
        return logs, state

    def _run(self, first_step: Callable, state, iterator, data, on_abort):
        """The call's first step with `first_step` (on `data`, or the next
        batch), the others plain, as Keras' own loop."""
        table = self._state.arrays
        try:
            if data is None:
                data = next(iterator)
            self._keep(data)
            logs, state, table = first_step(state, table, data)
            for _ in range(self._steps - 1):
                try:
                    data = next(iterator)
                except StopIteration:
                    break  # the epoch's last, partial call
                self._keep(data)
                sample = logs.pop(SAMPLE_KEY, None) if isinstance(logs, dict) else None
                logs, state, table = self.plain(state, table, data)
                if sample is not None:
                    logs[SAMPLE_KEY] = sample
        except StopIteration:
            raise  # the end of the data: fit ends the epoch
        except BaseException:
            on_abort()
            raise
        self._state.update(table, state)
        return logs, state

    def run_instrumented(self, state, iterator, *, on_abort: Callable[[], None],
                         on_failure: Callable[[str], None], forensic: bool = False):
        """Runs one sampled call and hands its sample to the numerics
        collector. If the instrumented function fails on its first run (as
        it is traced, before any state is donated), it is dropped
        (`on_failure` gets the reason) and the plain one runs instead.
        `forensic`: sample the overflowed step whose batch is kept, if any
        (`replayed` then says which)."""
        self.replayed = None
        if forensic:
            found = self._overflowed_batch()
            if found is not None:
                return self._run_replayed(state, iterator, *found, on_abort=on_abort,
                                          on_failure=on_failure)
        numerics = self._api.numerics
        data = next(iterator)  # (StopIteration: the end of the data)
        self._sampled_indices.append(self._batches)  # `_run` keeps it under this index
        replay = self._api.replay  # the replay capture, when one is on
        if replay is not None:
            replay.before_sampled(state, self._state.arrays, data)
        try:
            if isinstance(self.instrumented, _Lazy):
                self.instrumented = self._compiled(numerics.instrumented_train_step)
            # Its first run must not end the profiling if it fails: the plain
            # step then runs this call (and raises the user's own errors).
            logs, state = self._run(self.instrumented, state, iterator, data,
                                    on_abort if self._instrumented_ran else (lambda: None))
        except Exception as error:
            if self._instrumented_ran:
                raise  # (on_abort ran)
            self.instrumented = None
            # Said only once the plain step ran: when it raises too, the error
            # is the user's and the fit fails (no "training goes on").
            result = self._run(self.plain, state, iterator, data, on_abort)
            on_failure(f"the instrumented train step failed: {describe_error(error)}")
            return result
        self._instrumented_ran = True
        numerics.receive(logs.pop(SAMPLE_KEY))
        if replay is not None:
            replay.after_sampled(state)
        return logs, state

    def _overflowed_batch(self) -> tuple[ReplayedSample, object] | None:
        """The overflowed step to sample and its batch: the first of the
        newest run of consecutive overflowed steps whose batches are kept
        (where the trouble began: a burst's later steps inherit it); None:
        no batch of a new overflow is kept."""
        found = self._state.primary_overflows()
        if found is None or not self._kept:
            return None
        current, overflowed = found
        # Each batch is one step of the primary optimizer: the table counts
        # the steps of every batch run so far.
        behind = self._kept[-1][0] + 1
        kept = {current - (behind - index): data for index, data in self._kept}
        sampled = {current - (behind - index) for index in self._sampled_indices}
        new = {s for s in overflowed
               if s > self._sampled_through and s not in sampled and s in kept}
        if not new:
            return None
        step = self._sampled_through = max(new)
        while step - 1 in new:
            step -= 1
        # Every step from it on skipped: the current weights are those it saw.
        exact = all(t in overflowed for t in range(step, current))
        return ReplayedSample(step, current, step if exact else current), kept[step]

    def _run_replayed(self, state, iterator, sample: ReplayedSample, data, *,
                      on_abort: Callable[[], None], on_failure: Callable[[str], None]):
        """Evaluates the instrumented step on an earlier step's `data` with
        the current state, keeping its sample only; runs the call plain."""
        numerics = self._api.numerics
        table = self._state.arrays
        replay = self._api.replay
        if replay is not None:
            replay.before_sampled(state, table, data, step=sample.step)
        try:
            if self._detached is None:
                self._detached = self._compiled(numerics.instrumented_train_step,
                                                donate=False)
            logs, after, after_table = self._detached(state, table, data)
        except Exception as error:  # noqa: BLE001 - mpprof's failure must not stop fit
            # Nothing was donated: the plain step runs the call either way.
            self.instrumented = self._detached = None
            result = self._run(self.plain, state, iterator, None, on_abort)
            on_failure(f"the instrumented train step failed: {describe_error(error)}")
            return result
        numerics.receive(logs[SAMPLE_KEY])
        if replay is not None:
            replay.after_sampled(after, after_table)
        self.replayed = sample
        return self._run(self.plain, state, iterator, None, on_abort)

    def release(self) -> None:
        self.plain = self.instrumented = self._detached = None
        self._kept.clear()
        if self._state is not None:
            self._state.keras_state = None
