"""One eager pass of a captured step: forward, loss, scaled backward, watched.

Every layer's `call` is wrapped at instance level for the length of the pass
(`Operation.__call__` looks `self.call` up; `mpprof.backends.patching.Patches` puts
back what was there), so that each TensorFlow op TensorFlow's eager op
callbacks see is attributed to the innermost layer running it, and each
layer's output and the gradient flowing into it are kept. The pass runs
eagerly whatever the model was compiled with (`jit_compile=True` included):
every op executes on its own and can be looked at.

Each pass starts from the same state: the non-trainable variables (moving
statistics, random seeds) are put back after it, and the dtype policies it
changed are restored.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.framework import op_callbacks

from mpprof.backends.layer_records import variable_path
from mpprof.backends.replay_candidates import layer_tree, policies_applied

# A layer's input cast runs in its `__call__`, just before its `call`: an
# offending Cast right before a layer's call is that layer's
# (`mpprof.backends.replay_watch.LayerWatch`).
from mpprof.backends.replay_watch import LayerWatch, pass_policies
from mpprof.replay.search import BETWEEN_LAYERS, LOSS, PassResult, abs_max, problem

# Ops mpprof's own taps run: never the offender.
_OWN_OPS = {"Identity", "IdentityN"}
_OWN_OPS_BYTES = {op.encode() for op in _OWN_OPS}


def run_pass(model, batch, loss_scale: float, float32_layers: Iterable[str] | None,
             *, all_float32: bool = False, policies: Mapping[str, str] | None = None,
             model_policy: str | None = None) -> PassResult:
    """Runs the step once, eagerly, and watches it.

    Args:
        model: the built model, holding the step's weights.
        batch: (x, y, sample_weight).
        loss_scale: what the loss is multiplied by before the backward pass.
        float32_layers: qualified names of layers (each with its sublayers)
            to compute in float32 for this pass.
        all_float32: every layer and the model itself in float32.
        policies: qualified layer name -> the policy it computes with for
            this pass (a verification candidate's; after `float32_layers`).
        model_policy: the model's own policy for this pass.
    """
    tree = layer_tree(model)
    wanted, model_policy = pass_policies(tree, float32_layers, policies, all_float32,
                                         model_policy)
    # What a pass changes besides the weights is put back after it: moving
    # statistics, and the loss trackers `compute_loss` updates (a NaN left
    # there would be read by every later pass; the first pass creates them).
    state = [(v, np.array(v.numpy())) for v in model.non_trainable_variables]
    watch = _Watch(tree)
    try:
        with policies_applied(model, tree, wanted, model_policy):
            watch.install()
            return watch.run(model, batch, loss_scale)
    finally:
        watch.remove()
        for variable, value in state:
            variable.assign(value)
        for metric in model.metrics:
            metric.reset_state()


class _Watch(LayerWatch):
    """The layer wrappers and the op callback of one pass."""

    def __init__(self, tree: dict[str, object]):
        super().__init__(tree)
        self._callback_added = False

    def install(self) -> None:
        self.install_layers()
        op_callbacks.add_op_callback(self._on_op)
        self._callback_added = True

    def remove(self) -> None:
        if self._callback_added:
            op_callbacks.remove_op_callback(self._on_op)
            self._callback_added = False
        self.remove_layers()

    def run(self, model, batch, loss_scale: float) -> PassResult:
        x, y, sample_weight = batch
        with tf.GradientTape() as tape:
            self._outside = BETWEEN_LAYERS
            y_pred = model(x, training=True)
            self._outside = LOSS
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                      training=True)
            scaled = tf.cast(loss, tf.float32) * loss_scale
        self._phase = "backward"
        variables = model.trainable_variables
        gradients = tape.gradient(scaled, variables)
        self._phase = "done"
        by_path = {variable_path(v): _array(g) for v, g in zip(variables, gradients,
                                                                 strict=True)
                   if g is not None}
        return self.result(float(_array(loss)), by_path)

    def tap(self, name: str, index: int, outputs):
        flat = tf.nest.flatten(outputs)
        position = next((i for i, t in enumerate(flat)
                         if tf.is_tensor(t) and t.dtype.is_floating), None)
        if position is None:
            return outputs
        key = (name, index)
        self.forward[key] = _array(flat[position]).astype(np.float64)

        @tf.custom_gradient
        def tap(tensor):
            def gradient(upstream):
                self._backward_layer = name
                self.backward[key] = _array(upstream).astype(np.float64)
                return upstream

            return tf.identity(tensor), gradient

        self._inside = True
        try:
            flat[position] = tap(flat[position])
        finally:
            self._inside = False
        return tf.nest.pack_sequence_as(outputs, flat)

    def _on_op(self, op_type, inputs, attrs, outputs, op_name=None, graph=None):
        if graph is not None or self._inside or op_type in _OWN_OPS \
                or op_type in _OWN_OPS_BYTES:
            return None
        phase = self.judged_phase()
        if phase is None:
            return None
        for output in outputs or ():
            problem = _problem(output)
            if problem is None:
                continue
            if isinstance(op_type, bytes):
                op_type = op_type.decode("utf-8", "replace")
            self.offend(phase, op_type,
                        [_abs_max(t) for t in inputs or () if _is_float(t)], problem,
                        output.dtype.name, cast=op_type == "Cast")
            break
        return None


def _is_float(tensor) -> bool:
    return tf.is_tensor(tensor) and tensor.dtype.is_floating


def _array(tensor) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(tensor))


def _abs_max(tensor) -> float | None:
    return abs_max(_array(tensor))


def _problem(tensor) -> str | None:
    """What is wrong with an op's output, or None."""
    return problem(_array(tensor), tensor.dtype.name) if _is_float(tensor) else None
