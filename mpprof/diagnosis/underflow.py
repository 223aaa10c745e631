"""Gradient underflow (MP005): float16 gradients below the normal range, or
flushed to zero, after loss scaling."""

from __future__ import annotations

import math

import numpy as np

from mpprof.diagnosis.core import NotApplicable, NotMeasured, finding, rule
from mpprof.diagnosis.numerics import (
    FLUSH_GAP,
    FLUSH_SHARE,
    MAX_LAYER_FINDINGS,
    MIN_UNDERFLOW_SAMPLES,
    UNDERFLOW_SHARE,
)
from mpprof.diagnosis.view import RunView

# Layers after which a bias's gradient is zero by construction: batch
# normalisation subtracts the per-channel batch mean, which removes any
# per-channel constant added before it.
_MEAN_REMOVING = ("BatchNormalization", "SyncBatchNormalization")


@rule("MP005", "warning", "float16 gradients underflow after scaling", view="numerics",
      data="numerics")
def gradient_underflow(view: RunView) -> list:
    """A float16 gradient (flowing into a float16 layer's output, or of a
    variable of a layer that computes in float16) has, as the median over at
    least `MIN_UNDERFLOW_SAMPLES` ordinary samples, `UNDERFLOW_SHARE` of ALL
    its values non-zero below float16's smallest normal; or a float16 layer
    gradient flushed to zero (`FLUSH_SHARE` of it exactly zero while the
    layer's activations are not). Gradients zero by construction (zero in
    every sample, a bias before BatchNormalization, an attention key bias)
    are left out. The shares of a tensor larger than
    `tensor_statistics.SAMPLE_VALUES` are estimates from a sample of its
    values (standard error at most 0.8 percentage points: far finer than
    the thresholds)."""
    if view.require_mixed() != "float16":
        raise NotApplicable("bfloat16 has float32's exponent range: gradients do not underflow")
    numerics = view.require_numerics()
    # Only ordinary steps: a forensic capture follows an overflow and its
    # statistics are NaN-laden.
    usable = ~np.asarray(numerics.forensic, dtype=bool)
    if usable.sum() < MIN_UNDERFLOW_SAMPLES:
        raise NotMeasured(
            f"{int(usable.sum())} ordinary sampled step(s) (not forensic captures); "
            f"gradient underflow is judged on at least {MIN_UNDERFLOW_SAMPLES}: lower "
            "numerics_every or train longer"
        )
    candidates = _layer_candidates(view, numerics, usable) + _variable_candidates(
        view, numerics, usable
    )
    if not candidates:
        return []
    # Most affected first; among flushed layers, the one nearest the loss:
    # the layers before it only inherit its zeros.
    candidates.sort(key=lambda c: (-c["share"], -c.get("position", 0)))
    worst = candidates[0]
    scale = _median_scale(numerics, usable)
    evidence = {
        "median_underflow_frac": round(worst["share"], 4),
        "share_of": "all values of the tensor (zeros included)",
        "how": worst["how"],
        "threshold": FLUSH_SHARE if worst["how"] == "flushed to zero" else UNDERFLOW_SHARE,
        "kind": worst["kind"],
        "usable_samples": int(usable.sum()),
        "median_loss_scale": scale,
        "underflowing": {
            f"{c['kind']}:{c['name']}": round(c["share"], 4)
            for c in candidates[:MAX_LAYER_FINDINGS]
        },
    }
    if worst["how"] == "flushed to zero":
        evidence["activation_zero_frac"] = round(worst["activation_zero"], 4)
    raise_by = 4  # 16x: moves values from the subnormal range into the normal one
    exponent = (int(math.log2(scale)) + raise_by) if scale and scale > 0 else 15 + raise_by
    if worst["how"] == "flushed to zero":
        what = (
            f"{worst['share']:.0%} of the float16 gradient flowing into {worst['name']!r} "
            "is exactly zero while its activations are not: it flushed to zero"
        )
    else:
        what = (
            f"{worst['share']:.0%} of the float16 gradient values of {worst['kind']} "
            f"{worst['name']!r} are below float16's smallest normal (6.1e-5) after "
            "scaling: they lose precision or flush to zero"
        )
    fix = (
        f"{what}. Raise the loss scale (and let it grow sooner):\n"
        "    optimizer = " + view.syntax.loss_scale_optimizer(
            "optimizer", initial_scale=f"2.0**{exponent}", dynamic_growth_steps=500
        ) + "\nIf overflows keep the scale down (MP002), keep this layer in float32 "
        f"instead:\n    {view.syntax.layer(view.layer_class(worst['layer']))}"
    )
    if view.loss_scale is None:
        fix = (
            "There is no loss scaling at all (see MP008): wrap the optimizer in a "
            "LossScaleOptimizer. " + fix
        )
    state = "zero (flushed)" if worst["how"] == "flushed to zero" else "subnormal"
    title = (
        f"Gradient underflow: {worst['share']:.0%} of {worst['kind']} {worst['name']}'s "
        f"float16 gradients are {state} after scaling"
    )
    step = int(numerics.steps[worst["first_sample"]])
    return [finding("MP005", title, layer=worst["layer"], step=step, evidence=evidence,
                    fix=fix)]


