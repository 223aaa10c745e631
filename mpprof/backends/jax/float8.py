"""The float8 layers' delayed scaling on JAX: scales, amax history, clipping.

Keras' float8 layers keep each scale and amax history in a variable with
`overwrite_with_gradient=True`, trainable (the step's "gradient" of it is its
next value): on JAX they travel in the trainable part of the step's state
(the non-trainable part, for a frozen layer). During an epoch the variables
hold nothing current: Keras' JAX fit keeps the state outside them
(`model._jax_state`) and writes it back at epoch ends only. So the collector
reads them from the state the last train call returned
(`StepState.keras_state`, kept by the train functions beside mpprof's own
table), at flush points only, in one `jax.device_get`; before the fit's
first call, from the variables. The step and the skipped steps a flush
replays come from the same call's table, so both describe the same step.

A state already donated to a call (a SIGTERM flush during a step, or a step
that raised) cannot be read: that flush writes no float8 row, and the next
one replays its steps too. The replay is the TensorFlow backend's
(`mpprof.backends.float8_replay`). JAX shards a step within one program
(`keras.distribution`): each amax is the global batch's, one replica.
"""

from __future__ import annotations

import jax
import numpy as np

from mpprof.backends.float8_replay import DelayedScalingState
from mpprof.backends.patching import Patches


class Float8State(DelayedScalingState):
    """Records the float8 layers' scales and amax histories at each flush.

    Args:
        model: the model being fit.
        loss_scales: the fit's `LossScales` (its skipped steps updated nothing).
        backend: the fit's `JaxBackend`, whose step state holds the Keras
            state the last call returned.
    """

    def __init__(self, model, loss_scales, backend):
        super().__init__(model, loss_scales)
        self._model = model
        self._backend = backend
        # (part of the state, index in it) of each scale and history, in
        # `_variables`' order, scale first.
        self._places: list[tuple[int, int]] = []

    def install(self, fit, patches: Patches) -> None:
        if not self._layers:
            return
        # The order Keras' fit lays the state out in (`_get_jax_state`).
        parts = (self._model.trainable_variables, self._model.non_trainable_variables)
        self._places = [_place(parts, variable)
                        for pair in self._variables for variable in pair]
        self._start(fit)

    def _read(self) -> list[tuple[float, np.ndarray]] | None:
        step_state = self._backend.step_state
        state = step_state.keras_state if step_state is not None else None
        if state is None:
            arrays = [variable.value for pair in self._variables for variable in pair]
        else:
            arrays = [state[part][index] for part, index in self._places]
        if any(isinstance(a, jax.Array) and a.is_deleted() for a in arrays):
            return None
        host = jax.device_get(arrays)
        return [(float(np.asarray(host[i])), np.asarray(host[i + 1], np.float64).reshape(-1))
                for i in range(0, len(host), 2)]


def _place(parts: tuple, variable) -> tuple[int, int]:
    """Where `variable` is in the step's state: (part, index)."""
    for part, variables in enumerate(parts):
        for index, candidate in enumerate(variables):
            if candidate is variable:
                return part, index
    raise LookupError(f"{variable.path} is in neither the trainable nor the non-trainable "
                      "variables the train step is given")
