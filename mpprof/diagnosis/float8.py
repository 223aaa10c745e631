"""Float8 rules: saturation (MP015), underflow (MP016) and stale or degenerate
delayed scales (MP017) of Keras' float8 layers (`model.quantize("float8")`).

Where the numerics schedule sampled steps, MP015/MP016 judge the shares of
values measured in those steps (FLOAT8_SHARES: how many of a tensor's values
Keras clipped, how many of its non-zero values quantized to zero, with the
scale the step used; see `mpprof.backends.float8_shares`). Without samples
they judge the FLOAT8_STATE record: each float8 tensor's scale and amax
history at each flush, and the steps between flushes replayed with Keras'
scale rule (see `mpprof.backends.float8_replay`); a step's verdict is then about
its largest value (its amax, the one number Keras keeps per step): whether it
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
# MP015/MP016 leave samples of those steps out.
WARMUP_STEPS = 2
# MP015 with samples: the share of a tensor's values clipped at the format's
# max that counts as saturating (with a peak `SATURATION_FACTOR` beyond it).
SATURATION_SHARE = 0.01
# MP016 with samples: the share of a tensor's non-zero values that quantize
# to zero that counts as underflowing.
FLOAT8_UNDERFLOW_SHARE = 0.10
# MP017: replicas whose amax history maxima (which set their scales) differ by
# more than this factor quantize the same tensor one binade or more apart.
# Shards of one shuffled batch differ by far less.
REPLICA_AMAX_TOLERANCE = 2.0

_FORMAT_NAMES = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}


def _require_float8(view: RunView):
    float8 = getattr(view.run, "float8", None)
    if float8 is not None and len(float8.steps):
        return float8
    entry = view.context.collector("float8")
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


def _judged_samples(float8) -> np.ndarray:
    """[samples] whether each sample is after warm-up."""
    return float8.sample_steps >= WARMUP_STEPS


def _share_verdict(float8, name: str, threshold: float, li: int, ti: int) -> dict | None:
    """How the samples after warm-up judge one layer's tensor by the share
    `name` of `float8.shares`: None when no sample measured it, else
    {"samples", "over", "worst", "first_step"} (`over`: samples at or beyond
    `threshold`)."""
    values = float8.shares[name][:, li, ti]
    judged = _judged_samples(float8) & ~np.isnan(values)
    if not judged.any():
        return None
    over = judged & (values >= threshold)
    return {
        "samples": int(judged.sum()),
        "over": int(over.sum()),
        "worst": float(values[judged].max()),
        "first_step": int(float8.sample_steps[np.argmax(over)]) if over.any() else None,
    }


def _often(over: int, judged: int, minimum: int) -> bool:
    """Whether `over` of `judged` steps or samples is often enough to judge."""
    return over >= minimum and over >= FLOAT8_STEP_SHARE * judged


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
      view="float8", data="float8")
def float8_saturation(view: RunView) -> list:
    """A float8 layer's input, kernel or output gradient saturates: divided by
    the scale in use, its values went beyond the format's max (e4m3: 448,
    e5m2: 57344), so Keras clipped them, with the worst peak
    `SATURATION_FACTOR` times beyond the max: the tensor grows faster than its
    delayed scale follows. On sampled steps (after warm-up): at least
    `SATURATION_SHARE` of its values clipped in at least `FLOAT8_STEP_SHARE`
    of them. Without samples, from each step's largest value: clipped in at
    least `FLOAT8_STEP_SHARE` of the steps after warm-up (and
    `MIN_FLOAT8_STEPS`)."""
    float8 = _require_float8(view)
    judged = _judged_steps(float8)
    saturated = np.nan_to_num(float8.state["saturated_steps"]).sum(axis=0)
    peaks = float8.state["peak_over_max"]
    findings = []
    for li, layer in enumerate(float8.layers):
        tensors = []
        for ti, tensor in enumerate(float8.tensors):
            measured = _share_verdict(float8, "saturated", SATURATION_SHARE, li, ti)
            if measured is not None:
                sampled_peaks = float8.shares["peak_over_max"][:, li, ti]
                worst = float(np.nanmax(sampled_peaks[_judged_samples(float8)]))
                if _often(measured["over"], measured["samples"], 1) and worst >= SATURATION_FACTOR:
                    tensors.append((ti, tensor, worst, {
                        "saturated_share_worst": measured["worst"],
                        "samples_over_share": measured["over"],
                        "judged_samples": measured["samples"],
                        "worst_peak_over_format_max": worst,
                        "format": float8.formats.get(tensor),
                    }, measured["first_step"]))
                continue
            worst = np.nanmax(peaks[:, li, ti]) if np.any(~np.isnan(peaks[:, li, ti])) else 0.0
            if (_often(saturated[li, ti], judged[li, ti], MIN_FLOAT8_STEPS)
                    and worst >= SATURATION_FACTOR):
                tensors.append((ti, tensor, float(worst), {
                    "saturated_steps": int(saturated[li, ti]),
                    "judged_steps": int(judged[li, ti]),
                    "worst_peak_over_format_max": float(worst),
                    "format": float8.formats.get(tensor),
                }, _first_step(float8, peaks[:, li, ti] >= SATURATION_FACTOR)))
        if not tensors:
            continue
        ti, tensor, worst, worst_evidence, step = max(tensors, key=lambda t: t[2])
        evidence = {
            "tensors": {name: found for _, name, _, found, _ in tensors},
            "amax_history_length": float8.amax_history_lengths[li],
        }
        if "saturated_share_worst" in worst_evidence:
            how = (
                f"{worst_evidence['saturated_share_worst']:.1%} of its values clipped "
                f"(worst of {worst_evidence['judged_samples']} sampled steps)"
            )
        else:
            how = (f"clipped in {worst_evidence['saturated_steps']} of "
                   f"{worst_evidence['judged_steps']} steps")
        fix = (
            f"Keras scales {tensor} by the largest amax of the steps before (delayed "
            "scaling), so a tensor that keeps growing is clipped at the format's max "
            f"(here up to {worst:.3g}x beyond it). Keep this layer unquantized: "
            + _quantize_others(layer)
            + "or stop the growth (normalise the layer's inputs, e.g. a "
            "LayerNormalization before it; a lower learning rate for a growing kernel)."
        )
        title = (
            f"float8 saturation in {layer!r}: {_tensor_text(float8, tensor)} {how}, peak "
            f"{worst:.3g}x the format's max"
        )
        findings.append(finding("MP015", title, layer=layer, step=step, evidence=evidence,
                                fix=fix))
    return findings[:MAX_LAYER_FINDINGS]


@rule("MP016", "warning", "float8 tensor underflows: its scale is too coarse",
      view="float8", data="float8")
def float8_underflow(view: RunView) -> list:
    """A float8 layer's tensor (typically its output gradient, e5m2) divided by
    the scale in use falls to at most half the format's smallest subnormal,
    so it quantizes to zero: the scale is held up by a much larger amax in
    the history (an early spike, a wrong amax). On sampled steps (after
    warm-up): at least `FLOAT8_UNDERFLOW_SHARE` of its non-zero values in at
    least `FLOAT8_STEP_SHARE` of them. Without samples, from each step's
    largest value: even it quantized to zero (so every value did) in at least
    `FLOAT8_STEP_SHARE` of the steps after warm-up (and
    `MIN_FLOAT8_STEPS`)."""
    float8 = _require_float8(view)
    judged = _judged_steps(float8)
    underflowed = np.nan_to_num(float8.state["underflowed_steps"]).sum(axis=0)
    findings = []
    for li, layer in enumerate(float8.layers):
        length = float8.amax_history_lengths[li]
        tensors = {}
        for ti, tensor in enumerate(float8.tensors):
            history = {
                "amax_history_max": float(float8.state["amax_max"][-1, li, ti]),
                "amax_latest": float(float8.state["amax_last"][-1, li, ti]),
                "scale": float(float8.state["scale"][-1, li, ti]),
                "format": float8.formats.get(tensor),
            }
            measured = _share_verdict(float8, "underflowed", FLOAT8_UNDERFLOW_SHARE, li, ti)
            if measured is not None:
                if _often(measured["over"], measured["samples"], 1):
                    tensors[tensor] = ((measured["worst"], measured["over"]), {
                        "underflowed_share_worst": measured["worst"],
                        "samples_over_share": measured["over"],
                        "judged_samples": measured["samples"], **history,
                    }, measured["first_step"])
                continue
            if _often(underflowed[li, ti], judged[li, ti], MIN_FLOAT8_STEPS):
                column = np.nan_to_num(float8.state["underflowed_steps"][:, li, ti])
                tensors[tensor] = ((1.0, underflowed[li, ti]), {
                    "underflowed_steps": int(underflowed[li, ti]),
                    "judged_steps": int(judged[li, ti]), **history,
                }, _first_step(float8, column > 0))
        if not tensors:
            continue
        tensor = max(tensors, key=lambda name: tensors[name][0])
        _, worst, step = tensors[tensor]
        evidence = {
            "tensors": {name: found for name, (_, found, _) in tensors.items()},
            "amax_history_length": length,
        }
        if "underflowed_share_worst" in worst:
            how = (f"{worst['underflowed_share_worst']:.1%} of its non-zero values quantized "
                   f"to zero (worst of {worst['judged_samples']} sampled steps)")
        else:
            how = (f"quantized entirely to zero in {worst['underflowed_steps']} of "
                   f"{worst['judged_steps']} steps")
        fix = (
            f"The {tensor} scale is set by the largest amax of the last {length} steps "
            f"({worst['amax_history_max']:.3g}), far above the tensor's values now "
            f"({worst['amax_latest']:.3g}): its values quantize to zero and the layer "
            "loses them. Keep this layer unquantized: " + _quantize_others(layer)
            + "or give it a shorter amax history, so an old spike is forgotten sooner:\n"
            + _history_policy(16)
        )
        title = f"float8 underflow in {layer!r}: {_tensor_text(float8, tensor)} {how}"
        findings.append(finding("MP016", title, layer=layer, step=step, evidence=evidence,
                                fix=fix))
    return findings[:MAX_LAYER_FINDINGS]


@rule("MP017", "warning", "float8 scale stale or degenerate", view="float8", data="float8")
def float8_degenerate_scale(view: RunView) -> list:
    """After more than `WARMUP_STEPS` steps, a float8 layer's tensor has an
    amax history of zeros or a scale still at its initial 1 at every flush
    (its delayed scaling never ran: a frozen layer, or an all-zero tensor),
    or a scale that is not a positive finite number; or, under a
    distribution strategy whose replicas keep their own amax history (Keras
    3 reduces none), the replicas' amax history maxima differ by more than
    `REPLICA_AMAX_TOLERANCE` times at the last flush."""
    float8 = _require_float8(view)
    steps_run = np.nan_to_num(float8.state["steps"]).sum(axis=0)
    scales = float8.state["scale"]
    spread = float8.replica_spread
    findings = []
    for li, layer in enumerate(float8.layers):
        problems, replicas_apart = {}, {}
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
            elif spread:
                least = spread["amax_max_min"][-1, li, ti]
                most = spread["amax_max_max"][-1, li, ti]
                ratio = most / least if least > 0 else (np.inf if most > 0 else 1.0)
                if ratio > REPLICA_AMAX_TOLERANCE:
                    replicas_apart[tensor] = (float(least), float(most), float(ratio))
                    problems[tensor] = (
                        f"the {float8.replicas} replicas' amax differ {ratio:.3g}x "
                        f"({least:.3g} to {most:.3g}, kept {float8.amax_across_replicas})"
                    )
        if not problems:
            continue
        evidence = {
            "tensors": {
                name: {
                    "problem": text,
                    "scale": float(scales[-1, li, float8.tensors.index(name)]),
                    "amax_history_max": float(
                        float8.state["amax_max"][-1, li, float8.tensors.index(name)]),
                    **({"replica_amax_max_least": replicas_apart[name][0],
                        "replica_amax_max_largest": replicas_apart[name][1],
                        "replica_amax_ratio": replicas_apart[name][2]}
                       if name in replicas_apart else {}),
                }
                for name, text in problems.items()
            },
            "steps_run": int(steps_run[li].max()),
        }
        if replicas_apart:
            evidence.update(replicas=float8.replicas,
                            amax_across_replicas=float8.amax_across_replicas)
        stale = (
            "Keras updates a float8 layer's scales and amax histories through the "
            "gradient of its scale variables; a frozen layer (layer.trainable = False) "
            "or a tensor that is always zero never updates them, and the layer quantizes "
            "with a scale no value set. Unfreeze the layer, or keep it unquantized: "
            + _quantize_others(layer)
            + "A scale that is not positive and finite was set by hand or corrupted: "
            "rebuild the layer's float8 variables (quantize a fresh layer)."
        )
        apart = (
            "Keras keeps one amax history per replica and reduces none across them, so "
            "each replica quantizes with the scale of its own shard of the batch (and a "
            "checkpoint saves the first replica's). Shuffle the data so that every shard "
            "looks alike (model.fit(..., shuffle=True), or dataset.shuffle(...)), "
            "normalise the layer's inputs (a LayerNormalization before it), or keep it "
            "unquantized: " + _quantize_others(layer)
        )
        fix = "\n".join(text for text, wanted in (
            (stale, len(problems) > len(replicas_apart)), (apart, bool(replicas_apart)))
            if wanted)
        title = (
            f"float8 scale degenerate in {layer!r}: "
            + "; ".join(f"{t}: {p}" for t, p in problems.items())
        )
        findings.append(finding("MP017", title, layer=layer, evidence=evidence, fix=fix))
    return findings[:MAX_LAYER_FINDINGS]
