"""Findings: rules over a read run that say what is wrong and what to change.

The only place in mpprof that judges. Each rule is a pure function of a
`mpprof.reader.Run`, returns `Finding`s (code, severity, layer, step, the
numbers that triggered it and the concrete fix) and says "not measured" when
the data it needs was not recorded. The catalogue (codes MP001-MP013) is
documented for users in docs/findings.md; codes are a public interface, stable
like a linter's rule codes.

    run = mpprof.reader.read_logdir("logs")["train"]
    for finding in mpprof.diagnosis.diagnose(run):
        print(finding.code, finding.title)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import numpy as np

from mpprof import schema

SEVERITIES = ("critical", "warning", "info")  # most severe first

# --- Thresholds. Each is a named constant so users can see (and the docs can
# --- quote) exactly when a rule fires.

# MP001: Keras 3's LossScaleOptimizer has no floor. A scale below 1 means the
# gradients overflow float16 even UNSCALED, so no loss scale can help.
MIN_HEALTHY_LOSS_SCALE = 1.0
# MP001 (tf-keras, floor of 1): overflows AT the floor mean the same thing;
# a few can be a bad batch, this many in one run is a pattern.
FLOOR_OVERFLOWS_LIMIT = 10

# MP002: a share of steps skipped by overflows, beyond the normal probe after
# each growth. A healthy run with the default dynamic_growth_steps=2000 skips
# ~0.05% of its steps (one probe per growth); 5% is 100x that and wastes one
# step in twenty.
EXCESS_OVERFLOW_SHARE = 0.05
# MP002: the default initial scale (2**15) usually needs a few halvings to
# settle (one skipped step each), so a handful of overflows is calibration,
# not a problem; 8 means the scale started >= 256x too high or keeps failing.
MIN_EXCESS_OVERFLOWS = 8

# MP004: activations whose largest magnitude is within this factor of the
# policy's largest finite value. 16 = four doublings of headroom: weights
# that grow during training can double an activation's range in a few hundred
# steps.
HEADROOM_FACTOR = 16.0

# MP005: share of a gradient's non-zero float16 values below the smallest
# normal (2**-14 = 6.1e-5): they keep fewer mantissa bits or flush to zero.
# A well-scaled run keeps well under 1% there (Micikevicius et al., "Mixed
# Precision Training", 2018); 10% means the loss scale is too low.
UNDERFLOW_SHARE = 0.10

# MP010: share of GPU kernel time in Tensor Core kernels. Matmul/conv heavy
# models in mixed precision spend most GPU time there; under 20% means the
# eligible ops are not reaching the Tensor Cores.
LOW_TENSOR_CORE_SHARE = 0.20
# MP010 (NVML GPM): Tensor Core activity in percent while the GPU is busy.
LOW_TENSOR_UTIL_PERCENT = 5.0
# MP010: a GPU sample counts as "busy" above this utilisation in percent, so
# idle gaps (input pipeline, evaluation) do not dilute the Tensor Core figure.
BUSY_GPU_UTIL_PERCENT = 20.0

# MP011: Tensor Cores first shipped with compute capability 7.0 (Volta);
# native bfloat16 with 8.0 (Ampere).
FP16_TENSOR_CORE_CAPABILITY = (7, 0)
BF16_CAPABILITY = (8, 0)

# How many layers a rule names one by one before summarising the rest: a
# 200-layer model with misaligned shapes should not print 200 findings.
MAX_LAYER_FINDINGS = 10

# Tensor Cores want GEMM dimensions that are multiples of this (fp16/bf16).
TENSOR_CORE_MULTIPLE = 8

_HALF_DTYPES = ("float16", "bfloat16")

_NUMERICS_HINT = (
    "per-layer numerics were not recorded: pass numerics_every=N to "
    "mpprof.MixedPrecisionProfiler(log_dir, numerics_every=100)"
)


@dataclasses.dataclass(frozen=True)
class Finding:
    """One thing wrong (or worth knowing) about a run.

    Attributes:
        code: the catalogue code, "MP001".."MP013".
        severity: one of `SEVERITIES`.
        title: one line saying what is wrong.
        layer: the layer it concerns, or None.
        step: the (first) train step it concerns, or None.
        evidence: the numbers that triggered it (JSON-ready).
        fix: the concrete change to make, possibly with a code snippet.
    """

    code: str
    severity: str
    title: str
    layer: str | None
    step: int | None
    evidence: dict
    fix: str

    def to_dict(self) -> dict:
        """A JSON-ready dict with every field (non-finite numbers as "inf"/"nan")."""
        return _json_safe(dataclasses.asdict(self))


@dataclasses.dataclass(frozen=True)
class Check:
    """Whether a rule could look at a run.

    Attributes:
        code: the rule's code.
        status: "checked", "not measured" (the data it needs was not
            recorded) or "not applicable" (it cannot apply to this run).
        reason: why, for the last two; what to record to measure it.
    """

    code: str
    status: str
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """Every finding of a run and what each rule could check."""

    findings: list[Finding]
    checks: list[Check]

    @property
    def not_measured(self) -> list[Check]:
        return [c for c in self.checks if c.status == "not measured"]


@dataclasses.dataclass(frozen=True)
class Rule:
    """A catalogue entry: what a code means (see docs/findings.md)."""

    code: str
    severity: str
    summary: str


CATALOGUE = {
    rule.code: rule
    for rule in (
        Rule(
            "MP001",
            "critical",
            "loss scale collapsed: gradients overflow even unscaled",
        ),
        Rule(
            "MP002",
            "warning",
            "many steps skipped by overflows, beyond the growth probe",
        ),
        Rule("MP003", "critical", "a layer's forward output overflowed"),
        Rule("MP004", "warning", "activations close to the float16 maximum"),
        Rule("MP005", "warning", "gradients underflow float16 after scaling"),
        Rule(
            "MP006", "warning", "model output (what the loss sees) is float16/bfloat16"
        ),
        Rule("MP007", "info", "GEMM dimension not a multiple of 8 (Tensor Cores)"),
        Rule("MP008", "critical", "mixed_float16 without loss scaling"),
        Rule(
            "MP009", "warning", "mixed policy set, but the model's layers are float32"
        ),
        Rule("MP010", "warning", "low Tensor Core use on the GPU"),
        Rule("MP011", "warning", "hardware without fast half precision"),
        Rule("MP012", "critical", "non-finite loss or weights"),
        Rule("MP013", "info", "frequent fp16 overflows on hardware with bfloat16"),
    )
}


class _NotMeasured(Exception):
    """The data a rule needs was not recorded."""


class _NotApplicable(Exception):
    """The rule cannot apply to this run (e.g. float32 training)."""


def diagnose(run) -> list[Finding]:
    """The findings of `run` (a `mpprof.reader.Run`): most severe first, by step."""
    return evaluate(run).findings


def evaluate(run) -> Diagnosis:
    """The findings of `run` and, for every rule, whether it could check."""
    view = _RunView(run)
    findings: list[Finding] = []
    checks: list[Check] = []
    worker = getattr(run, "worker", None)
    for code, rule in _RULES.items():
        if worker is not None and code not in _HOST_RULES:
            checks.append(Check(code, "not applicable", (
                f"run of worker {worker['index']} of a multi-worker fit: the model-level "
                f"records are judged in run {worker['model_run']!r}, written by the chief"
            )))
            continue
        try:
            found = rule(view)
        except _NotMeasured as e:
            checks.append(Check(code, "not measured", str(e)))
            continue
        except _NotApplicable as e:
            checks.append(Check(code, "not applicable", str(e)))
            continue
        checks.append(Check(code, "checked"))
        findings.extend(found)
    return Diagnosis(sorted(findings, key=_rank), checks)


def _rank(finding: Finding):
    return (
        SEVERITIES.index(finding.severity),
        finding.step is None,
        finding.step or 0,
        finding.code,
    )


class _RunView:
    """A run's records, each read once, plus what the rules derive from them."""

    def __init__(self, run):
        self.run = run

    @functools.cached_property
    def context(self) -> dict:
        return self.run.context or {}

    @functools.cached_property
    def inventory(self) -> dict | None:
        return self.run.inventory

    @functools.cached_property
    def loss_scale(self):
        return self.run.loss_scale

    @functools.cached_property
    def numerics(self):
        return getattr(self.run, "numerics", None)

    @functools.cached_property
    def health(self) -> dict | None:
        return getattr(self.run, "health", None)

    @functools.cached_property
    def gpu(self):
        return getattr(self.run, "gpu", None)

    @functools.cached_property
    def policy(self) -> str | None:
        """The model's dtype policy name."""
        policy = self.context.get("model_policy")
        if policy is None and self.inventory:
            policy = self.inventory.get("model", {}).get("policy")
        return policy

    @functools.cached_property
    def leaf_layers(self) -> list[dict]:
        if not self.inventory:
            return []
        return [
            layer for layer in self.inventory.get("layers", []) if layer.get("is_leaf")
        ]

    @functools.cached_property
    def layers_by_name(self) -> dict[str, dict]:
        return {layer["name"]: layer for layer in self.leaf_layers}

    @functools.cached_property
    def computes_float16(self) -> bool:
        """Whether any part of the model computes in float16."""
        if self.policy == "mixed_float16":
            return True
        return any(
            layer.get("compute_dtype") == "float16" for layer in self.leaf_layers
        )

    @functools.cached_property
    def half_dtype(self) -> str | None:
        """ "float16" or "bfloat16" if the model (or any layer) computes in it."""
        if self.computes_float16:
            return "float16"
        if self.policy == "mixed_bfloat16" or any(
            layer.get("compute_dtype") == "bfloat16" for layer in self.leaf_layers
        ):
            return "bfloat16"
        return None

    def require_mixed(self) -> str:
        if self.policy is None and not self.leaf_layers:
            raise _NotMeasured("no run context or precision inventory was recorded")
        if self.half_dtype is None:
            raise _NotApplicable(f"the model trains in {self.policy or 'float32'}")
        return self.half_dtype

    def require_loss_scale(self):
        if self.loss_scale is None:
            state = self.context.get("collectors", {}).get("loss_scale", {})
            raise _NotApplicable(
                state.get("reason")
                or "no dynamic loss scale recorded (no LossScaleOptimizer)"
            )
        return self.loss_scale

    def require_numerics(self):
        if self.numerics is not None and len(self.numerics.steps):
            return self.numerics
        state = self.context.get("collectors", {}).get("numerics", {})
        if state.get("state") == "ok":
            raise _NotMeasured(
                f"no step was sampled (numerics_every={state.get('every')} is more "
                "than the steps run, and no overflow triggered a forensic sample): "
                "lower numerics_every"
            )
        raise _NotMeasured(_NUMERICS_HINT)

    @functools.cached_property
    def hardware(self) -> dict | None:
        """{"cpu_only": bool, "gpus": [...]} or None when unknown."""
        hardware = self.context.get("hardware")
        if isinstance(hardware, dict) and "cpu_only" in hardware:
            return hardware
        visible = self.context.get("gpus_visible_to_tensorflow")
        if visible == 0:
            return {
                "cpu_only": True,
                "gpus": [],
                "source": "gpus_visible_to_tensorflow",
            }
        return None

    def layer_class(self, name: str | None) -> str:
        layer = self.layers_by_name.get(name) if name else None
        return layer["class"] if layer else "Dense"

    def layer_is_half(self, name: str) -> bool:
        layer = self.layers_by_name.get(name)
        if layer is None:  # not in the inventory: trust the model policy
            return self.half_dtype is not None
        return layer.get("compute_dtype") in _HALF_DTYPES


