"""Per-layer numerics on sampled steps of a model with its own `train_step`, on JAX.

A user's `train_step(self, state, data)` calls `jax.value_and_grad` itself:
mpprof cannot add a differentiated input to that trace, nor take extra
outputs out of it, as `NumericsTaps` does for Keras' own step. So the
sampled step here is the user's `train_step` unchanged, traced with the
layer taps on, in a second jitted function beside the plain one (used only
on the calls the schedule samples, as `NumericsTaps`' is). Each measured
layer's output goes through an identity with a custom VJP: its forward
statistics (`tensor_statistics.raw_statistics`) leave through
`jax.debug.callback`, and its backward rule sends the statistics of the
gradient flowing into the layer the same way. The rows land on the host,
keyed by (layer row, call); a tap inside `lax.scan` fires once per
iteration, and its rows are added up like a layer's calls.

Host callbacks cost a device-to-host copy per tap and keep XLA from fusing
across the tap: acceptable because only sampled steps pay it; the plain
step has no tap and no callback. The host reads a sample only once the
step's outputs are ready and `jax.effects_barrier()` has returned, so every
callback of that step has landed.

Variable gradients are those the step hands to an optimizer's
`stateless_apply` (the optimizers the step was seen to apply), unscaled by
that optimizer's own loss scale as the step passed it. A call whose output
is not differentiated (a GAN's generator in the discriminator's step) has no
backward rows; layers and variables without any are listed in the layout's
`not_measured`, never shown as zeros that were measured.
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np

from mpprof.backends.jax.numerics_taps import SAMPLE_KEY, NumericsTaps, float_output
from mpprof.backends.jax.tensor_statistics import (
    SUMMARY_COLUMNS,
    gradient_statistics,
    raw_statistics,
)
from mpprof.backends.numerics_rows import ABS_MAX, RAW_COLUMNS
from mpprof.backends.patching import Patches


def _add(rows: dict, key, row: np.ndarray) -> None:
    """Adds a raw row to `rows[key]`: counts add up, abs-max is the maximum."""
    row = np.asarray(row, np.float64)
    found = rows.get(key)
    if found is None:
        rows[key] = row.copy()
        return
    peak = max(found[ABS_MAX], row[ABS_MAX])
    found += row
    found[ABS_MAX] = peak


class CallbackTaps(NumericsTaps):
    """Per-layer and per-variable statistics of a custom `train_step`, sent
    to the host by callbacks on sampled steps.

    Args:
        model: the built model (its `train_step` is the user's).
        backend: the fit's `JaxBackend`.
    """

    def __init__(self, model, backend):
        super().__init__(model, backend)
        self._tracing = False
        self._calls: dict[int, int] = {}
        self._lock = threading.Lock()
        # Host rows of the sampled call under way, by kind and key.
        self._host: dict[str, dict] = {"forward": {}, "backward": {}, "gradients": {},
                                       "unscaled_gradients": {}}
        self._variable_rows = {id(v): i for i, v in enumerate(self._variables)}
        # What the traced step reaches (known once it is traced): layer rows
        # whose tap's backward rule was traced, variables handed to an optimizer.
        self._differentiated: set[int] = set()
        self._applied_variables: set[int] = set()

    # The traced step.

    def on_call(self, layer, args, kwargs, outputs):
        row = self._rows.get(id(layer))
        if not self._tracing or row is None or row not in self._measured_rows:
            return outputs
        found = float_output(outputs)
        call = None if found is None else self._count_call(self._calls, row)
        if call is None:
            return outputs
        flat, tree, position = found
        if row not in self._call_order:
            self._call_order.append(row)
        output = flat[position]
        jax.debug.callback(functools.partial(self._land, "forward", (row, call)),
                           raw_statistics(jax.lax.stop_gradient(output)))
        flat[position] = _tap(output, (self, row, call))
        return jax.tree_util.tree_unflatten(tree, flat)

    def instrumented_train_step(self, state, data):
        """The model's own `train_step`, traced with the taps on; the sample
        leaves by callbacks, and the logs carry a token to wait on."""
        self._tracing, self._calls = True, {}
        try:
            logs, state = self._model.train_step(state, data)
        finally:
            self._tracing = False
        if isinstance(logs, dict):
            logs = {**logs, SAMPLE_KEY: jnp.zeros((), jnp.float32)}
        return logs, state

    def wrap_optimizer(self, optimizer, loss_scale_getter, patches: Patches) -> None:
        """Wraps `optimizer.stateless_apply` so that a sampled step sends the
        gradients it hands over (scaled, and unscaled by the loss scale in
        the optimizer variables it passes)."""
        original = getattr(optimizer, "stateless_apply", None)
        if not callable(original):
            return
        scale_index = None
        if hasattr(optimizer, "dynamic_scale"):
            scale_index = next(i for i, v in enumerate(optimizer.variables)
                               if v is optimizer.dynamic_scale)

        def stateless_apply(optimizer_variables, grads, trainable_variables):
            if self._tracing:
                scale = (jnp.float32(1.0) if scale_index is None
                         else jnp.asarray(optimizer_variables[scale_index], jnp.float32))
                self._send_gradients(optimizer, list(grads), scale)
            return original(optimizer_variables, grads, trainable_variables)

        patches.set(optimizer, "stateless_apply", stateless_apply)

    def _send_gradients(self, optimizer, grads: list, scale) -> None:
        # The optimizer's gradients follow the variables it was built for.
        for variable, gradient in zip(optimizer._trainable_variables, grads, strict=True):
            row = self._variable_rows.get(id(variable))
            if row is None or gradient is None:
                continue
            self._applied_variables.add(row)
            scaled, unscaled = gradient_statistics([gradient], scale)
            jax.debug.callback(functools.partial(self._land_gradient, row),
                               scaled[0], unscaled[0])

    # Host side (the callbacks run on the runtime's threads).

    def _land(self, kind: str, key, row) -> None:
        with self._lock:
            _add(self._host[kind], key, row)

    def _land_gradient(self, row: int, scaled, unscaled) -> None:
        with self._lock:
            _add(self._host["gradients"], row, scaled)
            _add(self._host["unscaled_gradients"], row, unscaled)

    def read(self) -> dict[str, np.ndarray]:
        # Every callback of the sampled step has run once its outputs are
        # ready and the effects barrier has passed.
        jax.block_until_ready(self._sample)
        jax.effects_barrier()
        with self._lock:
            host = self._host
            self._host = {kind: {} for kind in host}
        rows, variables = len(self.layer_names), len(self._variables)
        # As the instrumented step's sample (its calls already added up),
        # read the same way; the loss comes from the loss watch.
        self._sample = {
            "forward": self._table(host["forward"], rows),
            "backward": self._table(host["backward"], rows)[:, None],
            "gradients": self._table(host["gradients"], variables, SUMMARY_COLUMNS),
            "unscaled_gradients": self._table(host["unscaled_gradients"], variables,
                                              SUMMARY_COLUMNS),
            "loss": np.nan,
        }
        return super().read()

    def _table(self, found: dict, size: int, columns: int = RAW_COLUMNS) -> np.ndarray:
        """Host rows by key as a [size, columns] table, a layer's calls
        added up (zeros where nothing landed: a count of 0)."""
        table = np.zeros((size, columns))
        for key, row in found.items():
            index = key[0] if isinstance(key, tuple) else key
            peak = max(table[index, ABS_MAX], row[ABS_MAX])
            table[index] += row
            table[index, ABS_MAX] = peak
        return table

    def layout(self, policy_max: float) -> dict:
        layout = super().layout(policy_max)
        measured = self.call_order
        layout["sampled_step"] = (
            "the model's own train_step, traced with the layer taps; statistics leave "
            "by jax.debug.callback (sampled steps only)")
        layout["gradients"] = "as handed to the optimizers' stateless_apply"
        layout["not_measured"] = {
            "backward": [self.layer_names[row] for row in measured
                         if row not in self._differentiated],
            "variable_gradients": [name for i, name in enumerate(self.variable_names)
                                   if i not in self._applied_variables],
        }
        return layout


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _tap(x, where):
    return x


def _tap_fwd(x, where):
    return x, None


def _tap_bwd(where, _, gradient):
    taps, row, call = where
    taps._differentiated.add(row)
    jax.debug.callback(functools.partial(taps._land, "backward", (row, call)),
                       raw_statistics(gradient))
    return (gradient,)


_tap.defvjp(_tap_fwd, _tap_bwd)
