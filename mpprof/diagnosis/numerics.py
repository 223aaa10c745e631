"""Numerics rules: forward overflow (MP003), headroom (MP004), gradient
underflow (MP005), non-finite loss or weights (MP012) and where a gradient
overflow starts (MP019). Each tensor is judged by the dtype it was computed in."""

from __future__ import annotations

import dataclasses

import numpy as np

from mpprof.diagnosis.core import REGISTRY, NotApplicable, NotMeasured, finding, rule
from mpprof.diagnosis.nonfinite import first_unskipped_nonfinite_loss
from mpprof.diagnosis.view import RunView, backward_overflow_mask, forward_overflow_mask
from mpprof.dtypes import DTYPE_MAX, HALF_DTYPES, HEADROOM_FACTOR
from mpprof.records.schema import LOSS_SCALE_EVENT_COLUMN

# MP004: activations whose largest magnitude is within HEADROOM_FACTOR
# (mpprof.dtypes, declared with the ranges) of their dtype's largest value.

# How many layers a rule names one by one before summarising the rest.
MAX_LAYER_FINDINGS = 10


# MP005: share of ALL of a float16 gradient's values (zeros included) that
# are non-zero and below float16's smallest normal (2**-14 = 6.1e-5): they keep
# fewer mantissa bits or are about to flush to zero. A well-scaled run keeps
# well under 1% there (Micikevicius et al., "Mixed Precision Training", 2018);
# 10% means the loss scale is too low.
UNDERFLOW_SHARE = 0.10
# MP005: a float16 layer gradient at least this share exactly zero, while the
# layer's activations are not (their zero share is at least FLUSH_GAP lower)
# and its non-zero values are mostly below the normal range, has FLUSHED to
# zero: the loss scale did not lift it into float16's range.
FLUSH_SHARE = 0.9
FLUSH_GAP = 0.3
# MP005: the fewest ordinary samples (not forensic, finite gradients) before
# a median is trusted: one or two samples are often the first steps, where
# weights and the loss scale are still far from where training settles.
MIN_UNDERFLOW_SAMPLES = 3


def _offender_dtype(view: RunView, name: str) -> str:
    return view.output_dtype(name) or view.half_dtype or "float32"


def _or_bfloat16(view: RunView) -> str:
    """The fix's last resort, for a float16 run only."""
    if view.half_dtype == "bfloat16":
        return "."
    return f", or train in bfloat16:\n    {view.syntax.set_policy('mixed_bfloat16')}"


def _own_code_of_parent(view: RunView, layer: str) -> str | None:
    """The layer whose own code (ops outside any sublayer) made `layer`'s
    input, when no layer did: no layer fed `layer`, and its input was
    computed (not the data, a constant or a weight) by its parent's `call`."""
    record = view.layers_by_name.get(layer) or {}
    if not record.get("inputs_made_outside_layers") or record.get("inputs_from"):
        return None
    return record.get("parent")


@rule("MP003", "critical", "a layer's forward output overflowed", view="numerics",
      data="numerics")
def forward_overflow(view: RunView) -> list:
    """A layer's output was non-finite, or beyond the largest value of the
    dtype it was computed in, on a sampled step: names the first such layer
    in call order and the first step (the later layers only inherit it)."""
    view.require_mixed()
    offender = _first_forward_overflow(view, view.require_numerics())
    if offender is None:
        return []
    evidence = _overflow_evidence(view, offender)
    title, fix, layer = _overflow_wording(view, offender, evidence)
    return [finding("MP003", title, layer=layer, step=evidence["step"], evidence=evidence,
                    fix=fix + _or_bfloat16(view))]


@dataclasses.dataclass(frozen=True)
class _Offender:
    """Where a forward overflow was first measured.

    Attributes:
        bad: per sample and layer, whether its output overflowed.
        rows: the samples (indices) with any overflow that can be trusted.
        sample: the first of them; `index`: its first layer in call order.
        poisoned: the step of an unskipped non-finite loss, after which no
            sample is judged (None: there was none).
    """

    bad: np.ndarray
    rows: np.ndarray
    sample: int
    index: int
    poisoned: int | None