# ---------------------------------------------------------------- the rules


def _mp001_loss_scale_collapse(view: _RunView) -> list[Finding]:
    view.require_mixed()
    loss_scale = view.require_loss_scale()
    overflows = loss_scale.overflows  # step, scale before, scale after
    below = overflows[overflows[:, 2] < MIN_HEALTHY_LOSS_SCALE]
    # tf-keras floors the scale at 1: overflows AT the floor mean the same.
    at_floor = overflows[
        (overflows[:, 1] <= MIN_HEALTHY_LOSS_SCALE)
        & (overflows[:, 2] >= overflows[:, 1])
    ]
    if len(below):
        first = below[0]
        evidence = {
            "first_step_below_1": int(first[0]),
            "scale_at_that_step": float(first[2]),
            "lowest_scale": float(overflows[:, 2].min()),
            "final_scale": loss_scale.final_scale,
            "overflows_below_1": len(below),
            "overflows": loss_scale.skipped_steps,
        }
        step = int(first[0])
        what = f"the loss scale fell to {evidence['lowest_scale']:g}"
    elif len(at_floor) >= FLOOR_OVERFLOWS_LIMIT:
        evidence = {
            "overflows_at_floor": len(at_floor),
            "floor": MIN_HEALTHY_LOSS_SCALE,
            "first_step_at_floor": int(at_floor[0, 0]),
        }
        step = int(at_floor[0, 0])
        what = f"{len(at_floor)} overflows with the loss scale at its floor of 1"
    else:
        return []
    zero_note = ""
    if evidence.get("lowest_scale", 1.0) == 0.0:
        zero_note = (
            " The scale reached 0: the next finite step divides by it and makes "
            "the weights NaN."
        )
    fix = (
        "Gradients exceed float16's range (65504) even without scaling, so no loss "
        "scale can help." + zero_note + " Find the layer that overflows (MP003, or "
        "record numerics with numerics_every=N), then either keep it in float32:\n"
        f"    keras.layers.{view.layer_class(_last_half_layer(view))}"
        '(..., dtype="float32")\n'
        "or shrink the loss and activations (normalise regression targets and "
        "inputs to unit scale, lower the learning rate), or train in bfloat16, which "
        "has float32's range:\n"
        '    keras.mixed_precision.set_dtype_policy("mixed_bfloat16")'
    )
    return [
        Finding(
            "MP001",
            "critical",
            f"Loss scale collapsed: {what}; gradients overflow float16 even unscaled",
            None,
            step,
            evidence,
            fix,
        )
    ]


