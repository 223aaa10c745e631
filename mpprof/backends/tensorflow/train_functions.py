"""The two traced train functions of a profiled fit, and which one runs.

Keras traces `model.train_function` lazily, at its first call. While a fit is
profiled, `model.train_function` is the profiler's own dispatcher, which runs
one of two functions made by `model.make_train_function(force=True)`: the
plain one (the model's own step, plus mpprof's always-on hooks: the
loss-scale counters and the loss check) on most steps, and the instrumented
one (the same step with the numerics taps switched on) on sampled steps. An
unsampled step costs nothing more than the plain function.

Two functions share the model's variables, the optimizer's and the data
iterator, but not the state of TensorFlow's legacy random ops (`tf.random.*`
in a traced step, tf-keras' Dropout without `enable_tf_random_generator`):
each traced op draws from its own sequence. Where such an op has a fixed seed
(`keras.utils.set_random_seed`, `tf.random.set_seed`, an op seed), sampled
steps would change the numbers the plain function draws after them, and so a
seeded run's weights: the instrumented function is then not used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from mpprof.backends.patching import Patches
from mpprof.backends.traced_guard import describe_error


def seeded_random_ops(graph_def) -> list[str]:
    """The ops of `graph_def` (its functions included) that draw from a random
    state of their own, seeded: TensorFlow's legacy random ops (each has the
    `seed` and `seed2` attributes; stateless ones and `tf.random.Generator`
    take their state as inputs), unless both seeds are 0 (drawn anew by every
    run, so nothing a second function could change)."""
    nodes = list(graph_def.node)
    for function in graph_def.library.function:
        nodes.extend(function.node_def)
    return [
        node.name for node in nodes
        if "seed2" in node.attr and (node.attr["seed"].i or node.attr["seed2"].i)
    ]


class TrainFunctions:
    """Makes and runs the plain and the instrumented train function.

    Args:
        model: the model, whose `train_function` fit made just before.
        keras_api: the fit's `Backend` (`mpprof.backends.base`).
        instrumented: whether to make the instrumented function at all.
    """

    def __init__(self, model, keras_api, instrumented: bool):
        self._model = model
        self._api = keras_api
        self._want_instrumented = instrumented
        self.plain: Callable[..., Any] | None = None
        self.instrumented: Callable[..., Any] | None = None
        self._instrumented_ran = False
        # Why the instrumented function is not used, when the first traced
        # step showed it would change the run (None: it may be).
        self.instrumented_off: str | None = None
        self._step_checked = False
        # Always None here: every sample is of the call's own step (the JAX
        # train functions may sample an earlier step's batch).
        self.replayed = None

    def install(self, dispatcher: Callable, patches: Patches) -> None:
        """Makes both functions and puts `dispatcher` in `model.train_function`
        (through `patches`: the model's own function comes back at the end).

        Call after every patch that must be traced into the step.
        """
        model = self._model
        if self._want_instrumented:
            self._check_step_when_traced(patches)
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

    def _check_step_when_traced(self, patches: Patches) -> None:
        """Wraps `model.train_step` so that its first trace (the plain
        function's: a fit's first call always runs it) looks for seeded
        legacy random ops, and drops the instrumented function if it finds
        any. The wrapper adds no op to the step."""
        train_step = self._model.train_step

        def train_step_checked(data):
            logs = train_step(data)
            graph = tf.compat.v1.get_default_graph()
            if graph.building_function and not self._step_checked:
                self._step_checked = True
                self._drop_instrumented_if_it_changes_the_run(graph)
            return logs

        patches.set(self._model, "train_step", train_step_checked)

    def _drop_instrumented_if_it_changes_the_run(self, graph) -> None:
        try:
            found = seeded_random_ops(graph.as_graph_def())
        except Exception as error:  # noqa: BLE001 - mpprof's failure must not stop fit
            self._drop_instrumented(f"the traced step could not be read: {describe_error(error)}")
            return
        if found:
            self._drop_instrumented(
                f"the train step draws seeded random numbers from TensorFlow's legacy random "
                f"ops ({', '.join(found[:3])}{', ...' if len(found) > 3 else ''}), whose state "
                "each traced function keeps for itself: a second, instrumented function on "
                "sampled steps would change the numbers drawn after them, and the run's weights. "
                "To sample numerics: in tf-keras, call "
                "tf_keras.backend.experimental.enable_tf_random_generator() before building "
                "the model; in a custom step, draw with keras.random.* and a "
                "keras.random.SeedGenerator (or a tf.random.Generator)"
            )

    def _drop_instrumented(self, reason: str) -> None:
        self.instrumented = None
        self.instrumented_off = reason

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
                         on_failure: Callable[[str], None], forensic: bool = False):
        """Runs one call of the instrumented function and returns its logs
        (`forensic` changes nothing: the host reads each call's alarm before
        the next, so a forensic sample is of the step after the overflow).

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
            # Said only once the plain step ran: when it raises too, the error
            # is the user's and the fit fails (no "training goes on").
            logs = self.run_plain(iterator, on_abort=on_abort)
            on_failure(f"the instrumented train step failed: {describe_error(error)}")
            return logs
        except BaseException:
            on_abort()
            raise
        self._instrumented_ran = True
        return logs

    def release(self) -> None:
        self.plain = self.instrumented = None
