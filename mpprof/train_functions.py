"""The two traced train functions of a profiled fit, and which one runs.

Keras traces `model.train_function` lazily, at its first call. While a fit is
profiled, `model.train_function` is the profiler's own dispatcher, which runs
one of two functions made by `model.make_train_function(force=True)`: the
plain one (the model's own step, plus mpprof's always-on hooks: the
loss-scale counters and the loss check) on most steps, and the instrumented
one (the same step with the numerics taps switched on) on sampled steps. An
unsampled step costs nothing more than the plain function.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from mpprof.guard import describe_error
from mpprof.patching import Patches


class TrainFunctions:
    """Makes and runs the plain and the instrumented train function.

    Args:
        model: the model, whose `train_function` fit made just before.
        keras_api: the model's `mpprof.keras_api.KerasApi`.
        instrumented: whether to make the instrumented function at all.
    """

    def __init__(self, model, keras_api, instrumented: bool):
        self._model = model
        self._api = keras_api
        self._want_instrumented = instrumented
        self.plain = None
        self.instrumented = None
        self._instrumented_ran = False

    def install(self, dispatcher: Callable, patches: Patches) -> None:
        """Makes both functions and puts `dispatcher` in `model.train_function`
        (through `patches`: the model's own function comes back at the end).

        Call after every patch that must be traced into the step.
        """
        model = self._model
        original = model.train_function
        traced_attribute = self._api.traced_train_function_attribute
        original_traced = getattr(model, traced_attribute) if traced_attribute else None
        model.make_train_function(force=True)
        self.plain = model.train_function
        plain_traced = getattr(model, traced_attribute) if traced_attribute else None
        if self._want_instrumented:
            model.make_train_function(force=True)
            self.instrumented = model.train_function
        model.train_function = original
        patches.set(model, "train_function", dispatcher)
        if traced_attribute:
            # The flavour's own callbacks read the plain function (traced first).
            setattr(model, traced_attribute, original_traced)
            patches.set(model, traced_attribute, plain_traced)

    def run_plain(self, iterator, *, on_abort: Callable[[], None]):
        """Runs one call of the plain function (most steps: the least Python
        that keeps `on_abort` before the user's own error)."""
        try:
            return self.plain(iterator)
        except (StopIteration, tf.errors.OutOfRangeError):
            raise  # the end of the data: fit ends the epoch
        except BaseException:
            on_abort()
            raise

    def run_instrumented(self, iterator, *, on_abort: Callable[[], None],
                         on_failure: Callable[[str], None]):
        """Runs one call of the instrumented function and returns its logs.

        If it fails on its first run, it is dropped (`on_failure` gets the
        reason) and the plain one runs instead: mpprof's hooks inside the step
        catch their own errors, so what the plain step raises is the user's
        own error, and it is raised unchanged after `on_abort`.
        """
        try:
            logs = self.instrumented(iterator)
        except (StopIteration, tf.errors.OutOfRangeError):
            raise  # the end of the data: fit ends the epoch
        except Exception as error:
            if self._instrumented_ran:
                on_abort()
                raise
            self.instrumented = None
            on_failure(f"the instrumented train step failed: {describe_error(error)}")
            return self.run_plain(iterator, on_abort=on_abort)
        except BaseException:
            on_abort()
            raise
        self._instrumented_ran = True
        return logs

    def release(self) -> None:
        self.plain = self.instrumented = None