def _mp002_overflow_share(view: _RunView) -> list[Finding]:
    view.require_mixed()
    loss_scale = view.require_loss_scale()
    steps = loss_scale.steps_run - loss_scale.first_step
    if steps <= 0:
        raise _NotMeasured("no train step was recorded")
    excess = _excess_overflows(loss_scale)
    probes = loss_scale.skipped_steps - len(excess)
    if (
        len(excess) < MIN_EXCESS_OVERFLOWS
        or len(excess) / steps < EXCESS_OVERFLOW_SHARE
    ):
        return []
    descent = _initial_descent(loss_scale)
    settled = (
        float(loss_scale.overflows[descent - 1, 2])
        if descent
        else loss_scale.final_scale
    )
    evidence = {
        "steps": steps,
        "overflows": loss_scale.skipped_steps,
        "probe_overflows": probes,
        "excess_overflows": len(excess),
        "excess_share": round(len(excess) / steps, 4),
        "initial_descent_overflows": descent,
        "initial_scale": loss_scale.initial_scale,
        "scale_after_initial_descent": settled,
        "final_scale": loss_scale.final_scale,
        "growths": len(loss_scale.growths),
    }
    growth_steps = (
        view.context.get("collectors", {})
        .get("loss_scale", {})
        .get("dynamic_growth_steps")
    )
    if growth_steps is not None:
        evidence["dynamic_growth_steps"] = growth_steps
    if descent >= len(excess) / 2:
        exponent = int(math.floor(math.log2(settled))) if settled > 0 else 0
        fix = (
            f"Most skipped steps ({descent}) are the scale halving down from its "
            f"initial value {loss_scale.initial_scale:g} to {settled:g}. Start it "
            "there:\n"
            f"    optimizer = keras.optimizers.LossScaleOptimizer(optimizer, "
            f"initial_scale=2.0**{exponent})"
        )
    else:
        fix = (
            "The gradients keep exceeding float16 at the scale the optimizer settles "
            "on: find the overflowing layer (MP003/MP004; record numerics with "
            'numerics_every=N) and keep it in float32 (dtype="float32"), clip or '
            "normalise what produces the spikes (outliers in the data, a learning "
            "rate too high), or train in bfloat16, which has float32's range:\n"
            '    keras.mixed_precision.set_dtype_policy("mixed_bfloat16")'
        )
    if growth_steps is not None and growth_steps < 100 and probes:
        fix += (
            f"\nAlso: dynamic_growth_steps={growth_steps} probes a higher scale (and "
            "skips a step when it fails) very often; the default is 2000."
        )
    title = (
        f"{len(excess)} of {steps} steps ({len(excess) / steps:.0%}) skipped by "
        "float16 overflows, beyond the normal probe after each growth"
    )
    return [Finding("MP002", "warning", title, None, int(excess[0]), evidence, fix)]


def _excess_overflows(loss_scale) -> np.ndarray:
    """Overflow steps that are not the normal probe after a growth.

    After each growth (scale doubled) the next overflow halves it back: one
    overflow per growth is the loss scale doing its job. Each growth excuses
    the first overflow after it, if that comes before the next growth.
    """
    overflows = np.sort(loss_scale.overflow_steps)
    growths = np.sort(loss_scale.growths[:, 0].astype(np.int64))
    if not len(overflows) or not len(growths):
        return overflows
    first_after = np.searchsorted(overflows, growths, side="right")
    next_growth = np.append(growths[1:], np.iinfo(np.int64).max)
    valid = first_after < len(overflows)
    valid[valid] &= overflows[first_after[valid]] < next_growth[valid]
    excused = np.zeros(len(overflows), dtype=bool)
    excused[first_after[valid]] = True
    return overflows[~excused]


def _initial_descent(loss_scale) -> int:
    """How many overflows in a row the run started with (scale calibration)."""
    steps = np.sort(loss_scale.overflow_steps)
    if not len(steps) or steps[0] != loss_scale.first_step:
        return 0
    gaps = np.flatnonzero(np.diff(steps) != 1)
    return int(gaps[0] + 1) if len(gaps) else len(steps)


