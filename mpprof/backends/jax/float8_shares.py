"""Float8 saturation and underflow shares on sampled steps, on JAX (what is
measured, and how the layers are wrapped: `mpprof.backends.float8_shares`).

They leave the instrumented step (`numerics_taps.NumericsTaps`) as its
per-layer statistics do, as outputs, with no host callback: the collector is
one of the step's `step_taps`. While the step is traced, the wrapped
`quantized_call` of each float8 layer counts its inputs and kernel against
the scales the step quantizes with (their values in the step's state, before
its update), and those rows leave through the loss function's aux output.
The gradient Keras quantizes passes through an identity with a custom VJP,
whose backward rule returns, as the cotangent of a zero probe (one per layer
call, differentiated beside the step's other inputs), that gradient's counts
against `outputs_grad_scale`. The plain step traces the wrapper with no
trace of this collector on: it runs the layer unchanged.

A layer called more than `numerics_taps.MAX_CALLS` times in one step is
measured on its first calls (the run context says which layers); one called
inside JAX control flow (`lax.scan`, whose values cannot leave it) is not
measured. A model with its own `train_step` is sampled with host callbacks
(`numerics_callbacks`): the shares are not measured there (the run context
says so), and MP015/MP016 judge each step's amax instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mpprof.backends.float8_shares import Float8SharesCollector, merge_rows, quantization_limits
from mpprof.backends.jax.custom_step import overrides_train_step
from mpprof.backends.jax.numerics_taps import StepTrace
from mpprof.backends.numerics_layers import MAX_CALLS
from mpprof.backends.patching import Patches
from mpprof.records import schema

_COLUMNS = len(schema.FLOAT8_SHARE_COLUMNS)
_FORWARD = ("inputs", "kernel")  # measured as the layer is called, in this order
_GRADIENT_FORMAT = schema.FLOAT8_FORMATS["outputs_grad"]
_CUSTOM_STEP = ("a model with its own train_step is sampled with host callbacks "
                "(numerics_callbacks), which do not measure the float8 shares; the float8 "
                "state (scales, amax histories, each step's saturation and underflow from "
                "its amax) is recorded")


def quantization_counts(values: jax.Array, scale: jax.Array, fmt: str) -> jax.Array:
    """`schema.FLOAT8_SHARE_COLUMNS` (float32) of `values` quantized as Keras
    does with `scale` to `fmt` (`mpprof.backends.float8_shares`), in one pass
    that XLA fuses: TensorFlow's `quantization_counts`, in JAX."""
    x = jnp.ravel(values)
    fmax, half_smallest = quantization_limits(fmt)
    quotient = jnp.abs(x / jnp.asarray(scale, x.dtype))
    nonzero = x != 0
    magnitude = jnp.abs(x)
    largest = jnp.max(jnp.where(jnp.isfinite(x), magnitude, jnp.zeros_like(magnitude)),
                      initial=0)
    return jnp.stack([
        jnp.float32(x.size),
        jnp.sum(nonzero, dtype=jnp.float32),
        jnp.sum(quotient > jnp.asarray(fmax, x.dtype), dtype=jnp.float32),
        jnp.sum(nonzero & (quotient <= jnp.asarray(half_smallest, x.dtype)), dtype=jnp.float32),
        jnp.asarray(scale, jnp.float32),
        jnp.asarray(largest, jnp.float32),
    ])


def _gradient_counter(traced):
    """An identity with a custom VJP, `tap(x, probe, scale)`, whose backward
    rule passes the gradient on unchanged and returns, as the probe's
    cotangent, the gradient's counts against `scale` (zeros, and the
    failure reported through `traced`, if counting fails)."""

    @jax.custom_vjp
    def tap(x, probe, scale):
        return x

    def tap_fwd(x, probe, scale):
        return x, scale

    def tap_bwd(scale, gradient):
        counts = traced(lambda: quantization_counts(gradient, scale, _GRADIENT_FORMAT))
        if counts is None:
            counts = jnp.zeros((_COLUMNS,), jnp.float32)
        return gradient, counts, jnp.zeros_like(scale)

    tap.defvjp(tap_fwd, tap_bwd)
    return tap


class _Trace(StepTrace):
    """What one trace of the instrumented step gathers: the forward rows by
    (layer row, call)."""

    forward: dict[tuple[int, int], jax.Array]  # type: ignore[assignment]  # keyed by call too