def _first_forward_overflow(view: RunView, numerics) -> _Offender | None:
    """The measurement: the first sample and layer whose output overflowed."""
    bad = forward_overflow_mask(view.run, view)
    overflowed = bad.any(axis=1)
    # After an unskipped non-finite loss the weights may be NaN: a sample
    # then shows what they made, not where an overflow began.
    poisoned = first_unskipped_nonfinite_loss(view)
    if poisoned is not None:
        trusted = np.asarray(numerics.steps) <= poisoned
        if overflowed.any() and not (overflowed & trusted).any():
            raise NotMeasured(
                f"every sample with a non-finite or out-of-range output came after step "
                f"{poisoned}, whose non-finite loss was not skipped (MP012): the weights "
                "may already have been non-finite, so no layer can be named"
            )
        overflowed &= trusted
    rows = np.flatnonzero(overflowed)
    if not len(rows):
        return None
    sample = int(rows[0])
    return _Offender(bad=bad, rows=rows, sample=sample,
                     index=int(np.argmax(bad[sample])),  # first in call order
                     poisoned=poisoned)


def _overflow_evidence(view: RunView, offender: _Offender) -> dict:
    """The evidence: what was measured of the offending layer and sample."""
    numerics = view.numerics
    sample, index = offender.sample, offender.index
    layer = numerics.layers[index]
    dtype = _offender_dtype(view, layer)
    abs_max = numerics.forward["abs_max"]
    nonfinite = float(numerics.forward["nonfinite_frac"][sample, index])
    covered = max(int(numerics.steps_covered[sample]), 1) if len(numerics.steps_covered) else 1
    producers = [
        numerics.layers.index(p)
        for p in (view.layers_by_name.get(layer) or {}).get("inputs_from") or ()
        if p in numerics.layers
    ]
    evidence = {
        "step": int(numerics.steps[sample]),
        "steps_in_sample": covered,
        # The finite maximum of an all-non-finite tensor means nothing.
        "abs_max": None if nonfinite >= 1.0 else float(abs_max[sample, index]),
        "nonfinite_frac": nonfinite,
        "dtype": dtype,
        "dtype_max": DTYPE_MAX.get(dtype),
        "policy_max": float(numerics.policy_max),
        # What the layers feeding it gave it (None: no measured layer did).
        "input_abs_max": (float(max(abs_max[sample, i] for i in producers))
                          if producers else None),
        "layers_overflowing_at_that_step": int(offender.bad[sample].sum()),
        "samples_with_overflow": len(offender.rows),
        "samples": len(numerics.steps),
        "forensic_sample": bool(numerics.forensic[sample]),
    }
    if offender.poisoned is not None:
        evidence["later_samples_ignored_after_step"] = offender.poisoned
    later = [numerics.layers[j]
             for j in np.flatnonzero(offender.bad[sample])[1:MAX_LAYER_FINDINGS]]
    if later:
        evidence["later_layers_also_overflowing"] = later
    # The step is the first where the evidence was seen; the loss scale may
    # have skipped earlier steps (a forensic sample follows an overflow).
    if view.loss_scale is not None:
        last = evidence["step"] + covered - 1
        before = view.loss_scale.overflow_steps
        before = before[before <= last]
        if len(before):
            evidence["first_overflow_step"] = int(before.min())
    parent = _own_code_of_parent(view, layer)
    if parent is not None:
        evidence["input_made_by"] = parent
    return evidence


