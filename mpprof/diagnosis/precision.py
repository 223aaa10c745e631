"""Precision rules read from the inventory: half-precision model output
(MP006), Tensor Core shape lint (MP007, float8 layers included), policy set
after building (MP009) and a probability loss on an output that is not a
probability (MP014)."""

from __future__ import annotations

import math

import numpy as np

from mpprof.diagnosis.core import NotApplicable, NotMeasured, finding, rule
from mpprof.diagnosis.view import RunView, layer_dtype
from mpprof.dtypes import (
    FLOAT8_GEMM_MULTIPLE,
    HALF_DTYPES,
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
    dtype="float32". What the loss sees is the `y_pred` that
    `model.compute_loss` received as the step traced, else the model's output;
    a custom train_step that computes its loss without `compute_loss` (and
    a model that records no output) is "not measured"."""
    view.require_mixed()
    inventory = view.require_inventory()
    model = inventory.get("model", {})
    outputs = model.get("output_dtypes", [])
    loss_inputs = model.get("loss_input_dtypes")
    seen = loss_inputs or outputs
    if not seen:
        raise NotMeasured(
            "what the loss receives was not seen: Keras recorded no model output "
            "(a subclassed model whose custom train_step calls its sublayers) and the "
            "step computed its loss without model.compute_loss"
            if loss_inputs is not None else
            "Keras recorded no model output dtype (a subclassed model's custom train_step?)")
    half = [dtype for dtype in seen if dtype in HALF_DTYPES]
    if not half:
        return []
    last = view.last_half_layer()
    cls = view.layer_class(last)
    evidence = {"model_output_dtypes": outputs, "loss_input_dtypes": loss_inputs,
                "last_layer": last, "last_layer_class": cls}
    fix = (
        f"The loss sees {half[0]} predictions: softmax/logits in {half[0]} lose "
        "precision and can overflow. Give the last layer float32:\n"
        f"    {view.syntax.layer(cls)}   # {last}\n"
        "or append a float32 activation:\n"
        f"    outputs = {view.syntax.layer('Activation', _FLOAT32_ACTIVATION % 'linear')}(outputs)"
    )
    title = f"The model's output is {'/'.join(half)}: the loss sees half precision"
    return [finding("MP006", title, layer=last, evidence=evidence, fix=fix)]


# MP007: a layer whose GEMMs are less than this share of the model's GEMM
# work (multiply-adds per example, from the traced output shapes) is not
# judged: even at a fraction of Tensor Core speed it costs the step at most a
# few percent, which rounding its sizes cannot win back.
MIN_GEMM_FLOPS_SHARE = 0.05


@rule("MP007", "info", "GEMM dimension not a multiple of 8 (16 for float8; Tensor Cores)",
      view="inventory", data="inventory, hardware")
def tensor_core_shapes(view: RunView) -> list:
    """On a GPU run (or a stated projection: `mpprof diagnose --assume-gpu`),
    a GEMM dimension of a layer computing in float16/bfloat16 is not a
    multiple of `mpprof.dtypes.TENSOR_CORE_MULTIPLE`, or of a float8 layer not a multiple
    of `FLOAT8_GEMM_MULTIPLE` (16), read from the layer's real kernel layout
    (Dense, EinsumDense, ConvND, ConvNDTranspose, SeparableConv's pointwise
    part, MultiHeadAttention's head sizes), where the layer's GEMMs are at
    least `MIN_GEMM_FLOPS_SHARE` of the model's GEMM work. Never judged:
    sizes the task or the data set (the output size of the GEMM layer that
    made a model output, or, where Keras recorded none, of the last GEMM
    layer called; the input size of a layer that no sized layer (a GEMM, an
    Embedding) precedes: the data's channels or features), layers computing
    in float32, and the layer MP006's fix makes float32 (a float8 GEMM stays
    one). One finding listing the layers."""
    float8 = any(layer.get("quantization_mode") == "float8" for layer in view.leaf_layers)
    if not float8:
        view.require_mixed()
    inventory = view.require_inventory()
    hardware = view.hardware
    projected = view.assume_gpu
    if not projected:
        if hardware is None:
            raise NotMeasured("whether the run had a GPU was not recorded "
                              "(mpprof diagnose --assume-gpu judges it as a projection)")
        if hardware.get("cpu_only") or not hardware.get("gpus"):
            raise NotApplicable(
                "no GPU: Tensor Core shapes do not matter on this run (mpprof diagnose "
                "--assume-gpu judges them as a projection for a GPU)")
    layers = [layer for layer in inventory.get("layers", [])
              if layer.get("call_index") is not None or not layer.get("is_leaf")]
    total = sum(layer.get("gemm_flops") or 0 for layer in layers)
    fixed = _sizes_set_by_task_or_data(view, layers)
    float32_by_fix = _made_float32_by_mp006(view)
    misaligned, skipped = [], {}
    for layer in layers:
        multiple = _gemm_multiple(layer)
        dims = layer.get("gemm_dims") or []
        # MP006's float32 takes a layer off the half-precision Tensor Cores,
        # not off a float8 GEMM (quantized whatever it dequantizes to).
        if multiple is None or not dims or (
                layer["name"] in float32_by_fix and multiple != FLOAT8_GEMM_MULTIPLE):
            continue
        share = (layer["gemm_flops"] / total
                 if total and layer.get("gemm_flops") is not None else None)
        odd = [i for i, d in enumerate(dims) if d % multiple]
        kept = [i for i in odd if (layer["name"], i) not in fixed]
        for i in odd:
            if (layer["name"], i) in fixed:
                skipped[layer["name"]] = fixed[(layer["name"], i)]
        if not kept:
            continue
        if total and (share is None or share < MIN_GEMM_FLOPS_SHARE):
            skipped.setdefault(
                layer["name"],
                f"{0 if share is None else share:.1%} of the GEMM work "
                f"(below {MIN_GEMM_FLOPS_SHARE:.0%})")
            continue
        misaligned.append((layer, dims, kept, multiple, share))
    if not misaligned:
        return []
    lines = [
        f"Round these GEMM sizes (each layer's GEMMs are at least {MIN_GEMM_FLOPS_SHARE:.0%} "
        "of the model's GEMM work) so they run on Tensor Cores at full speed"
        + (" (a projection: this run had no GPU)" if _no_gpu(hardware) else "") + ":"
    ]
    listed = {}
    for layer, dims, kept, multiple, share in misaligned:
        roles = layer.get("gemm_roles") or ["input size", "output size"]
        arguments = layer.get("gemm_arguments") or [None, None]
        changes = [f"{roles[i]} {dims[i]} -> {_round_up(dims[i], multiple)}" for i in kept]
        note = f"{share:.0%} of the GEMM work" if share is not None else "share unknown"
        if multiple == FLOAT8_GEMM_MULTIPLE:
            note += f"; {view.syntax.float8_gemm}"
        lines.append(f"  {layer['name']} ({note}): {', '.join(changes)}")
        for i in kept:
            if arguments[i]:
                rounded = f"{arguments[i]}={_round_up(dims[i], multiple)}, ..."
                lines.append(f"    {view.syntax.layer(layer['class'], rounded)}")
            else:
                lines.append(
                    f"    ({roles[i]} {dims[i]}: round the previous layer's units/filters "
                    f"to a multiple of {multiple})")
        listed[layer["name"]] = {
            "gemm_dims": dims,
            "gemm_roles": roles,
            "misaligned_dims": [dims[i] for i in kept],
            "multiple": multiple,
            "gemm_flops_share": None if share is None else round(share, 4),
            "compute_dtype": layer.get("compute_dtype"),
            "quantization_mode": layer.get("quantization_mode"),
        }
    evidence = {
        "layers": listed,
        "min_gemm_flops_share": MIN_GEMM_FLOPS_SHARE,
        "projection": _no_gpu(hardware),
        "not_judged": skipped,
    }
    names = list(listed)
    multiples = sorted({m for _, _, _, m, _ in misaligned})
    title = (
        f"{len(names)} layer{'s' if len(names) > 1 else ''} with GEMM sizes not a multiple "
        f"of {' or '.join(map(str, multiples))} (Tensor Cores): {', '.join(names[:5])}"
        + (", ..." if len(names) > 5 else "")
    )
    return [finding("MP007", title, layer=names[0] if len(names) == 1 else None,
                    evidence=evidence, fix="\n".join(lines))]


def _no_gpu(hardware: dict | None) -> bool:
    return hardware is None or bool(hardware.get("cpu_only")) or not hardware.get("gpus")


def _sizes_set_by_task_or_data(view: RunView, layers: list[dict]) -> dict:
    """{(layer, GEMM dim index): why}: the sizes a user cannot round.

    An output layer's output size is the task's (class count, a regression
    target, an image's channels): the GEMM layer that made a model output
    (behind layers without a GEMM, such as a float32 Activation), or, where
    Keras recorded no model output (a custom train_step), the last GEMM layer
    called. A layer's input size is the data's when no sized layer (one with
    a GEMM, or an Embedding) precedes it: the inputs' channels or features."""
    by_name = {layer["name"]: layer for layer in layers}
    heads = set()
    for output in (view.inventory or {}).get("model", {}).get("outputs") or ():
        name = output.get("producer") if isinstance(output, dict) else None
        while name in by_name and not by_name[name].get("gemm_dims"):
            parents = by_name[name].get("inputs_from") or []
            name = parents[0] if len(parents) == 1 else None
        if name in by_name:
            heads.add(name)
    if not heads:
        called = [layer for layer in layers
                  if layer.get("gemm_dims") and layer.get("call_index") is not None]
        if called:
            heads.add(max(called, key=lambda layer: layer["call_index"])["name"])

    def sized_before(name: str, seen: set) -> bool:
        for parent in (by_name.get(name) or {}).get("inputs_from") or ():
            if parent in seen:
                continue
            seen.add(parent)
            record = by_name.get(parent) or {}
            if (record.get("gemm_dims") or "Embedding" in record.get("class", "")
                    or sized_before(parent, seen)):
                return True
        return False

    fixed = {}
    for layer in layers:
        dims = layer.get("gemm_dims") or []
        if not layer.get("is_leaf") or len(dims) < 2:
            continue
        if layer["name"] in heads:
            fixed[(layer["name"], len(dims) - 1)] = "output size set by the task"
        if not layer.get("inputs_made_outside_layers") and not sized_before(
                layer["name"], set()):
            fixed[(layer["name"], 0)] = "input size set by the data"
    return fixed


def _made_float32_by_mp006(view: RunView) -> set[str]:
    """The layer MP006's fix gives dtype="float32" (none when MP006 is silent)."""
    outputs = (view.inventory or {}).get("model", {}).get("output_dtypes", [])
    if not set(outputs) & set(HALF_DTYPES):
        return set()
    last = view.last_half_layer()
    return {last} if last else set()


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
