"""The precision inventory on PyTorch: every layer's dtypes, float32 islands and casts.

Policies are read from the layers (`mpprof.backends.layer_records`); the
dtypes each layer ACTUALLY outputs, the call order, which layers feed which
and the casts between them are seen in the fit's first step, through the
layer wrappers of `LayerCallPatch` (active for that call): the values are
the real tensors the step computes, so their dtypes are the ones computed
in. The step runs eagerly: once the model's own call returned, the tracer
lets go of the tensors it saw (their ids would otherwise be reused) and
records nothing more.

As on JAX, no graph tells the op that made a model output (`final_op` is
None: the rule that reads it then judges from the layer's activation alone).
"""

from __future__ import annotations

import torch

from mpprof.backends.layer_records import InventoryBuilder
from mpprof.backends.torch.layer_calls import cast_source, clear_casts


def _tensors(structure) -> list:
    """The tensors in a nest of lists, tuples and dicts (a layer's outputs,
    or its args and kwargs)."""
    found: list = []
    stack = [structure]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
    return found


def dtype_name(tensor: torch.Tensor) -> str:
    """Keras' name of a torch dtype ("float16", "bfloat16", "float8_e4m3fn")."""
    return str(tensor.dtype).removeprefix("torch.")


class PrecisionTracer(InventoryBuilder):
    """Builds the precision inventory of `model`; a `LayerCallPatch` hook."""

    def __init__(self, model):
        self._model = model
        self._call_order: dict[int, int] = {}
        self._output_dtypes: dict[int, set[str]] = {}
        self._output_shapes: dict[int, list[int] | None] = {}
        self._producers: dict[int, tuple] = {}
        self._casts: dict[tuple, None] = {}
        self._model_output_dtypes: set[str] = set()
        self._inputs_from: dict[int, dict] = {}
        self._inputs_made_outside_layers: set[int] = set()
        self._outputs: list[dict] = []
        self._done = False

    def note_loss_input(self, y_pred) -> None:
        """`model.compute_loss` got `y_pred`: their dtypes are what the loss
        receives (torch dtypes have no `.name`: named here)."""
        seen = self.__dict__.setdefault("_loss_input_dtypes", set())
        seen.update(dtype_name(t) for t in _tensors(y_pred))

    @property
    def traced(self) -> bool:
        return self._done or bool(self._call_order)

    def _producer(self, value) -> int | None:
        entry = self._producers.get(id(value))
        return entry[0] if entry is not None and entry[1] is value else None

    def on_call(self, layer, args, kwargs, outputs):
        if self._done:
            return outputs
        key = id(layer)
        flat_outputs = _tensors(outputs)
        dtypes = {dtype_name(t) for t in flat_outputs}
        if layer is self._model:
            self._model_output_dtypes |= dtypes
            if flat_outputs and not self._outputs:
                self._outputs = [
                    {"producer": self._producer(t), "final_op": None,
                     "units": int(t.shape[-1]) if t.ndim else None}
                    for t in flat_outputs
                ]
        else:
            self._call_order.setdefault(key, len(self._call_order))
            self._output_dtypes.setdefault(key, set()).update(dtypes)
            if flat_outputs and key not in self._output_shapes:
                # Without the batch axis.
                shape = flat_outputs[0].shape
                self._output_shapes[key] = [int(d) for d in shape[1:]] if len(shape) else None
        producers = self._inputs_from.setdefault(key, {})
        for value in _tensors((args, kwargs)):
            source = cast_source(value)
            producer = self._producer(source if source is not None else value)
            if source is not None:
                self._casts.setdefault((key, producer, dtype_name(source), dtype_name(value)),
                                       None)
            if producer is not None and producer != key:
                producers.setdefault(producer, None)
        for value in flat_outputs:
            self._producers[id(value)] = (key, value)
        if layer is self._model:
            # The forward pass is over: let go of its tensors.
            self._done = True
            self._producers.clear()
            clear_casts()
        return outputs
