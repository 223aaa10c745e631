"""Float8 rules: saturation (MP015), underflow (MP016) and stale or degenerate
delayed scales (MP017) of Keras' float8 layers (`model.quantize("float8")`).

They judge the FLOAT8_STATE record: each float8 tensor's scale and amax
history at each flush, and the steps between flushes replayed with Keras'
scale rule (see `mpprof.collectors.float8`). A step's verdict is about its
largest value (its amax, the one number Keras keeps per step): whether it
clipped at the format's max, or whether even it quantized to zero.
"""

from __future__ import annotations

import numpy as np

from mpprof.diagnosis.core import NotApplicable, NotMeasured, finding, rule
from mpprof.diagnosis.numerics import MAX_LAYER_FINDINGS
from mpprof.diagnosis.view import RunView

# MP015: delayed scaling always lags a growing tensor by two steps, so a peak
# a little beyond the format's max (a kernel growing by one update) is normal
# and clips one value by a few percent. A peak 4x beyond it (2 binades) clipped
# to a quarter of its size means the scale does not follow the tensor.
SATURATION_FACTOR = 4.0
# MP015/MP016: the share of replayed (post warm-up) steps that must show it,
# so that one outlier batch in a long run is not a finding.
FLOAT8_STEP_SHARE = 0.25
# ... and at least this many steps.
MIN_FLOAT8_STEPS = 2
# MP017: Keras' first two steps quantize with the initial scale (the history
# is still empty); after this many steps a history of zeros is not warm-up.
WARMUP_STEPS = 2

_FORMAT_NAMES = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}


def _require_float8(view: RunView):
    float8 = getattr(view.run, "float8", None)
    if float8 is not None and len(float8.steps):
        return float8
    entry = (view.context.get("collectors") or {}).get("float8") or {}
    if entry.get("state") == "absent":
        raise NotApplicable(entry.get("reason") or "no float8 layers")
    if float8 is None and not entry:
        raise NotApplicable("no float8 layers were recorded (recorded before mpprof 'float8')")
    raise NotMeasured(
        "no float8 state was recorded: " + (entry.get("reason") or "the collector wrote nothing")
    )


def _judged_steps(float8) -> np.ndarray:
    """[layers, tensors] steps replayed after warm-up (NaN flushes left out)."""
    steps = np.nan_to_num(float8.state["steps"])
    warmup = np.nan_to_num(float8.state["warmup_steps"])
    return (steps - warmup).sum(axis=0)


def _first_step(float8, mask: np.ndarray) -> int | None:
    """The first flush step where `mask` ([flushes]) holds."""
    hits = np.flatnonzero(mask)
    return int(float8.steps[hits[0]]) if len(hits) else None


def _tensor_text(float8, tensor: str) -> str:
    fmt = float8.formats.get(tensor, "")
    return f"{tensor} ({_FORMAT_NAMES.get(fmt, fmt)})"


def _quantize_others(layer: str) -> str:
    name = layer.rsplit("/", 1)[-1]
    return (
        "quantize every layer but this one:\n"
        f'    model.quantize("float8", filters=lambda layer: layer.name != {name!r})\n'
    )


def _history_policy(length: int) -> str:
    return (
        "    keras.layers.Dense(..., dtype=keras.dtype_policies.QuantizedFloat8DTypePolicy(\n"
        f'        "float8", "float32", amax_history_length={length}))\n'
    )


@rule("MP015", "warning", "float8 tensor saturates: its delayed scale lags",
      view="inventory", data="float8")
def float8_saturation(view: RunView) -> list:
    """A float8 layer's input, kernel or output gradient had its largest
    value beyond the format's max (e4m3: 448, e5m2: 57344) times the scale in
    use, so Keras clipped it, in at least `FLOAT8_STEP_SHARE` of the steps
    after warm-up (and `MIN_FLOAT8_STEPS`), with the worst peak
    `SATURATION_FACTOR` times beyond the max: the tensor grows faster than
    its delayed scale follows."""
    float8 = _require_float8(view)
    judged = _judged_steps(float8)
    saturated = np.nan_to_num(float8.state["saturated_steps"]).sum(axis=0)
    peaks = float8.state["peak_over_max"]
    findings = []
    for li, layer in enumerate(float8.layers):
        tensors = []
        for ti, tensor in enumerate(float8.tensors):
            worst = np.nanmax(peaks[:, li, ti]) if np.any(~np.isnan(peaks[:, li, ti])) else 0.0
            if (saturated[li, ti] >= MIN_FLOAT8_STEPS
                    and saturated[li, ti] >= FLOAT8_STEP_SHARE * judged[li, ti]
                    and worst >= SATURATION_FACTOR):
                tensors.append((ti, tensor, worst))
        if not tensors:
            continue
        ti, tensor, worst = max(tensors, key=lambda t: t[2])
        evidence = {
            "tensors": {
                name: {
                    "saturated_steps": int(saturated[li, i]),
                    "judged_steps": int(judged[li, i]),
                    "worst_peak_over_format_max": float(peak),
                    "format": float8.formats.get(name),
                }
                for i, name, peak in tensors
            },
            "amax_history_length": float8.amax_history_lengths[li],
        }
        step = _first_step(float8, peaks[:, li, ti] >= SATURATION_FACTOR)
        fix = (
            f"Keras scales {tensor} by the largest amax of the steps before (delayed "
            "scaling), so a tensor that keeps growing is clipped at the format's max "
            f"(here up to {worst:.3g}x beyond it). Keep this layer unquantized: "
            + _quantize_others(layer)
            + "or stop the growth (normalise the layer's inputs, e.g. a "
            "LayerNormalization before it; a lower learning rate for a growing kernel)."
        )
        title = (
            f"float8 saturation in {layer!r}: {_tensor_text(float8, tensor)} clipped in "
            f"{int(saturated[li, ti])} of {int(judged[li, ti])} steps, peak "
            f"{worst:.3g}x the format's max"
        )
        findings.append(finding("MP015", title, layer=layer, step=step, evidence=evidence,
                                fix=fix))
    return findings[:MAX_LAYER_FINDINGS]