def _mp003_forward_overflow(view: _RunView) -> list[Finding]:
    view.require_mixed()
    numerics = view.require_numerics()
    if not len(numerics.steps) or not len(numerics.layers):
        raise _NotMeasured("no numerics sample was recorded yet")
    bad = _forward_overflow_mask(view, numerics)
    rows = np.flatnonzero(bad.any(axis=1))
    if not len(rows):
        return []
    sample = int(rows[0])
    index = int(np.argmax(bad[sample]))  # first in call order
    layer = numerics.layers[index]
    abs_max = numerics.forward["abs_max"]
    evidence = {
        "step": int(numerics.steps[sample]),
        "abs_max": _number(abs_max[sample, index]),
        "nonfinite_frac": _number(numerics.forward["nonfinite_frac"][sample, index]),
        "policy_max": float(numerics.policy_max),
        "input_abs_max": _number(abs_max[sample, index - 1]) if index else None,
        "layers_overflowing_at_that_step": int(bad[sample].sum()),
        "samples_with_overflow": len(rows),
        "samples": len(numerics.steps),
        "forensic_sample": bool(numerics.forensic[sample]),
    }
    later = [
        numerics.layers[j] for j in np.flatnonzero(bad[sample])[1:MAX_LAYER_FINDINGS]
    ]
    if later:
        evidence["later_layers_also_overflowing"] = later
    cls = view.layer_class(layer)
    fix = (
        f"Layer {layer!r} is the first in call order whose output left "
        f"{view.half_dtype}'s range; the layers after it only inherit the inf/NaN. "
        "Keep it in float32:\n"
        f'    keras.layers.{cls}(..., dtype="float32")\n'
        "or bound its input (normalise the inputs, add LayerNormalization before "
        "it, lower the learning rate if its weights grew), or train in bfloat16:\n"
        '    keras.mixed_precision.set_dtype_policy("mixed_bfloat16")'
    )
    title = (
        f"Forward overflow: {layer} output exceeded {view.half_dtype} "
        f"(max {numerics.policy_max:g}) at step {evidence['step']}"
    )
    return [Finding("MP003", "critical", title, layer, evidence["step"], evidence, fix)]


def _forward_overflow_mask(view: _RunView, numerics) -> np.ndarray:
    """[S, L]: where a layer's forward output overflowed its dtype."""
    abs_max = np.asarray(numerics.forward["abs_max"], dtype=np.float64)
    nonfinite = np.asarray(numerics.forward["nonfinite_frac"], dtype=np.float64)
    half = np.array([view.layer_is_half(name) for name in numerics.layers], dtype=bool)
    with np.errstate(invalid="ignore"):
        return (
            (nonfinite > 0)
            | ~np.isfinite(abs_max)
            | ((abs_max > numerics.policy_max) & half[None, :])
        )


def _mp004_headroom(view: _RunView) -> list[Finding]:
    view.require_mixed()
    numerics = view.require_numerics()
    if not len(numerics.steps) or not len(numerics.layers):
        raise _NotMeasured("no numerics sample was recorded yet")
    abs_max = np.asarray(numerics.forward["abs_max"], dtype=np.float64)
    overflowed = _forward_overflow_mask(view, numerics)
    finite = np.where(overflowed | ~np.isfinite(abs_max), -np.inf, abs_max)
    peak = finite.max(axis=0)
    limit = numerics.policy_max / HEADROOM_FACTOR
    half = np.array([view.layer_is_half(name) for name in numerics.layers], dtype=bool)
    close = np.flatnonzero(half & (peak > limit) & ~overflowed.any(axis=0))
    if not len(close):
        return []
    close = close[np.argsort(-peak[close])]
    worst = int(close[0])
    layer = numerics.layers[worst]
    sample = int(np.argmax(finite[:, worst]))
    evidence = {
        "abs_max": float(peak[worst]),
        "policy_max": float(numerics.policy_max),
        "headroom_factor": round(float(numerics.policy_max / peak[worst]), 2),
        "threshold_factor": HEADROOM_FACTOR,
        "layers_close_to_max": {
            numerics.layers[j]: float(peak[j]) for j in close[:MAX_LAYER_FINDINGS]
        },
    }
    fix = (
        f"{layer!r} reached {peak[worst]:g}, only "
        f"{evidence['headroom_factor']:g}x below "
        f"the largest {view.half_dtype} ({numerics.policy_max:g}): a little growth of "
        "its weights will overflow it. Keep it in float32:\n"
        f'    keras.layers.{view.layer_class(layer)}(..., dtype="float32")\n'
        "or bound its input (normalisation before it, weight decay), or train in "
        'bfloat16: keras.mixed_precision.set_dtype_policy("mixed_bfloat16")'
    )
    title = (
        f"Little headroom: {layer} activations reach {peak[worst]:.4g}, within "
        f"{evidence['headroom_factor']:g}x of the {view.half_dtype} maximum"
    )
    step = int(numerics.steps[sample])
    return [Finding("MP004", "warning", title, layer, step, evidence, fix)]


def _mp005_gradient_underflow(view: _RunView) -> list[Finding]:
    if view.require_mixed() != "float16":
        raise _NotApplicable(
            "bfloat16 has float32's exponent range: gradients do not underflow"
        )
    numerics = view.require_numerics()
    if not len(numerics.steps):
        raise _NotMeasured("no numerics sample was recorded yet")
    # Only steps whose gradients were finite: an overflowing step says nothing
    # about underflow and its statistics are NaN-laden.
    usable = ~np.asarray(numerics.forensic, dtype=bool)
    if not usable.any():
        raise _NotMeasured(
            "every sampled step was a forensic capture right after an overflow; "
            "lower numerics_every to sample ordinary steps"
        )
    candidates = []  # (median share, kind, name, index, series)
    backward = numerics.backward.get("underflow_frac")
    if backward is not None and len(numerics.layers):
        half = [view.layer_is_half(name) for name in numerics.layers]
        candidates += _underflow_candidates(
            "layer",
            numerics.layers,
            backward,
            numerics.backward.get("nonfinite_frac"),
            usable,
            half,
        )
    variable_grads = getattr(numerics, "variable_grads", None) or {}
    if variable_grads.get("underflow_frac") is not None and numerics.variables:
        candidates += _underflow_candidates(
            "variable",
            numerics.variables,
            variable_grads["underflow_frac"],
            variable_grads.get("nonfinite_frac"),
            usable,
            [True] * len(numerics.variables),
        )
    if not candidates:
        return []
    candidates.sort(key=lambda c: -c[0])
    share, kind, name, first_sample = candidates[0]
    scale = _median_scale(numerics, usable)
    evidence = {
        "median_underflow_frac": round(share, 4),
        "threshold": UNDERFLOW_SHARE,
        "kind": kind,
        "median_loss_scale": scale,
        "underflowing": {
            f"{k}:{n}": round(s, 4) for s, k, n, _ in candidates[:MAX_LAYER_FINDINGS]
        },
    }
    layer = name if kind == "layer" else _layer_of_variable(name, view)
    raise_by = 4  # 16x: moves values from the subnormal range into the normal one
    exponent = (
        (int(math.log2(scale)) + raise_by) if scale and scale > 0 else 15 + raise_by
    )
    fix = (
        f"{share:.0%} of the non-zero float16 gradient values of {kind} {name!r} are "
        "below float16's smallest normal (6.1e-5) after scaling: they lose precision "
        "or flush to zero. Raise the loss scale (and let it grow sooner):\n"
        "    optimizer = keras.optimizers.LossScaleOptimizer(\n"
        f"        optimizer, initial_scale=2.0**{exponent}, dynamic_growth_steps=500)\n"
        "If overflows keep the scale down (MP002), keep this layer in float32 "
        '(dtype="float32") instead.'
    )
    if view.loss_scale is None:
        fix = (
            "There is no loss scaling at all (see MP008): wrap the optimizer in "
            "keras.optimizers.LossScaleOptimizer(optimizer). " + fix
        )
    title = (
        f"Gradient underflow: {share:.0%} of {kind} {name}'s float16 gradients are "
        "subnormal or zero after scaling"
    )
    step = int(numerics.steps[first_sample])
    return [Finding("MP005", "warning", title, layer, step, evidence, fix)]


