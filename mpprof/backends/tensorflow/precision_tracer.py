"""The precision inventory: every layer's dtypes, float32 islands and casts.

Policies are read from the layers; the dtypes a layer ACTUALLY outputs, the
call order, which layers feed which, the casts between layers and the op that
produced each model output are seen while the train step is traced, through
`LayerCallPatch`. Tracing happens once, so this costs nothing per step. The
compiled loss of each output is read once, defensively: what cannot be read
is recorded as None ("not measured"), never raised.
"""

from __future__ import annotations

import tensorflow as tf

# The layer records are framework-free (shared with the JAX backend); the
# names stay importable from here.
from mpprof.backends.layer_records import (  # noqa: F401 - re-exported
    InventoryBuilder,
    compiled_losses,
    gemm_dims,
    gemm_layout,
    own_policy,
)


class PrecisionTracer(InventoryBuilder):
    """Builds the precision inventory of `model`; a `LayerCallPatch` hook.

    Args:
        model: the Keras model being trained.
    """

    def on_call(self, layer, args, kwargs, outputs):
        key = id(layer)
        flat_outputs = _tensors(outputs)
        dtypes = {t.dtype.name for t in flat_outputs}
        if layer is self._model:
            self._model_output_dtypes |= dtypes
            if not tf.executing_eagerly() and not self._outputs:
                self._outputs = [self._describe_output(t) for t in _graph_tensors(flat_outputs)]
        else:
            self._layer_output(key, dtypes, flat_outputs)
        if not tf.executing_eagerly():
            inputs = _graph_tensors(_tensors((args, kwargs)))
            self._record_casts(layer, inputs)
            producers = self._inputs_from.setdefault(key, {})
            for tensor in inputs:
                # A layer's own output may end in a Cast (LayerNormalization
                # computes in float32 and casts back): that tensor is its
                # producer's; only a Cast of the consumer's own is looked behind.
                producer = self._producers.get(tensor.ref())
                if producer is None:
                    producer = self._producers.get(_uncast(tensor).ref())
                if producer is not None and producer != key:
                    producers.setdefault(producer, None)
                elif producer is None and _computed_by_ops(tensor):
                    self._inputs_made_outside_layers.add(key)
            for tensor in _graph_tensors(flat_outputs):
                self._producers[tensor.ref()] = key
        return outputs

    @staticmethod
    def _example_shape(shape) -> list[int] | None:
        """A layer output's shape without its batch axis (None: not all known)."""
        if shape.rank is None or shape.rank < 1:
            return None
        dims = shape.as_list()[1:]
        return dims if all(isinstance(d, int) for d in dims) else None

    def _describe_output(self, tensor) -> dict:
        """The layer and the graph op that produced a model output."""
        source = tensor
        while source.op.type in _PASS_THROUGH_OPS and source.op.inputs:
            source = source.op.inputs[0]
        units = tensor.shape[-1] if tensor.shape.rank else None
        return {
            "producer": self._producers.get(tensor.ref())
            or self._producers.get(source.ref()),
            "final_op": source.op.type,
            "units": int(units) if units is not None else None,
        }

    def _record_casts(self, layer, inputs) -> None:
        for tensor in inputs:
            if tensor.op.type != "Cast" or tensor.ref() in self._producers:
                continue
            source = tensor.op.inputs[0]
            producer = self._producers.get(source.ref())
            key = (id(layer), producer, source.dtype.name, tensor.dtype.name)
            self._casts.setdefault(key, None)

# a model output is looked for behind them.
_PASS_THROUGH_OPS = ("Cast", "Identity", "IdentityN")


# Ops whose output is not computed from the step's values: the data the model
# was given, a constant, a weight.
_SOURCE_OPS = ("IteratorGetNext", "Placeholder", "Const", "ReadVariableOp", "OptionalGetValue")


def _computed_by_ops(tensor) -> bool:
    """Whether `tensor` was computed by ops (behind casts and identities),
    rather than being the data, a constant or a weight."""
    source = tensor
    while source.op.type in _PASS_THROUGH_OPS and source.op.inputs:
        source = source.op.inputs[0]
    return source.op.type not in _SOURCE_OPS and bool(source.op.inputs)


def _uncast(tensor):
    return tensor.op.inputs[0] if tensor.op.type == "Cast" and tensor.op.inputs else tensor



def _tensors(structure) -> list:
    return [t for t in tf.nest.flatten(structure) if isinstance(t, tf.Tensor)]


def _graph_tensors(tensors: list) -> list:
    """The tensors of the graph being traced: a layer may also be called, in
    it, on an eager constant it keeps (keras-hub's ViTBackbone embeds its
    `position_ids`), which has no op to follow."""
    return [t for t in tensors if tf.is_symbolic_tensor(t)]