@rule("MP016", "warning", "float8 tensor underflows: its scale is too coarse",
      view="inventory", data="float8")
def float8_underflow(view: RunView) -> list:
    """Even the largest value of a float8 layer's tensor (typically its output
    gradient, e5m2) divided by the scale in use fell below half the format's
    smallest subnormal, so every value of the tensor quantized to zero, in at
    least `FLOAT8_STEP_SHARE` of the steps after warm-up (and
    `MIN_FLOAT8_STEPS`): the scale is held up by a much larger amax in the
    history (an early spike, a wrong amax)."""
    float8 = _require_float8(view)
    judged = _judged_steps(float8)
    underflowed = np.nan_to_num(float8.state["underflowed_steps"]).sum(axis=0)
    findings = []
    for li, layer in enumerate(float8.layers):
        tensors = [
            (ti, tensor) for ti, tensor in enumerate(float8.tensors)
            if underflowed[li, ti] >= MIN_FLOAT8_STEPS
            and underflowed[li, ti] >= FLOAT8_STEP_SHARE * judged[li, ti]
        ]
        if not tensors:
            continue
        ti, tensor = max(tensors, key=lambda t: underflowed[li, t[0]])
        length = float8.amax_history_lengths[li]
        evidence = {
            "tensors": {
                name: {
                    "underflowed_steps": int(underflowed[li, i]),
                    "judged_steps": int(judged[li, i]),
                    "amax_history_max": float(float8.state["amax_max"][-1, li, i]),
                    "amax_latest": float(float8.state["amax_last"][-1, li, i]),
                    "scale": float(float8.state["scale"][-1, li, i]),
                    "format": float8.formats.get(name),
                }
                for i, name in tensors
            },
            "amax_history_length": length,
        }
        step = _first_step(float8, np.nan_to_num(float8.state["underflowed_steps"][:, li, ti]) > 0)
        fix = (
            f"The {tensor} scale is set by the largest amax of the last {length} steps "
            f"({evidence['tensors'][tensor]['amax_history_max']:.3g}), far above the "
            f"tensor's values now ({evidence['tensors'][tensor]['amax_latest']:.3g}): "
            "every value quantizes to zero and the layer gets no gradient. Keep this "
            "layer unquantized: " + _quantize_others(layer)
            + "or give it a shorter amax history, so an old spike is forgotten sooner:\n"
            + _history_policy(16)
        )
        title = (
            f"float8 underflow in {layer!r}: {_tensor_text(float8, tensor)} quantized "
            f"entirely to zero in {int(underflowed[li, ti])} of {int(judged[li, ti])} steps"
        )
        findings.append(finding("MP016", title, layer=layer, step=step, evidence=evidence,
                                fix=fix))
    return findings[:MAX_LAYER_FINDINGS]


@rule("MP017", "warning", "float8 scale stale or degenerate", view="inventory", data="float8")
def float8_degenerate_scale(view: RunView) -> list:
    """After more than `WARMUP_STEPS` steps, a float8 layer's tensor has an
    amax history of zeros or a scale still at its initial 1 at every flush
    (its delayed scaling never ran: a frozen layer, or an all-zero tensor),
    or a scale that is not a positive finite number."""
    float8 = _require_float8(view)
    steps_run = np.nan_to_num(float8.state["steps"]).sum(axis=0)
    scales = float8.state["scale"]
    findings = []
    for li, layer in enumerate(float8.layers):
        problems = {}
        for ti, tensor in enumerate(float8.tensors):
            column = scales[:, li, ti]
            valid = np.isfinite(column) & (column > 0)
            if not valid.all():
                problems[tensor] = f"scale {float(column[~valid][0])}"
            elif steps_run[li, ti] <= WARMUP_STEPS:
                continue
            elif float8.state["amax_max"][-1, li, ti] == 0:
                problems[tensor] = "amax history of zeros"
            elif np.all(column == 1.0):
                problems[tensor] = "scale never moved from its initial 1"
        if not problems:
            continue
        evidence = {
            "tensors": {
                name: {
                    "problem": text,
                    "scale": float(scales[-1, li, float8.tensors.index(name)]),
                    "amax_history_max": float(
                        float8.state["amax_max"][-1, li, float8.tensors.index(name)]),
                }
                for name, text in problems.items()
            },
            "steps_run": int(steps_run[li].max()),
        }
        fix = (
            "Keras updates a float8 layer's scales and amax histories through the "
            "gradient of its scale variables; a frozen layer (layer.trainable = False) "
            "or a tensor that is always zero never updates them, and the layer quantizes "
            "with a scale no value set. Unfreeze the layer, or keep it unquantized: "
            + _quantize_others(layer)
            + "A scale that is not positive and finite was set by hand or corrupted: "
            "rebuild the layer's float8 variables (quantize a fresh layer)."
        )
        title = (
            f"float8 scale degenerate in {layer!r}: "
            + "; ".join(f"{t}: {p}" for t, p in problems.items())
        )
        findings.append(finding("MP017", title, layer=layer, evidence=evidence, fix=fix))
    return findings[:MAX_LAYER_FINDINGS]
