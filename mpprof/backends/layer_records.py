"""Layer records every backend shares: the precision inventory's layer
entries, read from Keras layers alone (policies, GEMM layouts, losses).

Framework-free: it imports neither TensorFlow nor JAX, so each backend's
`PrecisionCollector` (which sees the traced step its own way) builds its
inventory with `InventoryBuilder`.
"""

from __future__ import annotations

import collections.abc
import math
from typing import Any

from mpprof.dtypes import HALF_DTYPES, gemm_multiple
from mpprof.records import schema


def variable_path(variable) -> str:
    """Keras 3's `variable.path`; for a tf.Variable its name without ":0"."""
    path = getattr(variable, "path", None)
    if isinstance(path, str) and path:
        return path
    name = variable.name
    return name[: -len(":0")] if name.endswith(":0") else name


def variable_short_name(variable) -> str:
    """"kernel" for Keras 3's "kernel" and tf-keras's "dense/kernel:0"."""
    return variable_path(variable).split("/")[-1]


def child_layers(layer) -> list:
    """The layers `layer` holds directly (Keras' own tracking, in its order).

    The one call of Keras' private `_flatten_layers` (Keras 3 and tf-keras
    both have it; Keras has no public way to list a layer's sublayers that
    sees the ones held in attributes of a subclassed layer).
    """
    # list(): tf-keras returns a generator, Keras 3 a list.
    return list(layer._flatten_layers(include_self=False, recursive=False))


def nested_layers(model) -> list:
    """Every layer nested in `model`, at any depth, each once, in Keras' own
    order (`_flatten_layers(recursive=True)`: the order a model's variables
    follow)."""
    return list(model._flatten_layers(include_self=False, recursive=True))


def walk_layers(model) -> list[tuple[str, Any, str | None]]:
    """(qualified name, layer, parent's qualified name) of every nested layer.

    Depth first from `model` (not included); a layer reachable from several
    parents is listed once, under the first.
    """
    found: list[tuple[str, Any, str | None]] = []
    seen: set[int] = set()

    def visit(parent, parent_name: str | None) -> None:
        for child in child_layers(parent):
            if id(child) in seen or type(child).__name__ == "InputLayer":
                continue
            seen.add(id(child))
            name = child.name if parent_name is None else f"{parent_name}/{child.name}"
            found.append((name, child, parent_name))
            visit(child, name)

    visit(model, None)
    return found


def called_method(layer) -> str:
    """The name of the method `Operation.__call__` runs for `layer`:
    "quantized_call" for a quantized layer, "call" otherwise (tf-keras
    layers have no `quantization_mode`)."""
    quantized = getattr(layer, "quantization_mode", None) is not None
    return "quantized_call" if quantized else "call"