def _underflow_candidates(kind, names, underflow, nonfinite, usable, eligible):
    underflow = np.asarray(underflow, dtype=np.float64)
    rows = usable.copy()
    if nonfinite is not None:
        rows &= ~(np.asarray(nonfinite) > 0).any(axis=1)
    if not rows.any():
        return []
    kept = underflow[rows]
    with np.errstate(all="ignore"):
        medians = np.nanmedian(np.where(np.isfinite(kept), kept, np.nan), axis=0)
    found = []
    sample_index = np.flatnonzero(rows)
    for j in np.flatnonzero(np.nan_to_num(medians) >= UNDERFLOW_SHARE):
        if not eligible[j]:
            continue
        first = sample_index[int(np.argmax(kept[:, j] >= UNDERFLOW_SHARE))]
        found.append((float(medians[j]), kind, names[j], int(first)))
    return found


def _median_scale(numerics, usable) -> float | None:
    scales = getattr(numerics, "loss_scale", None)
    if scales is None or not len(scales):
        return None
    scales = np.asarray(scales, dtype=np.float64)[usable]
    scales = scales[np.isfinite(scales)]
    return float(np.median(scales)) if len(scales) else None


def _layer_of_variable(variable: str, view: _RunView) -> str | None:
    """The layer a variable path such as "sequential/dense_1/kernel" belongs to."""
    parts = variable.split("/")
    for part in reversed(parts[:-1]):
        if part in view.layers_by_name:
            return part
    return parts[-2] if len(parts) > 1 else None


def _mp006_half_output(view: _RunView) -> list[Finding]:
    view.require_mixed()
    if not view.inventory:
        raise _NotMeasured(
            "no precision inventory was recorded (the train step never traced)"
        )
    outputs = view.inventory.get("model", {}).get("output_dtypes", [])
    half = [dtype for dtype in outputs if dtype in _HALF_DTYPES]
    if not half:
        return []
    last = _last_half_layer(view)
    cls = view.layer_class(last)
    evidence = {
        "model_output_dtypes": outputs,
        "last_layer": last,
        "last_layer_class": cls,
    }
    fix = (
        f"The loss sees {half[0]} predictions: softmax/logits in {half[0]} lose "
        "precision and can overflow. Give the last layer float32:\n"
        f'    keras.layers.{cls}(..., dtype="float32")   # {last}\n'
        "or append a float32 activation:\n"
        '    outputs = keras.layers.Activation("linear", dtype="float32")(outputs)'
    )
    title = f"The model's output is {'/'.join(half)}: the loss sees half precision"
    return [Finding("MP006", "warning", title, last, None, evidence, fix)]


def _last_half_layer(view: _RunView) -> str | None:
    called = [
        layer for layer in view.leaf_layers if layer.get("call_index") is not None
    ]
    called.sort(key=lambda layer: layer["call_index"])
    for layer in reversed(called):
        if set(layer.get("output_dtypes") or ()) & set(_HALF_DTYPES):
            return layer["name"]
    return called[-1]["name"] if called else None


def _mp007_tensor_core_shapes(view: _RunView) -> list[Finding]:
    view.require_mixed()
    if not view.inventory:
        raise _NotMeasured(
            "no precision inventory was recorded (the train step never traced)"
        )
    misaligned = [layer for layer in view.leaf_layers if layer.get("misaligned_dims")]
    findings = []
    for layer in misaligned[:MAX_LAYER_FINDINGS]:
        dims = layer.get("gemm_dims") or []
        changes = [
            f"{role} {d} -> {_round_up(d)}"
            for role, d in zip(("input size", "output size"), dims, strict=False)
            if d % TENSOR_CORE_MULTIPLE
        ]
        evidence = {
            "gemm_dims": dims,
            "misaligned_dims": layer["misaligned_dims"],
            "multiple": TENSOR_CORE_MULTIPLE,
            "compute_dtype": layer.get("compute_dtype"),
        }
        fix = (
            f"Round {', '.join(changes)} (a multiple of {TENSOR_CORE_MULTIPLE}) so "
            "the GEMM runs on Tensor Cores at full speed, e.g.\n"
            f"    keras.layers.{layer['class']}({_round_up(dims[-1]) if dims else 8}"
            ", ...)\nPad an input size by padding the features (or the previous "
            "layer's units)."
        )
        title = (
            f"{layer['name']}: GEMM dimension(s) {layer['misaligned_dims']} not a "
            f"multiple of {TENSOR_CORE_MULTIPLE} (Tensor Cores)"
        )
        findings.append(
            Finding("MP007", "info", title, layer["name"], None, evidence, fix)
        )
    rest = misaligned[MAX_LAYER_FINDINGS:]
    if rest:
        evidence = {
            "layers": {layer["name"]: layer["misaligned_dims"] for layer in rest}
        }
        findings.append(
            Finding(
                "MP007",
                "info",
                f"{len(rest)} more layers with GEMM dimensions not a multiple of "
                f"{TENSOR_CORE_MULTIPLE}",
                None,
                None,
                evidence,
                "Round each listed dimension up to a multiple of "
                f"{TENSOR_CORE_MULTIPLE}.",
            )
        )
    return findings


