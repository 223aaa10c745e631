"""Per-layer activation and gradient statistics on sampled steps, on JAX.

The sampled step is a second jitted function beside the plain one (which
stays Keras' step plus mpprof's counters): `instrumented_train_step` runs
Keras' JAX `train_step` recipe (`compute_loss_and_updates` under
`jax.value_and_grad`, `stateless_apply`, the metrics update) with one more
differentiated input, zero probes (one [raw columns] array per layer call).
While it is traced, the layer wrappers (`on_call`, a `LayerCallPatch` hook)
take each measured layer's output through an identity with a custom VJP: its
forward statistics leave through the loss function's aux output, and its
backward rule returns, as the probe's cotangent, the statistics of the
gradient flowing into the layer. The gradient of the probe table IS the
backward statistics: no host callback, no extra pass. Variable gradients
(scaled, and unscaled by the step's loss scale) come from the same
`value_and_grad`; their records keep no histogram, so none is computed
(`tensor_statistics.gradient_statistics`: one pass over each gradient for
both rows). Everything leaves the step as one output the host copies
after the sampled call.

Other collectors measure in the same step the same way (the backend's
`step_taps`: the float8 shares, `mpprof.backends.jax.float8_shares`): each
gives probes of its own, is told when the loss function's trace starts and
ends, and gets its outputs back from the sample under its `key`.

Measured: every leaf layer; a recurrent layer (its cell runs in a
`lax.scan`) at its boundary; a layer called inside other control flow (its
values belong to an inner trace) is skipped and listed with the reason. A
layer called more than `MAX_CALLS` times in one step is measured on its
first calls only (also listed). A model that overrides `train_step` is
sampled by `mpprof.backends.jax.numerics_callbacks` instead: this
instrumented step would not be its step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpprof.backends.jax.tensor_statistics import (
    gradient_statistics,
    merge_rows,
    raw_statistics,
    statistics_of_summaries,
)
from mpprof.backends.numerics_layers import MAX_CALLS, LayerRows
from mpprof.backends.numerics_rows import RAW_COLUMNS, statistics_of_rows
from mpprof.backends.optimizer_usage import applied_steps
from mpprof.records import schema

SAMPLE_KEY = "_mpprof_sample"


@jax.custom_vjp
def _tap(x, probe):
    return x


def _tap_fwd(x, probe):
    return x, None


def _tap_bwd(_, gradient):
    # The gradient flows on unchanged; the probe's "gradient" is its statistics.
    return gradient, raw_statistics(gradient)


_tap.defvjp(_tap_fwd, _tap_bwd)


def float_output(outputs) -> tuple[list, object, int] | None:
    """A layer's outputs flat, their tree, and where the first float array
    is (the one measured), or None without one."""
    flat, tree = jax.tree_util.tree_flatten(outputs)
    position = next((i for i, t in enumerate(flat) if isinstance(t, jax.Array)
                     and jnp.issubdtype(t.dtype, jnp.floating)), None)
    return None if position is None else (flat, tree, position)


class StepTrace:
    """What one trace of the instrumented step gathers."""

    def __init__(self, probes: list[list]):
        self.probes = probes
        self.forward: dict[int, list] = {}
        self.calls: dict[int, int] = {}
        # The probes' trace (they are differentiated) and those it runs
        # inside (the jitted step's).
        self._outer = []
        marker = next((p[0] for p in probes if p), None)
        outer = getattr(marker, "_trace", None)
        while outer is not None:
            self._outer.append(outer)
            outer = getattr(outer, "parent_trace", None)

    def can_leave(self, value) -> bool:
        """Whether `value` may leave the step: a constant, or a value of the
        probes' trace or of one around it (a layer whose output does not
        depend on the weights, as a Rescaling of the input, gives the jitted
        step's own tracer). One of an inner trace (lax.scan, cond, while)
        cannot."""
        trace = getattr(value, "_trace", None)
        return trace is None or any(trace is outer for outer in self._outer)


class NumericsTaps(LayerRows):
    """Per-layer forward/backward and per-variable gradient statistics.

    Args:
        model: the built model.
        backend: the fit's `JaxBackend` (it hands the collector to the
            train functions).
    """

    aggregation = ("per layer, summed over its call sites in the first step of "
                   "the sampled call (abs_max: maximum)")

    def __init__(self, model, backend):
        super().__init__(model, recurrent_loop="its lax.scan")
        self.instrumenting = False
        self._model = model
        # Objects with `key`, `probes()`, `start(probes)`, `forward()`,
        # `stop()`, `outputs(forward, probe_gradients)` and `receive(outputs)`.
        self._step_taps: list = backend.step_taps
        self._trainable_index = [
            next(i for i, t in enumerate(model.trainable_variables) if t is v)
            for v in self._variables
        ]
        # Where the optimizer variables hold a LossScaleOptimizer's count of
        # applied steps (None: no loss scaling).
        optimizer = model.optimizer
        self._applied_index = None
        if hasattr(optimizer, "dynamic_scale"):
            self._applied_index = next(i for i, v in enumerate(optimizer.variables)
                                       if v is applied_steps(optimizer))
        self._trace: StepTrace | None = None
        self._sample = None
        backend.numerics = self

    # The traced step.

    def on_call(self, layer, args, kwargs, outputs):
        trace = self._trace
        row = self._rows.get(id(layer))
        if trace is None or row is None or row not in self._measured_rows:
            return outputs
        found = float_output(outputs)
        if found is None:
            return outputs
        flat, tree, position = found
        output = flat[position]
        if not trace.can_leave(output):
            self._skipped.setdefault(row, "called inside JAX control flow (lax.scan, "
                                          "cond or while_loop), whose values cannot leave it")
            return outputs
        call = self._count_call(trace.calls, row)
        if call is None:
            return outputs
        trace.forward.setdefault(row, []).append(raw_statistics(jax.lax.stop_gradient(output)))
        if row not in self._call_order:
            self._call_order.append(row)
        flat[position] = _tap(output, trace.probes[row][call])
        return jax.tree_util.tree_unflatten(tree, flat)

    def instrumented_train_step(self, state, data):
        """Keras' JAX `train_step` (keras/src/backend/jax/trainer.py) with
        the probes differentiated too; the sample leaves in the logs."""
        from keras.src.trainers.data_adapters import data_adapter_utils

        model = self._model
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        rows = len(self.layer_names)

        step_taps = list(self._step_taps)

        def loss_function(trainable, probes, tap_probes):
            self._trace = StepTrace(probes)
            for tap, its_probes in zip(step_taps, tap_probes, strict=True):
                tap.start(its_probes)
            try:
                loss, aux = model.compute_loss_and_updates(
                    trainable, non_trainable, metrics_variables, x, y, sample_weight,
                    training=True, optimizer_variables=optimizer_variables)
                forward = self._trace.forward
                tap_forward = [tap.forward() for tap in step_taps]
            finally:
                self._trace = None
                for tap in step_taps:
                    tap.stop()
            unseen = jnp.zeros((RAW_COLUMNS,), jnp.float32)
            table = jnp.stack([merge_rows(forward[row]) if row in forward else unseen
                               for row in range(rows)])
            return loss, (aux, table, tap_forward)

        # One probe per measured call, each its own input: a gradient for
        # one slice of a single table would be padded to the whole table,
        # and added up layer after layer.
        probes = [[jnp.zeros((RAW_COLUMNS,), jnp.float32) for _ in range(MAX_CALLS)]
                  if row in self._measured_rows else [] for row in range(rows)]
        (loss, (aux, forward, tap_forward)), (grads, probe_grads, tap_grads) = jax.value_and_grad(
            loss_function, argnums=(0, 1, 2), has_aux=True)(
                trainable, probes, [tap.probes() for tap in step_taps])
        unused = jnp.zeros((MAX_CALLS, RAW_COLUMNS), jnp.float32)
        probe_grads = jnp.stack([jnp.stack(calls) if calls else unused
                                 for calls in probe_grads])
        unscaled_loss, y_pred, non_trainable, metrics_variables = aux
        scale = jnp.float32(1.0)
        optimizer = model.optimizer
        if hasattr(optimizer, "dynamic_scale"):
            index = next(i for i, v in enumerate(optimizer.variables)
                         if v is optimizer.dynamic_scale)
            scale = jnp.asarray(optimizer_variables[index], jnp.float32)
        sample = {"forward": forward, "backward": probe_grads,
                  "loss": jnp.sum(jnp.asarray(unscaled_loss, jnp.float32))}
        for tap, its_forward, its_grads in zip(step_taps, tap_forward, tap_grads, strict=True):
            sample[tap.key] = tap.outputs(its_forward, its_grads)
        new_trainable, new_optimizer_variables = optimizer.stateless_apply(
            optimizer_variables, grads, trainable)
        all_finite = None
        if self._applied_index is not None:
            # A LossScaleOptimizer applies a step only when every gradient
            # is finite (its check_finite): its verdict spares a pass.
            all_finite = (new_optimizer_variables[self._applied_index]
                          != optimizer_variables[self._applied_index])
        sample["gradients"], sample["unscaled_gradients"] = gradient_statistics(
            [grads[i] for i in self._trainable_index], scale, all_finite)
        trainable, optimizer_variables = new_trainable, new_optimizer_variables
        logs, metrics_variables = model._update_metrics_variables(
            metrics_variables, unscaled_loss, x, y, y_pred, sample_weight)
        logs = {**logs, SAMPLE_KEY: sample}
        return logs, (trainable, non_trainable, optimizer_variables, metrics_variables)

    def receive(self, sample) -> None:
        """The sample the instrumented call returned (device arrays)."""
        for tap in self._step_taps:
            if tap.key in sample:
                tap.receive(sample.pop(tap.key))
        self._sample = sample

    # The core's interface (`mpprof.recording.collectors.numerics_samples`).

    def wrap_optimizer(self, optimizer, loss_scale_getter, patches) -> None:
        """(The instrumented step reads the gradients itself.)"""

    def read(self) -> dict[str, np.ndarray]:
        sample, self._sample = jax.device_get(self._sample), None
        backward = np.asarray(sample["backward"])
        # A layer's calls: counts add up, abs-max is the maximum.
        merged = backward.sum(axis=1)
        merged[:, 2] = backward[:, :, 2].max(axis=1)
        order = self.call_order
        forward, forward_hist = statistics_of_rows(np.asarray(sample["forward"]))
        backward, backward_hist = statistics_of_rows(merged)
        found: dict[str, Any] = {
            schema.NUMERICS_FORWARD: forward[order],
            schema.NUMERICS_BACKWARD: backward[order],
            schema.NUMERICS_FORWARD_HIST: forward_hist[order],
            schema.NUMERICS_BACKWARD_HIST: backward_hist[order],
            schema.NUMERICS_GRADIENTS: statistics_of_summaries(sample["gradients"]),
            schema.NUMERICS_UNSCALED_GRADIENTS: statistics_of_summaries(
                sample["unscaled_gradients"]),
            "loss": float(sample["loss"]),
        }
        return found