class InventoryBuilder:
    """The inventory of a model from what its backend's collector saw while
    the step was traced. A subclass fills, per layer id: `_call_order`,
    `_output_dtypes`, `_casts` ((consumer, producer, from, to) keys of an
    ordered dict), `_inputs_from`, `_inputs_made_outside_layers`, and
    `_model_output_dtypes`, `_outputs` (per model output: producer id,
    final op, units), and `_output_shapes` (per layer id: its first output's
    shape without the batch axis, for the GEMM work of the layer).

    Args:
        model: the Keras model being trained.
    """

    def __init__(self, model):
        self._model = model
        self._call_order: dict[int, int] = {}
        self._output_dtypes: dict[int, set[str]] = {}
        self._output_shapes: dict[int, list[int] | None] = {}
        # What produced each traced value, in the backend's own keys.
        self._producers: dict = {}
        self._casts: dict[tuple, None] = {}  # an ordered set
        self._model_output_dtypes: set[str] = set()
        self._inputs_from: dict[int, dict] = {}  # consumer -> ordered producers
        # Layers with an input computed by ops of no layer (their parent's
        # own code), rather than by a layer or given to the model.
        self._inputs_made_outside_layers: set[int] = set()
        self._outputs: list[dict] = []  # per model output: producer, op, units

    @property
    def traced(self) -> bool:
        return bool(self._call_order)

    def _layer_output(self, key: int, dtypes: set[str], flat_outputs: list) -> None:
        """A call of layer `key` (not the model) output `flat_outputs`, of
        `dtypes`: the first call dates it, the first output's shape (without
        the batch axis) is its GEMM's."""
        self._call_order.setdefault(key, len(self._call_order))
        self._output_dtypes.setdefault(key, set()).update(dtypes)
        if flat_outputs and key not in self._output_shapes:
            self._output_shapes[key] = self._example_shape(flat_outputs[0].shape)

    @staticmethod
    def _example_shape(shape) -> list[int] | None:
        """A layer output's shape without its batch axis (None: a scalar)."""
        return [int(d) for d in shape[1:]] if len(shape) else None

    def note_loss_input(self, y_pred) -> None:
        """`model.compute_loss` got `y_pred` (traced values): their dtypes are
        what the loss receives."""
        seen = self.__dict__.setdefault("_loss_input_dtypes", set())
        seen.update(_dtype_names(y_pred))

    def inventory(self) -> dict:
        """The inventory as a JSON-ready dict (see README, "What is recorded")."""
        model_policy = self._model.dtype_policy.name
        entries = walk_layers(self._model)
        # Mixed when the model's policy is, or any layer computes in half
        # precision (a DTypePolicyMap given to the layers, not the model).
        mixed = model_policy.startswith("mixed_") or any(
            getattr(layer, "compute_dtype", None) in HALF_DTYPES for _, layer, _ in entries
        )
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
        layers_by_id = {id(layer): layer for _, layer, _ in entries}
        layers = [
            _layer_record(
                name,
                layer,
                parent,
                is_leaf=not child_layers(layer),
                mixed=mixed,
                call_index=self._call_order.get(id(layer)),
                output_dtypes=sorted(self._output_dtypes.get(id(layer), ())),
                inputs_from=[
                    names[p] for p in self._inputs_from.get(id(layer), {}) if p in names
                ],
                inputs_made_outside_layers=id(layer) in self._inputs_made_outside_layers,
                output_shape=self._output_shapes.get(id(layer)),
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
                # What model.compute_loss received as y_pred while the step
                # traced ([]: the step never called it).
                "loss_input_dtypes": sorted(self.__dict__.get("_loss_input_dtypes", ())),
                "params": _count_params(self._model),
                "outputs": self._output_records(names, layers_by_id),
            },
            "layers": layers,
            "casts": casts,
        }


    def _output_records(self, names: dict, layers_by_id: dict) -> list[dict]:
        """Per model output: its compiled loss, from_logits, the producing
        layer, its activation and the op that produced the output."""
        losses = compiled_losses(self._model, len(self._outputs))
        records = []
        for index, (output, (loss, from_logits)) in enumerate(
            zip(self._outputs, losses, strict=False)
        ):
            producer = layers_by_id.get(output["producer"])
            records.append({
                "index": index,
                "loss": loss,
                "from_logits": from_logits,
                "producer": names.get(output["producer"]),
                "activation": _activation_name(producer) if producer is not None else None,
                "final_op": output["final_op"],
                "units": output["units"],
            })
        return records


# Ops that pass a tensor through unchanged in value class: the op that made

def _dtype_names(structure) -> set[str]:
    """The dtype names of the arrays/tensors in a nest of lists, tuples and dicts."""
    if isinstance(structure, dict):
        structure = list(structure.values())
    if isinstance(structure, (list, tuple)):
        return set().union(*(_dtype_names(item) for item in structure)) if structure else set()
    dtype = getattr(structure, "dtype", None)
    name = getattr(dtype, "name", None)
    return {name} if isinstance(name, str) else set()


def compiled_losses(model, outputs: int) -> list[tuple[str | None, bool | None]]:
    """(loss name, from_logits) per model output, from `model.loss`.

    A Loss object gives its class name and configured from_logits; a string
    or function its name and from_logits=False (Keras' default for the
    crossentropies). (None, None) wherever it cannot be read.
    """
    unknown: list[tuple[str | None, bool | None]] = [(None, None)] * outputs
    try:
        loss = getattr(model, "loss", None)
        if loss is None:
            return unknown
        if isinstance(loss, dict):
            output_names = list(getattr(model, "output_names", None) or [])
            return [_describe_loss(loss.get(n)) for n in output_names] or unknown
        if isinstance(loss, (list, tuple)):
            return [_describe_loss(item) for item in loss]
        return [_describe_loss(loss)] * outputs
    except Exception:  # noqa: BLE001 - private layouts differ across Keras versions: never raise
        return unknown