def _round_up(value: int) -> int:
    return -(-int(value) // TENSOR_CORE_MULTIPLE) * TENSOR_CORE_MULTIPLE


def _mp008_no_loss_scaling(view: _RunView) -> list[Finding]:
    view.require_mixed()
    if not view.computes_float16:
        raise _NotApplicable("bfloat16 needs no loss scaling")
    state = view.context.get("collectors", {}).get("loss_scale", {}).get("state")
    if view.loss_scale is not None or state == "ok":
        return []
    if state is None:
        raise _NotMeasured("no run context was recorded")
    optimizer = view.context.get("optimizer")
    evidence = {
        "model_policy": view.policy,
        "optimizer": optimizer,
        "float16_layers": sum(
            layer.get("compute_dtype") == "float16" for layer in view.leaf_layers
        ),
    }
    fix = (
        "Without loss scaling, float16 gradients below 6e-8 become zero and large "
        "ones overflow unnoticed. Wrap the optimizer:\n"
        "    optimizer = keras.optimizers.LossScaleOptimizer("
        f"keras.optimizers.{optimizer or 'Adam'}())\n"
        "    model.compile(optimizer=optimizer, ...)\n"
        "(model.compile does this itself when auto_scale_loss=True, the default, and "
        'the model was built under "mixed_float16".)'
    )
    title = f"mixed_float16 training without loss scaling (optimizer {optimizer})"
    return [Finding("MP008", "critical", title, None, None, evidence, fix)]


def _mp009_policy_after_build(view: _RunView) -> list[Finding]:
    global_policy = view.context.get("global_policy")
    if global_policy is None:
        raise _NotMeasured("no run context was recorded")
    if not global_policy.startswith("mixed_"):
        raise _NotApplicable(f"the global policy is {global_policy}")
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
        f'    keras.mixed_precision.set_dtype_policy("{global_policy}")\n'
        "    model = build_model()   # after the policy\n"
        "    model.compile(...)"
    )
    title = f"Global policy is {global_policy} but the model's layers are float32"
    return [Finding("MP009", "warning", title, None, None, evidence, fix)]


def _mp010_tensor_core_use(view: _RunView) -> list[Finding]:
    view.require_mixed()
    hardware = view.hardware
    if hardware is not None and hardware.get("cpu_only"):
        raise _NotApplicable("no GPU: Tensor Cores do not apply")
    gpu = view.gpu
    if gpu is None or (
        getattr(gpu, "mode", "unavailable") == "unavailable" and not gpu.kernels
    ):
        raise _NotMeasured(
            "no GPU utilisation or kernel statistics were recorded (needs an NVIDIA "
            "GPU "
            "with NVML, or a profiler trace)"
        )
    kernels = getattr(gpu, "kernels", None) or {}
    share = kernels.get("tensor_core_share")
    if share is not None and not kernels.get("no_gpu_kernels"):
        if share >= LOW_TENSOR_CORE_SHARE:
            return []
        evidence = {
            "tensor_core_share": round(float(share), 4),
            "threshold": LOW_TENSOR_CORE_SHARE,
            "total_gpu_kernel_us": kernels.get("total_gpu_kernel_us"),
            "eligible_not_using_us": kernels.get("eligible_not_using_us"),
            "top_ops": kernels.get("top_ops", [])[:5],
        }
        title = f"Only {share:.0%} of GPU kernel time ran on Tensor Cores"
        return [
            Finding(
                "MP010", "warning", title, None, None, evidence, _tensor_core_fix(view)
            )
        ]
    util = _busy_tensor_util(gpu)
    if util is None:
        raise _NotMeasured(
            "Tensor Core activity not measured (NVML GPM needs a Hopper or newer GPU; "
            "kernel statistics need a profiler trace)"
        )
    median, busy_samples = util
    if median >= LOW_TENSOR_UTIL_PERCENT:
        return []
    evidence = {
        "median_tensor_util_percent": round(median, 2),
        "threshold_percent": LOW_TENSOR_UTIL_PERCENT,
        "busy_samples": busy_samples,
        "mode": gpu.mode,
    }
    title = f"Tensor Cores {median:.1f}% active while the GPU was busy"
    return [
        Finding("MP010", "warning", title, None, None, evidence, _tensor_core_fix(view))
    ]


def _busy_tensor_util(gpu) -> tuple[float, int] | None:
    columns = tuple(getattr(schema, "GPU_SAMPLE_COLUMNS", ()))
    samples = getattr(gpu, "samples", None)
    if "tensor_util" not in columns or samples is None or not len(samples):
        return None
    samples = np.asarray(samples, dtype=np.float64).reshape(len(samples), -1)
    tensor = samples[:, columns.index("tensor_util")]
    busy = np.isfinite(tensor)
    for name in ("gpu_util", "sm_util", "sm_active"):
        if name in columns:
            activity = samples[:, columns.index(name)]
            busy &= ~(activity < BUSY_GPU_UTIL_PERCENT)  # NaN activity: keep the sample
            break
    if not busy.any():
        return None
    return float(np.median(tensor[busy])), int(busy.sum())


def _tensor_core_fix(view: _RunView) -> str:
    misaligned = [
        layer["name"] for layer in view.leaf_layers if layer.get("misaligned_dims")
    ]
    lines = ["Tensor-Core-eligible work is not reaching the Tensor Cores:"]
    if misaligned:
        lines.append(
            f"- round the GEMM dimensions of {', '.join(misaligned[:5])} to "
            f"multiples of {TENSOR_CORE_MULTIPLE} (MP007);"
        )
    lines += [
        "- use batch sizes and sequence lengths that are multiples of 8;",
        "- compile with XLA: model.compile(..., jit_compile=True);",
        "- if the GPU is mostly idle, the input pipeline is the bottleneck: "
        "dataset.prefetch(tf.data.AUTOTUNE).",
    ]
    return "\n".join(lines)