class Float8Shares(Float8SharesCollector):
    """FLOAT8_SHARES on JAX, from the instrumented step's outputs.

    Args:
        model: the model being fit.
        sampling: whether the fit samples steps at all (`numerics_every`).
        backend: the fit's `JaxBackend`, whose instrumented step runs this
            collector's taps (`step_taps`).
    """

    key = "float8_shares"

    def __init__(self, model, sampling: bool, backend):
        super().__init__(model, sampling)
        self._backend = backend
        self._custom_step = overrides_train_step(model)
        self._trace: _Trace | None = None
        self._outputs: dict | None = None
        self._first_calls_only: set[int] = set()
        self._tap = _gradient_counter(self.traced)

    def install(self, fit, patches: Patches) -> None:
        if not self._layers or not self._sampling or self._custom_step:
            return
        self._guard(fit)
        for row, layer in enumerate(self._layers):
            patches.set(layer, "quantized_call", self.wrap(layer, row, layer.quantized_call))
        self._backend.step_taps.append(self)

    # The step taps' interface (`numerics_taps.NumericsTaps`).

    def probes(self) -> list[list[jax.Array]]:
        """Zero probes, one per float8 layer and measured call."""
        return [[jnp.zeros((_COLUMNS,), jnp.float32) for _ in range(MAX_CALLS)]
                for _ in self._layers]

    def start(self, probes: list[list]) -> None:
        """The step's loss function is being traced, with these probes."""
        self._trace = _Trace(probes)

    def forward(self) -> jax.Array:
        """The forward rows the trace gathered, [layers, MAX_CALLS, inputs
        and kernel, columns] (zeros where nothing was measured)."""
        trace = self._trace
        unseen = jnp.zeros((len(_FORWARD), _COLUMNS), jnp.float32)
        return jnp.stack([
            jnp.stack([trace.forward.get((row, call), unseen) for call in range(MAX_CALLS)])
            for row in range(len(self._layers))
        ])

    def stop(self) -> None:
        """The trace is over (or raised): the layers run unmeasured again."""
        self._trace = None

    def outputs(self, forward: jax.Array, probe_gradients: list[list]) -> dict:
        """What leaves the step: the forward rows and the gradients' rows."""
        return {"forward": forward,
                "backward": jnp.stack([jnp.stack(calls) for calls in probe_gradients])}

    def receive(self, outputs: dict) -> None:
        """The outputs the instrumented call returned (device arrays)."""
        self._outputs = outputs

    # The layer wrappers' taps, while the step is traced.

    def _begin_call(self, row: int, inputs) -> bool:
        trace = self._trace
        if trace is None:
            return False  # the plain step
        if not trace.can_leave(inputs):
            return False  # inside lax.scan, cond or while_loop: values cannot leave it
        call = trace.calls.get(row, 0)
        trace.calls[row] = call + 1
        if call >= MAX_CALLS:
            self._first_calls_only.add(row)
            return False
        return True

    def _call(self, row: int) -> int:
        return self._trace.calls[row] - 1

    def _measure_forward(self, row: int, layer, inputs) -> None:
        from keras import ops

        # The values and scales Keras' `_float8_call` quantizes, as it reads them.
        values = {"inputs": inputs, "kernel": ops.convert_to_tensor(layer._kernel)}
        self._trace.forward[(row, self._call(row))] = jnp.stack([
            quantization_counts(
                jax.lax.stop_gradient(values[name]),
                jax.lax.stop_gradient(ops.convert_to_tensor(getattr(layer, f"{name}_scale"))),
                schema.FLOAT8_FORMATS[name])
            for name in _FORWARD
        ])

    def _gradient_tap(self, tensor, row: int, layer):
        from keras import ops

        scale = jax.lax.stop_gradient(ops.convert_to_tensor(layer.outputs_grad_scale))
        return self._tap(tensor, self._trace.probes[row][self._call(row)], scale)

    # After each sampled call.

    def after_sample(self, fit) -> None:
        """Writes the shares of the call just sampled."""
        if self._outputs is None:
            return
        outputs, self._outputs = jax.device_get(self._outputs), None
        forward = merge_rows(np.asarray(outputs["forward"], np.float64), axis=1)
        backward = merge_rows(np.asarray(outputs["backward"], np.float64), axis=1)
        self.write(fit, np.concatenate([forward, backward[:, None]], axis=1))

    def context(self) -> dict:
        found = super().context()
        if found["state"] != "ok":
            return found
        if self._custom_step:
            return {"state": "unavailable", "reason": _CUSTOM_STEP}
        if self._first_calls_only:
            found["first_calls_only"] = {
                "layers": sorted(self._layers[row].path for row in self._first_calls_only),
                "reason": f"called more than {MAX_CALLS} times in a step: its first "
                          f"{MAX_CALLS} calls are measured"}
        return found