def _overflow_wording(view: RunView, offender: _Offender, evidence: dict) -> tuple[str, str, str]:
    """The words: (title, fix, the layer the finding names)."""
    layer = view.numerics.layers[offender.index]
    dtype, step = evidence["dtype"], evidence["step"]
    # Under steps_per_execution a sample covers its call's steps.
    last = step + evidence["steps_in_sample"] - 1
    kind = "forensic sample" if evidence["forensic_sample"] else "sampled step"
    if last > step:
        kind = "forensic sample" if evidence["forensic_sample"] else "sampled call"
        when = f"on steps {step} to {last} (one {kind})"
    else:
        when = f"on sampled step {step}"
    if "first_overflow_step" in evidence:
        where = f"step {step}" if last == step else f"steps {step} to {last}"
        first = evidence["first_overflow_step"]
        when = f"on {where} ({kind}; the first overflow was at step {first})"
    exceeded = (f"exceeded {dtype} (max {DTYPE_MAX.get(dtype, view.numerics.policy_max):g}) "
                f"{when}")
    parent = evidence.get("input_made_by")
    if parent is not None:
        title = f"Forward overflow in {parent}'s own ops (the input of {layer}) {exceeded}"
        fix = (
            f"{layer!r}'s input was computed by {parent!r}'s own code (ops in its call, "
            f"outside any sublayer), and already left {dtype}'s range there: {layer!r} "
            f"only passed it on. Keep {parent!r} in float32:\n"
            f"    {view.syntax.layer(view.layer_class(parent))}\n"
            "or make its constants fit the dtype (a mask value of -1e9 is -inf in "
            "float16, and 0 * -inf is NaN: use the dtype's own limit, -65504 in float16)"
        )
        return title, fix, parent
    title = f"Forward overflow: {layer} output {exceeded}"
    fix = (
        f"Layer {layer!r} is the first in call order whose output left "
        f"{dtype}'s range; the layers after it only inherit the inf/NaN. "
        "Keep it in float32:\n"
        f"    {view.syntax.layer(view.layer_class(layer))}\n"
        "or bound its input (normalise the inputs, add LayerNormalization before "
        "it, lower the learning rate if its weights grew)"
    )
    return title, fix, layer


@rule("MP004", "warning", "activations close to their dtype's maximum", view="numerics",
      data="numerics")
def headroom(view: RunView) -> list:
    """A half-precision layer's largest activation came within
    `HEADROOM_FACTOR` of its dtype's maximum without overflowing. Layers
    downstream of the layer MP003 names only inherit its overflow: they are
    its evidence, not findings of their own. A layer without weights (pooling,
    an activation, dropout) is told to fix the layer feeding it."""
    view.require_mixed()
    numerics = view.require_numerics()
    abs_max = np.asarray(numerics.forward["abs_max"], dtype=np.float64)
    overflowed = forward_overflow_mask(view.run, view)
    finite = np.where(overflowed | ~np.isfinite(abs_max), -np.inf, abs_max)
    peak = finite.max(axis=0)
    dtypes = view.numerics_dtypes()
    limit = np.array([DTYPE_MAX[d] for d in dtypes])
    half = np.array([d in HALF_DTYPES for d in dtypes])
    inherited = np.zeros(len(numerics.layers), dtype=bool)
    offender = _first_forward_overflow(view, numerics)
    if offender is not None:
        below = _downstream(view, numerics.layers, numerics.layers[offender.index])
        inherited = np.array([name in below for name in numerics.layers], dtype=bool)
    close = np.flatnonzero(half & (peak > limit / HEADROOM_FACTOR) & ~overflowed.any(axis=0)
                           & ~inherited)
    if not len(close):
        return []
    close = close[np.argsort(-peak[close] / limit[close])]
    worst = int(close[0])
    layer = numerics.layers[worst]
    sample = int(np.argmax(finite[:, worst]))
    factor = round(float(limit[worst] / peak[worst]), 2)
    evidence = {
        "abs_max": float(peak[worst]),
        "dtype": dtypes[worst],
        "policy_max": float(limit[worst]),
        "headroom_factor": factor,
        "threshold_factor": HEADROOM_FACTOR,
        "layers_close_to_max": {
            numerics.layers[j]: float(peak[j]) for j in close[:MAX_LAYER_FINDINGS]
        },
    }
    source = _weighted_source(view, layer)
    if source == layer:
        fix = (
            f"{layer!r} reached {peak[worst]:g}, only {factor:g}x below the largest "
            f"{dtypes[worst]} ({limit[worst]:g}): a little growth of its weights will "
            "overflow it. Keep it in float32:\n"
            f"    {view.syntax.layer(view.layer_class(layer))}\n"
            "or bound its input (normalisation before it, weight decay), or train in "
            f"bfloat16: {view.syntax.set_policy('mixed_bfloat16')}"
        )
    else:
        evidence["weightless"] = True
        evidence["values_from"] = source
        upstream = (
            f"they come from {source!r}, whose output is where to act. Keep it in "
            f"float32:\n    {view.syntax.layer(view.layer_class(source))}\n"
            if source else
            "they come from its input (the data or ops outside any layer): bound it "
            "(normalise the inputs), "
        )
        fix = (
            f"{layer!r} reached {peak[worst]:g}, only {factor:g}x below the largest "
            f"{dtypes[worst]} ({limit[worst]:g}). It has no weights: its large values "
            f"are its input's, and {upstream}or bound that input (normalisation, "
            f"weight decay), or train in bfloat16: "
            f"{view.syntax.set_policy('mixed_bfloat16')}"
        )
    title = (
        f"Little headroom: {layer} activations reach {peak[worst]:.4g}, within "
        f"{factor:g}x of the {dtypes[worst]} maximum"
    )
    step = int(numerics.steps[sample])
    return [finding("MP004", title, layer=layer, step=step, evidence=evidence, fix=fix)]