def _mp011_hardware(view: _RunView) -> list[Finding]:
    half = view.require_mixed()
    hardware = view.hardware
    if hardware is None:
        raise _NotMeasured("the GPUs' compute capability was not recorded")
    gpus = hardware.get("gpus") or []
    if hardware.get("cpu_only") or not gpus:
        if half != "float16":
            raise _NotApplicable("bfloat16 on CPU: speed depends on AVX512_BF16/AMX")
        evidence = {
            "cpu_only": True,
            "devices": [d.get("name") for d in view.context.get("devices", [])],
        }
        fix = (
            "CPUs have no float16 Tensor Cores: mixed_float16 is usually slower than "
            "float32 there (2x to 50x in mpprof's tests, by TensorFlow's CPU "
            "kernels). Train in float32 on this machine, or in bfloat16 if the "
            "CPU has AVX512_BF16/AMX:\n"
            '    keras.mixed_precision.set_dtype_policy("mixed_bfloat16")'
            '  # or "float32"'
        )
        title = (
            "mixed_float16 on a CPU only: no float16 Tensor Cores, expect a slow-down"
        )
        return [Finding("MP011", "warning", title, None, None, evidence, fix)]
    needed = FP16_TENSOR_CORE_CAPABILITY if half == "float16" else BF16_CAPABILITY
    slow = [gpu for gpu in gpus if not _gpu_supports(gpu, half, needed)]
    if not slow:
        return []
    evidence = {
        "gpus": [
            {"name": g.get("name"), "compute_capability": g.get("compute_capability")}
            for g in slow
        ],
        "needs_compute_capability": list(needed),
    }
    fix = (
        f"{slow[0].get('name')} (compute capability "
        f"{_capability_text(slow[0])}) has no fast {half} units: mixed precision saves "
        "memory but not time there. Train in float32:\n"
        '    keras.mixed_precision.set_dtype_policy("float32")'
    )
    title = f"{half} on a GPU without fast {half} math ({slow[0].get('name')})"
    return [Finding("MP011", "warning", title, None, None, evidence, fix)]


def _gpu_supports(gpu: dict, dtype: str, needed: tuple[int, int]) -> bool:
    flag = gpu.get("fp16_tensor_cores" if dtype == "float16" else "bf16")
    if flag is not None:
        return bool(flag)
    capability = gpu.get("compute_capability")
    return capability is None or tuple(capability) >= needed


def _capability_text(gpu: dict) -> str:
    capability = gpu.get("compute_capability")
    return ".".join(str(c) for c in capability) if capability else "unknown"


def _mp012_nonfinite(view: _RunView) -> list[Finding]:
    health, numerics = view.health, view.numerics
    if health is None and numerics is None:
        raise _NotMeasured(
            "the loss and weights were not checked (needs the numerics/health "
            "records: numerics_every=N)"
        )
    findings = []
    overflow_steps = set()
    if view.loss_scale is not None:
        overflow_steps = set(view.loss_scale.overflow_steps.tolist())
    weights = list((health or {}).get("nonfinite_weights") or [])
    if weights:
        step = (health or {}).get("first_nonfinite_loss_step") or (health or {}).get(
            "checked_step"
        )
        evidence = {
            "nonfinite_weights": weights[:20],
            "count": len(weights),
            "checked_step": (health or {}).get("checked_step"),
        }
        if view.loss_scale is not None:
            evidence["final_loss_scale"] = view.loss_scale.final_scale
        fix = _nonfinite_fix(view, weights=True)
        findings.append(
            Finding(
                "MP012",
                "critical",
                f"{len(weights)} weight(s) became non-finite (NaN/inf)",
                _layer_of_variable(weights[0], view),
                _int_or_none(step),
                evidence,
                fix,
            )
        )
    loss_step = _nonfinite_loss_with_finite_grads(
        view, health, numerics, overflow_steps
    )
    if loss_step is not None:
        step, evidence = loss_step
        findings.append(
            Finding(
                "MP012",
                "critical",
                f"Non-finite loss at step {step}, not caught as a gradient overflow",
                None,
                step,
                evidence,
                _nonfinite_fix(view, weights=False),
            )
        )
    return findings


def _nonfinite_loss_with_finite_grads(view, health, numerics, overflow_steps):
    """(step, evidence) of the first non-finite loss the loss scale did not catch."""
    guarded = view.loss_scale is not None
    if health and health.get("first_nonfinite_loss_step") is not None:
        step = int(health["first_nonfinite_loss_step"])
        if not guarded or step not in overflow_steps:
            return step, {
                "first_nonfinite_loss_step": step,
                "nonfinite_loss_batches": health.get(
                    "nonfinite_loss_batches", health.get("nonfinite_loss_steps")
                ),
                "loss_scaled": guarded,
                "step_was_skipped": False,
            }
    if (
        numerics is not None
        and getattr(numerics, "loss", None) is not None
        and len(numerics.steps)
    ):
        loss = np.asarray(numerics.loss, dtype=np.float64)
        bad = ~np.isfinite(loss)
        grads = (getattr(numerics, "variable_grads", None) or {}).get("nonfinite_frac")
        if grads is not None and np.size(grads):
            bad &= ~(np.asarray(grads) > 0).any(axis=1)
        for i in np.flatnonzero(bad):
            step = int(numerics.steps[i])
            if not guarded or step not in overflow_steps:
                return step, {
                    "loss": _number(loss[i]),
                    "step": step,
                    "loss_scaled": guarded,
                    "gradients_finite": grads is not None,
                }
    return None


def _nonfinite_fix(view: _RunView, *, weights: bool) -> str:
    lines = []
    if view.loss_scale is not None and view.loss_scale.final_scale == 0.0:
        lines.append("The loss scale reached 0 (MP001): the step after divided by it.")
    if weights:
        lines.append(
            "Training cannot recover from NaN weights: restart from the last "
            "good checkpoint, and stop on the first NaN next time:"
        )
        lines.append("    callbacks=[keras.callbacks.TerminateOnNaN(), ...]")
    lines.append(
        "Find where the first inf/NaN came from: MP003 names the first overflowing "
        "layer; check the data for NaN/inf (np.isfinite(x).all()), divide-by-zero or "
        "log(0) in a custom loss (add an epsilon), and a learning rate too high."
    )
    if view.computes_float16 and view.loss_scale is None:
        lines.append(
            "Wrap the optimizer in keras.optimizers.LossScaleOptimizer so "
            "non-finite gradient steps are skipped (MP008)."
        )
    return "\n".join(lines)