def _finite_rows(usable, nonfinite) -> np.ndarray:
    rows = usable.copy()
    if nonfinite is not None and np.size(nonfinite):
        rows &= ~(np.asarray(nonfinite) > 0).any(axis=1)
    return rows


def _median(values: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.nanmedian(np.where(np.isfinite(values), values, np.nan), axis=0)


def _layer_candidates(view, numerics, usable) -> list[dict]:
    backward = numerics.backward
    if backward.get("underflow_frac") is None or not len(numerics.layers):
        return []
    rows = _finite_rows(usable, backward.get("nonfinite_frac"))
    if rows.sum() < MIN_UNDERFLOW_SAMPLES:
        return []
    below = np.asarray(backward["underflow_frac"], dtype=np.float64)[rows]
    zero = np.asarray(backward["zero_frac"], dtype=np.float64)[rows]
    activation_zero = np.asarray(numerics.forward["zero_frac"], dtype=np.float64)[rows]
    count = np.asarray(backward["count"], dtype=np.float64)[rows]
    below_m, zero_m, act_m = _median(below), _median(zero), _median(activation_zero)
    seen = (count > 0).all(axis=0)
    loss_zero = _loss_is_zero(view, numerics, rows)
    found = []
    samples = np.flatnonzero(rows)
    for j, dtype in enumerate(view.numerics_dtypes()):
        if dtype != "float16" or not seen[j]:
            continue
        name = numerics.layers[j]
        nonzero_share = max(1.0 - zero_m[j], 1e-12)
        flushed = (
            not loss_zero
            and zero_m[j] >= FLUSH_SHARE
            and zero_m[j] - act_m[j] >= FLUSH_GAP
            and (zero_m[j] >= 1.0 or below_m[j] / nonzero_share >= 0.5)
        )
        if flushed:
            first = samples[int(np.argmax(zero[:, j] >= FLUSH_SHARE))]
            found.append({"share": float(zero_m[j]), "kind": "layer", "name": name,
                          "layer": name, "how": "flushed to zero",
                          "activation_zero": float(act_m[j]), "first_sample": int(first),
                          "position": j})
        elif below_m[j] >= UNDERFLOW_SHARE:
            first = samples[int(np.argmax(below[:, j] >= UNDERFLOW_SHARE))]
            found.append({"share": float(below_m[j]), "kind": "layer", "name": name,
                          "layer": name, "how": "below the normal range",
                          "first_sample": int(first)})
    return found


def _variable_candidates(view, numerics, usable) -> list[dict]:
    grads = getattr(numerics, "variable_grads", None) or {}
    if grads.get("underflow_frac") is None or not numerics.variables:
        return []
    rows = _finite_rows(usable, grads.get("nonfinite_frac"))
    if rows.sum() < MIN_UNDERFLOW_SAMPLES:
        return []
    below = np.asarray(grads["underflow_frac"], dtype=np.float64)[rows]
    zero = np.asarray(grads["zero_frac"], dtype=np.float64)[rows]
    below_m = _median(below)
    samples = np.flatnonzero(rows)
    found = []
    for j in np.flatnonzero(np.nan_to_num(below_m) >= UNDERFLOW_SHARE):
        name = numerics.variables[j]
        layer = view.layer_of_variable(name)
        record = view.layers_by_name.get(layer) if layer else None
        # A float32 layer's variable gradients never were float16.
        if record is None or record.get("compute_dtype") != "float16":
            continue
        if (zero[:, j] >= 1.0).all() or _zero_by_construction(view, name, record):
            continue
        first = samples[int(np.argmax(below[:, j] >= UNDERFLOW_SHARE))]
        found.append({"share": float(below_m[j]), "kind": "variable", "name": name,
                      "layer": layer, "how": "below the normal range",
                      "first_sample": int(first)})
    return found


def _zero_by_construction(view: RunView, variable: str, layer: dict) -> bool:
    """Whether `variable`'s gradient is mathematically zero: a bias whose
    layer feeds only batch normalisation, or an attention key's bias (the
    softmax over keys ignores a constant added to every score)."""
    if variable.rsplit("/", 1)[-1].split(":")[0] != "bias":
        return False
    consumers = [
        other for other in view.layers_by_name.values()
        if layer["name"] in (other.get("inputs_from") or ())
    ]
    if consumers and all(c.get("class") in _MEAN_REMOVING for c in consumers):
        return True
    parent = view.layers_by_name.get(layer.get("parent") or "")
    return bool(
        parent and parent.get("class") == "MultiHeadAttention"
        and layer["name"].rsplit("/", 1)[-1] == "key"
    )


def _loss_is_zero(view: RunView, numerics, rows) -> bool:
    """A zero loss has zero gradients: nothing flushed."""
    if not view.loss_watched:
        return False
    loss = np.asarray(getattr(numerics, "loss", []), dtype=np.float64)
    return bool(len(loss) and (loss[rows] == 0).all())


def _median_scale(numerics, usable) -> float | None:
    scales = getattr(numerics, "loss_scale", None)
    if scales is None or not len(scales):
        return None
    scales = np.asarray(scales, dtype=np.float64)[usable]
    scales = scales[np.isfinite(scales)]
    return float(np.median(scales)) if len(scales) else None
