"""Precision rules read from the inventory: half-precision model output
(MP006), Tensor Core shape lint (MP007, float8 layers included), policy set
after building (MP009) and a probability loss on an output that is not a
probability (MP014)."""

from __future__ import annotations

import math

import numpy as np

from mpprof.diagnosis.core import NotApplicable, NotMeasured, finding, rule
from mpprof.diagnosis.numerics import MAX_LAYER_FINDINGS
from mpprof.diagnosis.view import RunView, layer_dtype
from mpprof.dtypes import (
    FLOAT8_GEMM_MULTIPLE,
    HALF_DTYPES,
    TENSOR_CORE_MULTIPLE,
    gemm_multiple,
)

# Losses that expect probabilities unless from_logits=True, by the names
# Keras gives their classes and functions.
PROBABILITY_LOSSES = {
    "CategoricalCrossentropy", "SparseCategoricalCrossentropy", "BinaryCrossentropy",
    "categorical_crossentropy", "sparse_categorical_crossentropy", "binary_crossentropy",
}
# Graph ops and activations that produce probabilities.
PROBABILITY_OPS = ("Softmax", "Sigmoid")
PROBABILITY_ACTIVATIONS = ("softmax", "sigmoid")

_FLOAT32_ACTIVATION = '"%s", dtype="float32"'


@rule("MP006", "warning", "model output (what the loss sees) is float16/bfloat16",
      view="inventory", data="inventory")
def half_output(view: RunView) -> list:
    """What the loss sees is float16/bfloat16: the last layer was not given
    dtype="float32"."""
    view.require_mixed()
    inventory = view.require_inventory()
    outputs = inventory.get("model", {}).get("output_dtypes", [])
    half = [dtype for dtype in outputs if dtype in HALF_DTYPES]
    if not half:
        return []
    last = view.last_half_layer()
    cls = view.layer_class(last)
    evidence = {"model_output_dtypes": outputs, "last_layer": last, "last_layer_class": cls}
    fix = (
        f"The loss sees {half[0]} predictions: softmax/logits in {half[0]} lose "
        "precision and can overflow. Give the last layer float32:\n"
        f"    {view.syntax.layer(cls)}   # {last}\n"
        "or append a float32 activation:\n"
        f"    outputs = {view.syntax.layer('Activation', _FLOAT32_ACTIVATION % 'linear')}(outputs)"
    )
    title = f"The model's output is {'/'.join(half)}: the loss sees half precision"
    return [finding("MP006", title, layer=last, evidence=evidence, fix=fix)]


@rule("MP007", "info", "GEMM dimension not a multiple of 8 (16 for float8; Tensor Cores)",
      view="inventory", data="inventory")
def tensor_core_shapes(view: RunView) -> list:
    """A GEMM dimension of a layer computing in float16/bfloat16 is not a
    multiple of `TENSOR_CORE_MULTIPLE`, or of a float8 layer not a multiple
    of `FLOAT8_GEMM_MULTIPLE` (`mpprof.dtypes.gemm_multiple`), read from the
    layer's real kernel layout (Dense, EinsumDense, ConvND, ConvNDTranspose,
    SeparableConv's pointwise part, MultiHeadAttention's head sizes).
    DepthwiseConv2D is not a GEMM and is not judged. One finding per layer,
    up to `MAX_LAYER_FINDINGS`, then one summarising the rest."""
    if not any(layer.get("quantization_mode") == "float8" for layer in view.leaf_layers):
        view.require_mixed()
    inventory = view.require_inventory()
    misaligned = []
    for layer in inventory.get("layers", []):
        multiple = _gemm_multiple(layer)
        if multiple is None:
            continue
        if layer.get("call_index") is None and layer.get("is_leaf"):
            continue
        dims = layer.get("gemm_dims") or []
        odd = [d for d in dims if d % multiple]
        if odd:
            misaligned.append((layer, dims, odd, multiple))
    findings = []
    for layer, dims, odd, multiple in misaligned[:MAX_LAYER_FINDINGS]:
        roles = layer.get("gemm_roles") or ["input size", "output size"]
        arguments = layer.get("gemm_arguments") or [None, None]
        float8 = multiple == FLOAT8_GEMM_MULTIPLE
        changes = [
            f"{role} {d} -> {_round_up(d, multiple)}"
            for role, d in zip(roles, dims, strict=False) if d % multiple
        ]
        lines = [
            f"Round {', '.join(changes)} (a multiple of {multiple}) so the GEMM runs on "
            + ("FP8 Tensor Cores without padding: compiled by XLA for a GPU with FP8 "
               "Tensor Cores, a float8 layer's matmul is cuBLASLt's FP8 GEMM, and XLA "
               "pads both operands to multiples of 16 on every call otherwise"
               if float8 else "Tensor Cores at full speed")
        ]
        for role, d, argument in zip(roles, dims, arguments, strict=False):
            if d % multiple and argument:
                rounded = f"{argument}={_round_up(d, multiple)}, ..."
                lines.append(f"    {view.syntax.layer(layer['class'], rounded)}")
            elif d % multiple:
                lines.append(
                    f"    ({role} {d}: pad the features, or the previous layer's "
                    f"units/filters, to a multiple of {multiple})"
                )
        evidence = {
            "gemm_dims": dims,
            "gemm_roles": roles,
            "misaligned_dims": odd,
            "multiple": multiple,
            "compute_dtype": layer.get("compute_dtype"),
            "quantization_mode": layer.get("quantization_mode"),
        }
        title = (
            f"{layer['name']}: GEMM dimension(s) {odd} not a multiple of {multiple} "
            + ("(float8 GEMM)" if float8 else "(Tensor Cores)")
        )
        findings.append(finding("MP007", title, layer=layer["name"], evidence=evidence,
                                fix="\n".join(lines)))
    rest = misaligned[MAX_LAYER_FINDINGS:]
    if rest:
        findings.append(finding(
            "MP007",
            f"{len(rest)} more layers with GEMM dimensions not a multiple of "
            f"{TENSOR_CORE_MULTIPLE} (float16/bfloat16) or {FLOAT8_GEMM_MULTIPLE} (float8)",
            evidence={"layers": {layer["name"]: odd for layer, _, odd, _ in rest}},
            fix="Round each listed dimension up to the multiple its layer needs: "
                f"{TENSOR_CORE_MULTIPLE} in float16/bfloat16, {FLOAT8_GEMM_MULTIPLE} in float8.",
        ))
    return findings