def _mp013_bfloat16_hint(view: _RunView) -> list[Finding]:
    if view.require_mixed() != "float16":
        raise _NotApplicable("the model does not train in float16")
    hardware = view.hardware
    if hardware is None:
        raise _NotMeasured("the GPUs' bfloat16 support was not recorded")
    gpus = hardware.get("gpus") or []
    if hardware.get("cpu_only") or not gpus:
        raise _NotApplicable("no GPU (for CPUs see MP011)")
    if not all(_gpu_supports(gpu, "bfloat16", BF16_CAPABILITY) for gpu in gpus):
        return []
    triggers = [
        finding
        for rule in (
            _mp001_loss_scale_collapse,
            _mp002_overflow_share,
            _mp003_forward_overflow,
        )
        for finding in _quiet(rule, view)
    ]
    if not triggers:
        return []
    evidence = {
        "because_of": sorted({f.code for f in triggers}),
        "gpus": [g.get("name") for g in gpus],
    }
    if view.loss_scale is not None:
        evidence["overflows"] = view.loss_scale.skipped_steps
    fix = (
        f"{gpus[0].get('name')} supports bfloat16, which has float32's exponent range: "
        "no overflows at 65504 and no loss scaling needed, at the same speed:\n"
        '    keras.mixed_precision.set_dtype_policy("mixed_bfloat16")\n'
        "(set it before building the model; a LossScaleOptimizer is then unnecessary)"
    )
    title = "Frequent float16 overflows on a GPU with bfloat16: try mixed_bfloat16"
    step = min((f.step for f in triggers if f.step is not None), default=None)
    return [Finding("MP013", "info", title, None, step, evidence, fix)]


def _quiet(rule, view) -> list[Finding]:
    try:
        return rule(view)
    except (_NotMeasured, _NotApplicable):
        return []


def _number(value) -> float:
    return float(value)


def _json_safe(value):
    """`value` with numpy scalars made Python and non-finite floats made strings.

    Strict JSON has no NaN or Infinity, and an overflow's evidence is often inf.
    """
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _int_or_none(value) -> int | None:
    return None if value is None else int(value)


# Rules that judge one host's hardware: the only ones a worker's own run
# (`train/worker_<i>`, GPU samples and evidence only) can be checked against.
_HOST_RULES = ("MP010", "MP011")

_RULES = {
    "MP001": _mp001_loss_scale_collapse,
    "MP002": _mp002_overflow_share,
    "MP003": _mp003_forward_overflow,
    "MP004": _mp004_headroom,
    "MP005": _mp005_gradient_underflow,
    "MP006": _mp006_half_output,
    "MP007": _mp007_tensor_core_shapes,
    "MP008": _mp008_no_loss_scaling,
    "MP009": _mp009_policy_after_build,
    "MP010": _mp010_tensor_core_use,
    "MP011": _mp011_hardware,
    "MP012": _mp012_nonfinite,
    "MP013": _mp013_bfloat16_hint,
}


# ------------------------------------------------------------ presentation


def exceeds(findings: list[Finding], fail_on: str | None) -> bool:
    """Whether any finding is at least as severe as `fail_on` (None: never)."""
    if fail_on is None:
        return False
    limit = SEVERITIES.index(fail_on)
    return any(SEVERITIES.index(f.severity) <= limit for f in findings)


_COLORS = {"critical": "\033[1;31m", "warning": "\033[1;33m", "info": "\033[1;36m"}
_BOLD, _DIM, _RESET = "\033[1m", "\033[2m", "\033[0m"


def format_text(run, result: Diagnosis, *, color: bool = False) -> str:
    """`result` as text for a terminal: grouped by severity, the fix beneath.

    Args:
        run: the `mpprof.reader.Run` that was diagnosed (for its name,
            context and read warnings).
        result: what `evaluate(run)` returned.
        color: use ANSI colours (for a terminal).
    """

    def paint(text: str, style: str) -> str:
        return f"{style}{text}{_RESET}" if color else text

    lines = [paint(f"== run {_printable(run.name)} ==", _BOLD) + _run_line(run)]
    lines += [f"  ! {_printable(w)}" for w in run.warnings]
    for severity in SEVERITIES:
        group = [f for f in result.findings if f.severity == severity]
        if not group:
            continue
        lines.append(paint(f"{severity.upper()} ({len(group)})", _COLORS[severity]))
        for finding in group:
            code = paint(finding.code, _COLORS[severity])
            lines.append(f"  {code}  {_printable(finding.title)}")
            where = []
            if finding.layer is not None:
                where.append(f"layer {_printable(finding.layer)}")
            if finding.step is not None:
                where.append(f"step {finding.step}")
            if where:
                lines.append(f"         {', '.join(where)}")
            lines.append(paint(f"         evidence: {_evidence_text(finding)}", _DIM))
            lines.append("         fix:")
            fix_lines = finding.fix.splitlines()
            lines += [f"           {_printable(line)}" for line in fix_lines]
    if not result.findings:
        lines.append("No findings.")
    for check in result.not_measured:
        lines.append(paint(f"  not measured: {check.code}: {check.reason}", _DIM))
    counts = [
        f"{sum(f.severity == s for f in result.findings)} {s}" for s in SEVERITIES
    ]
    lines.append(", ".join(counts))
    return "\n".join(lines)


def _run_line(run) -> str:
    context = run.context or {}
    parts = [context.get("model_policy"), context.get("optimizer")]
    loss_scale = run.loss_scale
    if loss_scale is not None:
        steps = loss_scale.steps_run - loss_scale.first_step
        parts.append(f"{steps} steps, {loss_scale.skipped_steps} skipped")
    parts = [_printable(str(p)) for p in parts if p]
    return f"  ({', '.join(parts)})" if parts else ""


def _evidence_text(finding: Finding, limit: int = 300) -> str:
    items = []
    for key, value in finding.to_dict()["evidence"].items():
        if isinstance(value, float):
            value = f"{value:.4g}"
        elif not isinstance(value, (int, str)):
            value = json.dumps(value, separators=(",", ":"))
        items.append(f"{key}={value}")
    text = _printable(", ".join(items))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _printable(text: str) -> str:
    """`text` with control characters escaped, so a layer name cannot drive
    the terminal (ANSI escape sequences, carriage returns)."""
    return "".join(
        c if c.isprintable() or c == " " else c.encode("unicode_escape").decode()
        for c in str(text)
    )
