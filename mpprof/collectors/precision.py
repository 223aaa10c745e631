"""The precision inventory: every layer's dtypes, float32 islands and casts.

Policies are read from the layers; the dtypes a layer ACTUALLY outputs, the
call order and the casts between layers are seen while the train step is
traced, through `LayerCallPatch`. Tracing happens once, so this costs nothing
per step.
"""

from __future__ import annotations

import collections.abc
import math

import tensorflow as tf

from mpprof.collectors.layer_calls import walk_layers
from mpprof.tf_keras_support import variable_short_name

# Tensor Cores run float16/bfloat16 GEMMs at full speed only when the matrix
# dimensions are multiples of 8 (NVIDIA's "Matrix Multiplication Background
# User's Guide"; cuBLAS pads or falls back otherwise).
TENSOR_CORE_MULTIPLE = 8
HALF_DTYPES = ("float16", "bfloat16")


class PrecisionCollector:
    """Builds the precision inventory of `model`; a `LayerCallPatch` hook.

    Args:
        model: the Keras model being trained.
    """

    def __init__(self, model):
        self._model = model
        self._call_order: dict[int, int] = {}
        self._output_dtypes: dict[int, set[str]] = {}
        self._producers: dict = {}
        self._casts: dict[tuple, None] = {}  # an ordered set
        self._model_output_dtypes: set[str] = set()

    @property
    def traced(self) -> bool:
        return bool(self._call_order)

    def on_call(self, layer, args, kwargs, outputs):
        key = id(layer)
        flat_outputs = _tensors(outputs)
        dtypes = {t.dtype.name for t in flat_outputs}
        if layer is self._model:
            self._model_output_dtypes |= dtypes
        else:
            self._call_order.setdefault(key, len(self._call_order))
            self._output_dtypes.setdefault(key, set()).update(dtypes)
        if not tf.executing_eagerly():
            self._record_casts(layer, _tensors((args, kwargs)))
            for tensor in flat_outputs:
                self._producers[tensor.ref()] = key
        return outputs

    def _record_casts(self, layer, inputs) -> None:
        for tensor in inputs:
            if tensor.op.type != "Cast":
                continue
            source = tensor.op.inputs[0]
            producer = self._producers.get(source.ref())
            key = (id(layer), producer, source.dtype.name, tensor.dtype.name)
            self._casts.setdefault(key, None)

    def inventory(self) -> dict:
        """The inventory as a JSON-ready dict (see README, "What is recorded")."""
        model_policy = self._model.dtype_policy.name
        mixed = model_policy.startswith("mixed_")
        entries = walk_layers(self._model)
        names = {id(layer): name for name, layer, _ in entries}
        casts = [
            {
                "layer": names.get(consumer),
                "from_layer": names.get(producer),
                "from_dtype": from_dtype,
                "to_dtype": to_dtype,
            }
            for consumer, producer, from_dtype, to_dtype in self._casts
        ]
        layers = [
            _layer_record(
                name,
                layer,
                parent,
                # list(): tf-keras returns a generator, Keras 3 a list.
                is_leaf=not list(layer._flatten_layers(include_self=False, recursive=False)),
                mixed=mixed,
                call_index=self._call_order.get(id(layer)),
                output_dtypes=sorted(self._output_dtypes.get(id(layer), ())),
            )
            for name, layer, parent in entries
        ]
        layers.sort(key=lambda r: (r["call_index"] is None, r["call_index"] or 0))
        return {
            "model": {
                "name": self._model.name,
                "class": type(self._model).__name__,
                "policy": model_policy,
                "output_dtypes": sorted(self._model_output_dtypes),
                "params": _count_params(self._model),
            },
            "layers": layers,
            "casts": casts,
        }


def _layer_record(name, layer, parent, *, is_leaf, mixed, call_index,
                  output_dtypes) -> dict:
    policy = own_policy(layer)
    dims = gemm_dims(layer)
    half = policy.compute_dtype in HALF_DTYPES
    misaligned = [d for d in dims or () if d % TENSOR_CORE_MULTIPLE]
    return {
        "name": name,
        "class": type(layer).__name__,
        "parent": parent,
        "is_leaf": is_leaf,
        "call_index": call_index,
        "policy": policy.name,
        "compute_dtype": policy.compute_dtype,
        "variable_dtype": policy.variable_dtype,
        "output_dtypes": output_dtypes,
        "params": _count_params(layer),
        "gemm_dims": dims,
        "misaligned_dims": misaligned if half else [],
        "tensor_core_friendly": (not misaligned) if (dims and half) else None,
        "float32_island": bool(
            mixed and is_leaf and call_index is not None
            and policy.compute_dtype == "float32"
        ),
    }


def own_policy(layer):
    """The policy `layer` computes with.

    A Keras 3 `DTypePolicyMap` given as a layer's dtype (and passed on to its
    sublayers) holds one policy per layer path: `layer.dtype_policy` is the
    whole map, `layer.compute_dtype` the entry for the layer's own path.
    """
    policy = layer.dtype_policy
    if isinstance(policy, collections.abc.Mapping):
        path = getattr(layer, "path", None)
        return policy[path] if path else policy.default_policy
    return policy


def gemm_dims(layer) -> list[int] | None:
    """The matrix dimensions a layer's kernel contributes to its GEMM.

    Dense: (inputs, units); ConvND: (input channels per group, filters);
    EinsumDense (and so MultiHeadAttention's projections): (contracted size,
    produced size) read from its equation. None for layers without a kernel.
    """
    # tf-keras names it "dense/kernel:0", Keras 3 "kernel".
    kernel = next((w for w in layer.weights if variable_short_name(w) == "kernel"), None)
    if kernel is None or len(kernel.shape) < 2:
        return None
    shape = [int(d) for d in kernel.shape]
    equation = getattr(layer, "equation", None)
    if isinstance(equation, str) and "->" in equation and "," in equation:
        input_spec, kernel_spec = equation.split("->")[0].split(",")[:2]
        contracted = [d for c, d in zip(kernel_spec, shape, strict=True) if c in input_spec]
        produced = [d for c, d in zip(kernel_spec, shape, strict=True) if c not in input_spec]
        return [math.prod(contracted), math.prod(produced)]
    return shape[-2:]


def _count_params(layer) -> int:
    return int(sum(math.prod(w.shape) for w in layer.weights))


def _tensors(structure) -> list:
    return [t for t in tf.nest.flatten(structure) if isinstance(t, tf.Tensor)]