def _gemm_multiple(layer: dict) -> int | None:
    """The multiple `layer`'s GEMM should have, by the dtype it really
    computed in (traced, else its compute dtype) and its quantization."""
    dtype = layer_dtype(layer)
    if dtype not in HALF_DTYPES:
        dtype = layer.get("compute_dtype")
    return gemm_multiple(dtype, layer.get("quantization_mode"))


def _round_up(value: int, multiple: int) -> int:
    return -(-int(value) // multiple) * multiple


@rule("MP009", "warning", "mixed policy set, but the model's layers are float32",
      view="overview", data="context, inventory")
def policy_after_build(view: RunView) -> list:
    """The global policy is mixed, but every layer computes in float32: the
    policy was set after the model was built."""
    global_policy = view.context.global_policy
    if global_policy is None:
        raise NotMeasured("no run context was recorded")
    if not global_policy.startswith("mixed_"):
        raise NotApplicable(f"the global policy is {global_policy}")
    if view.half_dtype is not None:
        return []
    evidence = {
        "global_policy": global_policy,
        "model_policy": view.policy,
        "float32_layers": len(view.leaf_layers),
    }
    fix = (
        f"The global policy is {global_policy}, but the model was built before it was "
        "set, so every layer computes in float32 and nothing is gained. Set it first:\n"
        f"    {view.syntax.set_policy(global_policy)}\n"
        "    model = build_model()   # after the policy\n"
        "    model.compile(...)"
    )
    title = f"Global policy is {global_policy} but the model's layers are float32"
    return [finding("MP009", title, evidence=evidence, fix=fix)]


@rule("MP014", "critical", "probability loss on an output that is not a probability",
      view="inventory", data="inventory (model outputs)")
def logits_into_probability_loss(view: RunView) -> list:
    """A loss that expects probabilities (categorical, sparse categorical or
    binary crossentropy with from_logits=False) is computed on a model output
    that no softmax/sigmoid produced: Keras clips the raw logits into
    [1e-7, 1 - 1e-7] and the model does not learn."""
    inventory = view.require_inventory()
    outputs = inventory.get("model", {}).get("outputs")
    if not isinstance(outputs, list) or not outputs:
        raise NotMeasured("the compiled loss and the output activations were not recorded")
    judged, wrong = 0, []
    for output in outputs:
        loss = output.get("loss")
        if loss is None or output.get("from_logits") is None:
            continue
        if loss not in PROBABILITY_LOSSES:
            judged += 1
            continue
        if output["from_logits"]:
            judged += 1
            continue
        op, activation = output.get("final_op"), output.get("activation")
        if op is None and activation is None:
            continue
        judged += 1
        if op in PROBABILITY_OPS or activation in PROBABILITY_ACTIVATIONS:
            continue
        wrong.append(output)
    if not judged:
        raise NotMeasured("the loss or the output's activation could not be read")
    findings = []
    for output in wrong:
        evidence = {k: output.get(k) for k in (
            "index", "loss", "from_logits", "final_op", "activation", "producer", "units"
        )}
        evidence.update(_recorded_loss(view, output.get("units")))
        layer = output.get("producer")
        fix = (
            f"{output['loss']} expects probabilities, but {layer or 'the output'} "
            f"outputs raw values (last op {output.get('final_op')}). Keras clips them "
            "into [1e-7, 1 - 1e-7], so the loss is meaningless and the model does not "
            "learn. Tell the loss it gets logits (the numerically stable path, and no "
            "half-precision softmax):\n"
            f"    model.compile(loss={view.syntax.module}.losses."
            f"{_loss_class(output['loss'])}(from_logits=True), ...)\n"
            "or end the model in a float32 softmax:\n"
            f"    outputs = {view.syntax.layer('Activation', _FLOAT32_ACTIVATION % 'softmax')}"
            "(outputs)"
        )
        title = (
            f"{output['loss']} (from_logits=False) on {layer or 'a model output'}, "
            "which is not a softmax/sigmoid output: the model trains on clipped logits"
        )
        findings.append(finding("MP014", title, layer=layer, evidence=evidence, fix=fix))
    return findings


def _loss_class(name: str) -> str:
    if name[0].isupper():
        return name
    return "".join(part.capitalize() for part in name.split("_"))


def _recorded_loss(view: RunView, units) -> dict:
    """The recorded loss beside chance level (log of the class count): a
    probability loss on logits sits far above it (confirmation)."""
    numerics = view.numerics
    if not view.loss_watched or numerics is None or not len(numerics.steps):
        return {"recorded_loss": None}
    loss = np.asarray(numerics.loss, dtype=np.float64)
    loss = loss[np.isfinite(loss)]
    if not len(loss):
        return {"recorded_loss": None}
    evidence = {"recorded_loss": float(np.median(loss))}
    if isinstance(units, int) and units > 1:
        evidence["chance_loss"] = round(math.log(units), 4)
        evidence["loss_above_chance"] = bool(np.median(loss) > math.log(units))
    return evidence