def _downstream(view: RunView, layers: list[str], origin: str) -> set[str]:
    """The layers fed, directly or not, by `origin` (by the inventory's
    "inputs_from"); without that graph, every layer after it in call order."""
    consumers: dict[str, list[str]] = {}
    for record in view.layers_by_name.values():
        for parent in record.get("inputs_from") or ():
            consumers.setdefault(parent, []).append(record["name"])
    if not consumers:
        return set(layers[layers.index(origin) + 1:]) if origin in layers else set()
    found, todo = set(), [origin]
    while todo:
        for child in consumers.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _weighted_source(view: RunView, layer: str) -> str | None:
    """`layer` itself when it has weights (or the inventory does not say);
    else the nearest layer with weights that feeds it through weightless
    layers (None: its values come from the data or outside any layer)."""
    seen, name = set(), layer
    while name is not None and name not in seen:
        seen.add(name)
        record = view.layers_by_name.get(name)
        if record is None or record.get("params") is None or record["params"] > 0:
            return name
        parents = record.get("inputs_from") or []
        name = parents[0] if parents else None
    return None


def _calibrated_from(view: RunView) -> int:
    """The first step after the loss scale's initial descent, when that
    descent settled on a scale of at least 1 and a finite step followed:
    samples before it show the initial scale's overflows (2**15 by default,
    halved until the gradients fit), not a layer's. Otherwise the first step
    (a descent that never settles is the layers' doing)."""
    loss_scale = view.loss_scale
    if loss_scale is None:
        return 0
    descent = loss_scale.initial_descent
    if not descent or loss_scale.first_step + descent >= loss_scale.steps_run:
        return loss_scale.first_step
    settled = float(loss_scale.overflows[descent - 1, LOSS_SCALE_EVENT_COLUMN.scale_after])
    if settled < 1.0:
        return loss_scale.first_step
    return loss_scale.first_step + descent


