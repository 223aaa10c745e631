"""The precision inventory on JAX: every layer's dtypes, float32 islands and casts.

Policies are read from the layers (`mpprof.backends.layer_records`); the
dtypes each layer ACTUALLY outputs, the call order, which layers feed which
and the casts between them are seen while `jax.jit` traces the train step,
through the layer wrappers of `LayerCallPatch`: the values a layer sees then
are tracers, whose dtype is the one the compiled step computes in. Tracing
happens once, so this costs nothing per step.

What TensorFlow's graph tells and a JAX trace does not: the op that made a
model output (`final_op` is None: the rule that reads it then judges from
the layer's activation alone) and whether an input was computed by a
parent's own ops (a layer input of no known producer that is not the data).
"""

from __future__ import annotations

import jax

from mpprof.backends.layer_casts import cast_source
from mpprof.backends.layer_records import InventoryBuilder


def _arrays(structure) -> list:
    return [t for t in jax.tree_util.tree_leaves(structure) if isinstance(t, jax.Array)]


def _traced(values: list) -> list:
    """The values of the function being traced (a layer may also be called on
    a concrete array it keeps)."""
    return [t for t in values if isinstance(t, jax.core.Tracer)]


class PrecisionTracer(InventoryBuilder):
    """Builds the precision inventory of `model`; a `LayerCallPatch` hook."""

    def __init__(self, model):
        self._model = model
        self._call_order: dict[int, int] = {}
        self._output_dtypes: dict[int, set[str]] = {}
        self._output_shapes: dict[int, list[int] | None] = {}
        # By id of a traced value: (the layer that output it, the value).
        self._producers: dict[int, tuple] = {}
        self._casts: dict[tuple, None] = {}
        self._model_output_dtypes: set[str] = set()
        self._inputs_from: dict[int, dict] = {}
        self._inputs_made_outside_layers: set[int] = set()
        self._outputs: list[dict] = []

    @property
    def traced(self) -> bool:
        return bool(self._call_order)

    def _producer(self, value) -> int | None:
        entry = self._producers.get(id(value))
        return entry[0] if entry is not None and entry[1] is value else None

    def on_call(self, layer, args, kwargs, outputs):
        key = id(layer)
        flat_outputs = _arrays(outputs)
        dtypes = {jax.numpy.dtype(t.dtype).name for t in flat_outputs}
        traced_outputs = _traced(flat_outputs)
        if layer is self._model:
            self._model_output_dtypes |= dtypes
            if traced_outputs and not self._outputs:
                self._outputs = [
                    {"producer": self._producer(t), "final_op": None,
                     "units": int(t.shape[-1]) if t.ndim else None}
                    for t in traced_outputs
                ]
        else:
            self._call_order.setdefault(key, len(self._call_order))
            self._output_dtypes.setdefault(key, set()).update(dtypes)
            if flat_outputs and key not in self._output_shapes:
                # Without the batch axis.
                shape = flat_outputs[0].shape
                self._output_shapes[key] = [int(d) for d in shape[1:]] if len(shape) else None
        producers = self._inputs_from.setdefault(key, {})
        for value in _traced(_arrays((args, kwargs))):
            source = cast_source(value)
            producer = self._producer(source if source is not None else value)
            if source is not None:
                self._casts.setdefault((key, producer, jax.numpy.dtype(source.dtype).name,
                                        jax.numpy.dtype(value.dtype).name), None)
            if producer is not None and producer != key:
                producers.setdefault(producer, None)
        for value in traced_outputs:
            self._producers[id(value)] = (key, value)
        return outputs
