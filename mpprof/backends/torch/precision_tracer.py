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

from mpprof.backends.layer_casts import CastTracer
from mpprof.backends.torch.layer_calls import clear_casts


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


class PrecisionTracer(CastTracer):
    """Builds the precision inventory of `model`; a `LayerCallPatch` hook."""

    def __init__(self, model):
        super().__init__(model)
        self._done = False

    def note_loss_input(self, y_pred) -> None:
        """`model.compute_loss` got `y_pred`: their dtypes are what the loss
        receives (torch dtypes have no `.name`: named here)."""
        seen = self.__dict__.setdefault("_loss_input_dtypes", set())
        seen.update(dtype_name(t) for t in _tensors(y_pred))

    @property
    def traced(self) -> bool:
        return self._done or bool(self._call_order)

    def _values(self, structure) -> list:
        return _tensors(structure)

    def _dtype_name(self, value) -> str:
        return dtype_name(value)

    def on_call(self, layer, args, kwargs, outputs):
        if self._done:
            return outputs
        outputs = super().on_call(layer, args, kwargs, outputs)
        if layer is self._model:
            # The forward pass is over: let go of its tensors.
            self._done = True
            self._producers.clear()
            clear_casts()
        return outputs