def gradient_overflow_origin(view: RunView) -> dict | None:
    """Where a gradient overflow starts: the first layer from the loss
    backwards whose incoming gradient was non-finite (else the first variable
    whose gradient was), on the first sample that shows one and whose
    forward pass stayed finite.

    Returns None when no sample shows a non-finite gradient, else
    {"kind": "layer"|"variable", "name", "layer", "step", "samples",
    "dtype", "half_head"}; "half_head" says the layer is the model's last and
    outputs half precision (MP006 is then the cause).
    """
    numerics = view.numerics
    if numerics is None or not len(numerics.steps):
        return None
    layers = backward_overflow_mask(view.run, view)
    variables = np.zeros((len(numerics.steps), 0), dtype=bool)
    grads = (getattr(numerics, "variable_grads", None) or {}).get("nonfinite_frac")
    if grads is not None and np.size(grads):
        variables = np.asarray(grads, dtype=np.float64) > 0
    hit_rows = (
        (layers.any(axis=1) if layers.size else np.zeros(len(numerics.steps), bool))
        | (variables.any(axis=1) if variables.size else False)
    )
    # A gradient that is non-finite because the forward pass already was is
    # MP003's to name, not a gradient overflow.
    forward = forward_overflow_mask(view.run, view)
    if forward.size:
        hit_rows &= ~forward.any(axis=1)
    hit_rows &= np.asarray(numerics.steps) >= _calibrated_from(view)
    rows = np.flatnonzero(hit_rows)
    if not len(rows):
        return None
    sample = int(rows[0])
    if layers.size and layers[sample].any():
        kind, index = "layer", int(np.flatnonzero(layers[sample])[-1])
        name = layer = numerics.layers[index]
    else:
        kind, index = "variable", int(np.flatnonzero(variables[sample])[0])
        name = numerics.variables[index]
        layer = view.layer_of_variable(name)
    dtype = view.output_dtype(layer) if layer else None
    last = view.last_half_layer()
    outputs = (view.inventory or {}).get("model", {}).get("output_dtypes", [])
    return {
        "kind": kind,
        "name": name,
        "layer": layer,
        "step": int(numerics.steps[sample]),
        "samples": len(rows),
        "dtype": dtype,
        "half_head": bool(
            layer is not None and layer == last and dtype in HALF_DTYPES
            and set(outputs) & set(HALF_DTYPES)
        ),
    }


@rule("MP019", "warning", "gradient overflow starts at a layer", view="numerics",
      data="numerics, loss scale")
def gradient_overflow_start(view: RunView) -> list:
    """The loss scale could not keep the gradients finite (MP001 or MP002
    fired, or there is no loss scaling): names the first layer from the loss
    backwards whose incoming gradient was non-finite on a sampled step (or the
    first variable whose gradient was), and the step."""
    view.require_mixed()
    view.require_numerics()
    origin = gradient_overflow_origin(view)
    if origin is None:
        return []
    because = [
        code for code in ("MP001", "MP002")
        if view.loss_scale is not None and quiet(code, view)
    ]
    if view.loss_scale is not None and not because:
        return []  # overflows the loss scale handled: calibration and probes
    evidence = {
        "kind": origin["kind"],
        "name": origin["name"],
        "dtype": origin["dtype"],
        "samples_with_gradient_overflow": origin["samples"],
        "because_of": because or ["no loss scaling"],
        "model_output_is_half": origin["half_head"],
    }
    layer = origin["layer"]
    cls = view.layer_class(layer)
    if origin["half_head"]:
        fix = (
            f"{layer!r} is the model's {origin['dtype']} output: the loss's gradient "
            f"overflows {origin['dtype']} as it enters it (a half-precision softmax "
            "next to 0 gives -1/p). Give the output layer float32 (MP006):\n"
            f"    {view.syntax.layer(cls)}\n"
            "or keep the logits and use a loss with from_logits=True."
        )
    else:
        fix = (
            f"The gradient flowing into {origin['name']!r} is the first (from the loss "
            f"backwards) to leave {origin['dtype'] or 'float16'}'s range. Keep that "
            f"layer in float32:\n    {view.syntax.layer(cls)}\n"
            "or bound what feeds the loss (normalise the targets, clip the "
            "gradients of a custom loss)"
            f"{_or_bfloat16(view)}"
        )
    title = (
        f"Gradient overflow starts at {origin['kind']} {origin['name']} "
        f"(step {origin['step']})"
    )
    return [finding("MP019", title, layer=layer, step=origin["step"], evidence=evidence,
                    fix=fix)]


def quiet(code: str, view: RunView) -> list:
    """The findings of rule `code`, or none where it could not judge."""
    try:
        return REGISTRY[code].judge(view)
    except (NotMeasured, NotApplicable):
        return []