def _describe_loss(loss) -> tuple[str | None, bool | None]:
    if loss is None:
        return None, None
    if isinstance(loss, str):
        return loss, False
    config: dict = {}
    if hasattr(loss, "get_config"):
        try:
            config = loss.get_config() or {}
        except Exception:  # noqa: BLE001 - a user's loss may not serialise
            config = {}
    kwargs = getattr(loss, "_fn_kwargs", None) or {}
    from_logits = config.get("from_logits", kwargs.get("from_logits", False))
    if callable(loss) and not hasattr(loss, "get_config"):
        return getattr(loss, "__name__", None), False
    if type(loss).__name__ == "LossFunctionWrapper":  # a wrapped function
        return getattr(getattr(loss, "fn", None), "__name__", None), bool(from_logits)
    return type(loss).__name__, bool(from_logits)


def _activation_name(layer) -> str | None:
    """"softmax", "relu", "linear"...: what the layer applies last, or None."""
    if type(layer).__name__ in ("Softmax", "Sigmoid"):
        return type(layer).__name__.lower()
    activation = getattr(layer, "activation", None)
    if activation is None:
        return None
    if isinstance(activation, str):
        return activation
    return getattr(activation, "__name__", None)


def _layer_record(name, layer, parent, *, is_leaf, mixed, call_index,
                  output_dtypes, inputs_from, inputs_made_outside_layers,
                  output_shape=None) -> dict:
    policy = own_policy(layer)
    # What the layer really computes in: under a DTypePolicyMap the layer's
    # own compute_dtype differs from dtype_policy's.
    compute_dtype = getattr(layer, "compute_dtype", None) or policy.compute_dtype
    variable_dtype = getattr(layer, "variable_dtype", None) or policy.variable_dtype
    # A container's weights are its children's: only leaves (and attention,
    # whose head sizes are its own) have a GEMM of their own.
    own_gemm = is_leaf or type(layer).__name__ == "MultiHeadAttention"
    gemm = gemm_layout(layer) if own_gemm else None
    dims = [d["size"] for d in gemm] if gemm else None
    quantization_mode = getattr(policy, "quantization_mode", None)
    multiple = gemm_multiple(compute_dtype, quantization_mode)
    misaligned = [d for d in dims or () if multiple and d % multiple]
    return {
        "name": name,
        "class": type(layer).__name__,
        "parent": parent,
        "is_leaf": is_leaf,
        "call_index": call_index,
        "policy": policy.name,
        "compute_dtype": compute_dtype,
        "variable_dtype": variable_dtype,
        "output_dtypes": output_dtypes,
        # A quantized layer ("float8", "int8", "int4", ...) computes its
        # matmul on quantized values; for float8, each quantized tensor's
        # format (Keras quantize-dequantizes them in compute_dtype).
        "quantization_mode": quantization_mode,
        "quantized_formats": (dict(schema.FLOAT8_FORMATS) if quantization_mode == "float8"
                              else None),
        "inputs_from": inputs_from,
        "inputs_made_outside_layers": inputs_made_outside_layers,
        "params": _count_params(layer),
        "gemm_dims": dims,
        "gemm_roles": [d["role"] for d in gemm] if gemm else None,
        "gemm_arguments": [d["argument"] for d in gemm] if gemm else None,
        "output_shape": output_shape,
        "gemm_flops": gemm_flops(layer, dims, output_shape) if gemm else None,
        # The precision advisor sizes each GEMM from this and the element
        # counts of the numerics samples; `path` keys a DTypePolicyMap.
        "gemm_macs": (gemm_macs(layer) if own_gemm or type(layer).__name__ in _RNN_GATES
                      else None),
        "path": getattr(layer, "path", None),
        "misaligned_dims": misaligned,
        "tensor_core_friendly": (not misaligned) if (dims and multiple) else None,
        "float32_island": bool(
            mixed and is_leaf and call_index is not None
            and compute_dtype == "float32"
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


def gemm_layout(layer) -> list[dict] | None:
    """The matrix dimensions a layer's kernel contributes to its GEMM, read
    from the real kernel layout: [{"role", "size", "argument"}] (the
    constructor argument that sets it, or None), or None for layers that
    run no GEMM (no kernel, DepthwiseConv2D).

    Dense: (inputs, units). ConvND: (input channels per group, filters);
    ConvNDTranspose: its kernel is (..., filters, input channels).
    SeparableConvND: its pointwise part (input channels x depth multiplier,
    filters). EinsumDense: (contracted size, produced size) from its
    equation. MultiHeadAttention: the per-head sizes the attention GEMMs
    contract over (key_dim) and produce (value_dim).
    """
    cls = type(layer).__name__
    if cls == "MultiHeadAttention":
        key_dim = getattr(layer, "key_dim", None) or getattr(layer, "_key_dim", None)
        value_dim = getattr(layer, "value_dim", None) or getattr(layer, "_value_dim", None)
        if key_dim is None:
            return None
        return [
            _dim("key_dim (per head)", key_dim, "key_dim"),
            _dim("value_dim (per head)", value_dim or key_dim, "value_dim"),
        ]
    if "Depthwise" in cls:
        return None  # one small filter per channel: no GEMM for Tensor Cores
    if cls.startswith("SeparableConv"):
        pointwise = _weight(layer, "pointwise_kernel")
        if pointwise is None:
            return None
        shape = [int(d) for d in pointwise.shape]
        return [_dim("pointwise input channels", shape[-2], None),
                _dim("filters", shape[-1], "filters")]
    kernel = _weight(layer, "kernel")
    if kernel is None or len(kernel.shape) < 2:
        return None
    shape = [int(d) for d in kernel.shape]
    equation = getattr(layer, "equation", None)
    if isinstance(equation, str) and "->" in equation and "," in equation:
        input_spec, kernel_spec = equation.split("->")[0].split(",")[:2]
        contracted = [d for c, d in zip(kernel_spec, shape, strict=True) if c in input_spec]
        produced = [d for c, d in zip(kernel_spec, shape, strict=True) if c not in input_spec]
        return [_dim("contracted size", math.prod(contracted), None),
                _dim("output size", math.prod(produced), "output_shape")]
    if cls.startswith("Conv") and cls.endswith("Transpose"):
        return [_dim("input channels", shape[-1], None), _dim("filters", shape[-2], "filters")]
    if cls.startswith("Conv"):
        return [_dim("input channels", shape[-2], None), _dim("filters", shape[-1], "filters")]
    if len(shape) == 2:
        argument = "units" if cls == "Dense" else None
        return [_dim("input size", shape[0], None), _dim("output size", shape[1], argument)]
    return None


def gemm_flops(layer, dims: list[int], output_shape: list[int] | None) -> int | None:
    """The multiply-adds (x2) of `layer`'s GEMM per example, from its traced
    output shape (batch axis left out) and its kernel: each output value
    contracts (kernel size / output size) products. For a transposed conv
    this counts at the output's resolution (an upper bound, by the strides);
    for MultiHeadAttention its two attention GEMMs (QK^T and the weighted
    values), assuming keys as long as the queries (self-attention); its
    projections are its sublayers' own. None where the shape is unknown.

    Args:
        layer: the layer.
        dims: its `gemm_layout` sizes.
        output_shape: its first output's shape without the batch axis.
    """
    if not output_shape or any(not isinstance(d, int) for d in output_shape):
        return None
    if type(layer).__name__ == "MultiHeadAttention":
        heads = getattr(layer, "num_heads", None) or getattr(layer, "_num_heads", None)
        if not heads or len(output_shape) < 2:
            return None
        length = math.prod(output_shape[:-1])
        return int(2 * length * length * heads * sum(dims))
    kernel = _weight(layer, "pointwise_kernel")
    kernel = _weight(layer, "kernel") if kernel is None else kernel
    if kernel is None or not dims or not dims[-1]:
        return None
    contracted = math.prod(int(d) for d in kernel.shape) / dims[-1]
    return int(2 * math.prod(output_shape) * contracted)


# Gate matrices per recurrent cell step.
_RNN_GATES = {"LSTM": 4, "GRU": 3, "SimpleRNN": 1}


def gemm_macs(layer) -> dict | None:
    """How many multiply-adds the layer's GEMMs do per element of a tensor
    whose size the numerics samples count: `{"per": what, "macs": n}`.

    "output": per element of the layer's output (Dense, EinsumDense,
    ConvND: the contracted size, kernel window included; SeparableConvND:
    its pointwise part). "attention_scores": per element of the attention
    probabilities (MultiHeadAttention's softmax output: the QK^T and AV
    GEMMs, key_dim + value_dim; the advisor sizes them from its query, key
    and value projections' shapes). "attention_output": `Attention` and
    `AdditiveAttention`, sized by the advisor from their input and output
    shapes; `score_mode` "dot" (QK^T and AV are GEMMs) or "concat" (additive
    scores: only AV is). "timestep_output": per element of a
    recurrent layer's output at each timestep (gates x (inputs + units)),
    exact when the layer returns sequences. None: no GEMM of its own, or
    one this does not size (a transposed convolution).
    """
    cls = type(layer).__name__
    if cls in ("Attention", "AdditiveAttention"):
        mode = "concat" if cls == "AdditiveAttention" else str(getattr(layer, "score_mode", "dot"))
        return {"per": "attention_output", "score_mode": mode, **_attention_shapes(layer)}
    if cls == "MultiHeadAttention":
        layout = gemm_layout(layer)
        return {"per": "attention_scores",
                "macs": int(sum(d["size"] for d in layout))} if layout else None
    if cls in _RNN_GATES:
        cell = getattr(layer, "cell", layer)
        kernel = _weight(cell, "kernel")
        units = getattr(cell, "units", None)
        if kernel is None or not units:
            return None
        inputs = int(kernel.shape[0])
        gates = _RNN_GATES[cls]
        return {"per": "timestep_output", "macs": gates * (inputs + int(units)),
                "inputs": inputs, "units": int(units), "gates": gates,
                "return_sequences": bool(getattr(layer, "return_sequences", False))}
    if "Depthwise" in cls or cls.endswith("Transpose"):
        return None
    kernel = _weight(layer, "pointwise_kernel" if cls.startswith("SeparableConv")
                     else "kernel")
    if kernel is None or len(kernel.shape) < 2:
        return None
    layout = gemm_layout(layer)
    if layout is None:
        return None
    if getattr(layer, "equation", None):
        return {"per": "output", "macs": int(layout[0]["size"])}
    shape = [int(d) for d in kernel.shape]
    return {"per": "output", "macs": int(math.prod(shape[:-1]))}


def _attention_shapes(layer) -> dict:
    """`Attention`'s query and value shapes without the batch axis, as Keras 3
    built it (`[query, value(, key)]`); {} where not known (tf-keras)."""
    built = (getattr(layer, "_build_shapes_dict", None) or {}).get("input_shape")
    if not isinstance(built, (list, tuple)) or len(built) < 2:
        return {}
    query, value = built[0], built[1]
    if not all(isinstance(s, (list, tuple)) and len(s) >= 2 and
               all(isinstance(d, int) for d in s[1:]) for s in (query, value)):
        return {}
    return {"query_shape": [int(d) for d in query[1:]],
            "value_shape": [int(d) for d in value[1:]]}


def gemm_dims(layer) -> list[int] | None:
    """The sizes of `gemm_layout(layer)`, or None."""
    layout = gemm_layout(layer)
    return [d["size"] for d in layout] if layout else None


def _dim(role: str, size, argument: str | None) -> dict:
    return {"role": role, "size": int(size), "argument": argument}


def _weight(layer, short_name: str):
    # tf-keras names it "dense/kernel:0", Keras 3 "kernel".
    return next((w for w in layer.weights if variable_short_name(w) == short_name), None)


def _count_params(layer) -> int:
    return int(sum(math.prod(w.shape) for w in layer.weights))

