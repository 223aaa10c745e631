"""What "verified" means: for a replay's fix and for the precision advisor.

A candidate (a per-layer policy map, optionally with the model's inputs
scaled into range) is **verified** only when both checks hold; otherwise it
is "not verified", with the check that failed and its number:

1. **The step check**, on each captured batch, from the captured weights:
   with the candidate, no forward op overflows, every layer computing in a
   half dtype keeps its output at least `HEADROOM_FACTOR` (MP004's) below
   that dtype's max (a fix that leaves a float16 layer's values within a few
   doublings of 65504 overflows once the weights grow a little), and the loss, every
   variable's unscaled gradient and every layer's output stay within
   `TOLERANCES[dtype]` (relative error norms, `relative_error`) of a float32
   reference: the same batch, weights and input change, every layer and the
   model in float32. `dtype` is the lowest precision the candidate computes
   in (`candidate_dtype`). A float16 candidate's gradients are taken at the
   run's loss scale (`Engine.loss_scale`; Keras' initial 2**15 when the run
   had none) and divided by it, as a LossScaleOptimizer hands them to its
   optimizer; where they overflow at that scale the scale is lowered, 16x at
   a time, as its halving would (the result says which scale was used).
2. **The trial**: `TRIAL_STEPS` optimizer steps from the captured weights on
   the captured batches (cycled), with the candidate and with float32, each
   with a fresh optimizer of the run's optimizer config (a float16 candidate
   keeps the run's loss scaling, starting at the scale the step check used;
   steps it skips while halving are retried, not counted). The candidate's
   loss must decrease by at least `TRIAL_MIN_PROGRESS` of float32's decrease
   (first loss to the mean of the last `TRIAL_TAIL` losses; a model that stops
   learning fails here), and its mean loss over the trial must stay within `TRIAL_MEAN_BAND` of
   float32's. Where float32 itself does not learn in the trial (its decrease
   under `TRIAL_FLAT` of its first loss) the trial cannot show that the
   candidate trains: not verified, and the result says so.

API (framework-free; each backend's replay engine implements `Engine`):

    Candidate(layer_policies={"dense_3": "float32"})        # a fix's map
    Candidate(input_scale=1 / 65535)                        # bounded inputs
    Candidate(default_policy="mixed_bfloat16")              # an advisor plan
    verifier = Verifier(engine)          # caches float32's passes and trial
    result = verifier.verify(candidate)  # -> Verification
    result.verified, result.detail, result.to_dict()

`Engine` (see the Protocol): `batch_count`, `loss_scale`, `run_policies`
(qualified layer name -> the run's policy name), `run_pass(candidate, batch,
loss_scale) -> PassResult` (with per-variable `gradients`, scaled as run) and
`train(candidate, steps) -> list[float]` (the loss of each step, computed
before its update). A candidate's `layer_policies` are keyed by the engine's
qualified layer names (`mpprof.replay.search` names them so); each named
layer's sublayers take its policy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Protocol

import numpy as np

from mpprof.dtypes import DTYPE_MAX, HALF_DTYPES, HEADROOM_FACTOR
from mpprof.replay.search import PassResult, describe

# --- The one place the tolerances and the band are declared -------------------
#
# Relative error norms ||candidate - float32|| / ||float32|| on the captured step.
# float16 rounds to 2**-11 (4.9e-4) of a value, bfloat16 to 2**-8 (3.9e-3).
# Measured on healthy steps (benchmarks/bench_verification.py: the seed MLP,
# the Attention demo's model, keras-io's mnist_convnet, an LSTM; TensorFlow
# and JAX on CPU), the largest errors were, float16 / bfloat16: loss 1e-4 /
# 4.4e-4, a layer's output 1.3e-3 / 8.8e-3, a variable's gradient 0.03 / 0.15
# (a first conv kernel's: its gradient sums the rounding of every upstream
# layer over every position, and a ReLU whose input changes sign moves whole
# entries). Outputs and loss get ~8x headroom over those, gradients ~3x; a
# real fault gives inf or errors of 0.3 and more. bfloat16's are 8x float16's
# (its rounding is 8x coarser), gradients 5x (measured).
TOLERANCES: dict[str, dict[str, float]] = {
    "float16": {"loss": 1e-2, "gradient": 0.1, "output": 1e-2},
    "bfloat16": {"loss": 8e-2, "gradient": 0.5, "output": 8e-2},
    # A float32 candidate (every layer in float32) differs from the reference
    # only by the order of float32 sums.
    "float32": {"loss": 1e-4, "gradient": 1e-3, "output": 1e-4},
}

# The headroom a candidate must leave (`mpprof.dtypes.HEADROOM_FACTOR`, MP004's
# threshold): each half-precision layer's largest output on the
# captured step at least 16x under its dtype's max, so that a verified fix,
# applied, trains without MP004 and its weights may grow four doublings. The
# tolerances above cannot see it: a float16 value of 3.1e4 is as exact,
# relatively, as one of 0.3. Measured: keras-io's mnist_convnet fed raw
# 16-bit pixels with conv2d in float32 (the map that ends the input cast's
# overflow) leaves max_pooling2d at 3.1e4 and the dropout at 3.9e4 (1.7x
# under 65504); retrained from its initial weights, its loss scale halves 12
# times (2**15 to 8) before a step applies, and its mean loss over 30 steps is
# 233% from float32's, while a trial of the same map from the captured
# weights tracked float32 within 1% (it ran without the loss scaling then;
# with it, its 11 halvings are skips, not counted).
# Healthy fixes and steps left 80x and more (the bounded inputs there: 1.4e5x;
# benchmarks/bench_verification.py prints each model's headroom).

# A variable whose float32 gradient is under this share of the whole
# gradient's norm (a BatchNormalization gamma over a constant feature: exactly
# 0 in float32, rounding noise in float16) is judged against that share, not
# against its own ~0 norm, which would make any rounding an infinite error.
GRADIENT_FLOOR = 1e-3

# The trial: a few dozen steps on the captured batches are cheap on a CPU and
# long enough for float32 to memorise a batch (its loss falls by a large
# share), so a model that stops learning shows as a flat trajectory.
TRIAL_STEPS = 30
# The candidate's loss decrease (first loss to the mean of the last TRIAL_TAIL)
# must be at least this share of float32's. A model that stops learning gives
# ~0 (the raw-input convnet: 0%), healthy float16/bfloat16 steps gave
# 0.99-1.0 on our examples; in between, 30 steps on one batch are noisy (a
# BatchNormalization model over constant features gave 0.78), so this check
# catches a model learning at most half as much, and closeness is the mean
# band's job.
TRIAL_MIN_PROGRESS = 0.5
TRIAL_TAIL = 5
# The candidate's mean loss over the trial must be within this share of
# float32's (loss-scale skips and rounding move a healthy float16 run by a
# few percent; a model that stops learning by far more).
TRIAL_MEAN_BAND = 0.1
# Below this share of its first loss, float32's own decrease is noise: the
# trial then cannot tell a candidate that trains from one that does not.
TRIAL_FLAT = 0.01

# Steps a float16 trial's loss scale may skip (halving from the captured
# scale to a workable one: 2**15 to 1 is 15 halvings) before the candidate
# is taken for one that cannot train.
TRIAL_MAX_SKIPS = 20

# Keras' LossScaleOptimizer's initial scale, used for a float16 candidate of
# a run that had no loss scale.
DEFAULT_LOSS_SCALE = 2.0**15
# A float16 candidate whose scaled gradients overflow: the scale is lowered
# this many times at most, by LOSS_SCALE_STEP each time.
LOSS_SCALE_STEP = 16.0
MAX_SCALE_LOWERINGS = 4


@dataclasses.dataclass(frozen=True)
class Candidate:
    """What is verified: a policy map, and optionally the inputs scaled.

    Attributes:
        layer_policies: qualified layer name -> dtype policy name ("float32",
            "mixed_bfloat16", ...); each layer's sublayers take it too.
        default_policy: the policy of the model and of every layer not named
            (None: each keeps the run's).
        input_scale: every floating model input is multiplied by this before
            the model (the "bound the inputs" fix: a float32
            `Rescaling(input_scale)` first layer, or the division in the input
            pipeline); None: inputs as captured.
        label: what it is, in words, for the result.
    """

    layer_policies: Mapping[str, str] = dataclasses.field(default_factory=dict)
    default_policy: str | None = None
    input_scale: float | None = None
    label: str = ""

    def reference(self) -> Candidate:
        """float32 everywhere, with the same input change."""
        return Candidate(default_policy="float32", input_scale=self.input_scale,
                         label="float32")

    def to_dict(self) -> dict:
        return {"layer_policies": dict(self.layer_policies),
                "default_policy": self.default_policy, "input_scale": self.input_scale,
                "label": self.label}


class Engine(Protocol):
    """What a backend's replay engine gives the verification."""

    batch_count: int
    loss_scale: float  # the run's loss scale at the capture (1.0: none)
    run_policies: Mapping[str, str]  # qualified layer name -> the run's policy

    def run_pass(self, candidate: Candidate, batch: int, loss_scale: float) -> PassResult:
        """One forward and backward pass of captured batch `batch` from the
        captured weights, the loss multiplied by `loss_scale` before the
        backward pass; `PassResult.gradients` are keyed by variable path and
        still scaled."""

    def train(self, candidate: Candidate, steps: int,
              loss_scale: float | None = None) -> list[float]:
        """`steps` optimizer updates from the captured weights on the
        captured batches (cycled), a fresh optimizer of the run's config
        (wrapped in a LossScaleOptimizer where the run's was and the candidate
        computes in float16, its initial scale `loss_scale`, or the run's
        when None); the loss of each update, before it. Steps the loss scale
        skips (halving) are not updates: they are retried on the next batch,
        at most `TRIAL_MAX_SKIPS` of them (fewer losses come back then), and
        counted in `self.skipped_steps`. Leaves the model's weights as they
        were."""


def policy_compute_dtype(policy: str | None) -> str:
    """The dtype a Keras policy name computes in ("mixed_float16" ->
    "float16"; "float32" -> "float32")."""
    name = str(policy or "float32")
    for dtype in ("bfloat16", "float16"):
        if name.endswith(dtype):
            return dtype
    return "float32"


def effective_policies(candidate: Candidate, run_policies: Mapping[str, str]) -> dict[str, str]:
    """Each layer's policy under the candidate (a named layer's sublayers
    take its policy; the innermost name given wins)."""
    policies = {}
    for name, policy in run_policies.items():
        chosen = candidate.default_policy or policy
        depth = -1
        for named, named_policy in candidate.layer_policies.items():
            if (name == named or name.startswith(named + "/")) and named.count("/") > depth:
                chosen, depth = named_policy, named.count("/")
        policies[name] = chosen
    return policies


def candidate_dtype(candidate: Candidate, run_policies: Mapping[str, str]) -> str:
    """The lowest precision any layer computes in under the candidate: the
    tolerances applied."""
    dtypes = {policy_compute_dtype(p) for p in effective_policies(candidate,
                                                                     run_policies).values()}
    if candidate.default_policy:
        dtypes.add(policy_compute_dtype(candidate.default_policy))
    for dtype in ("bfloat16", "float16"):
        if dtype in dtypes:
            return dtype
    return "float32"


def relative_error(got, expected, floor: float = 0.0) -> float:
    """||got - expected|| / max(||expected||, floor) (L2 over every
    element); inf where `got` is non-finite; 0 where both are zero."""
    got = np.asarray(got, np.float64)
    expected = np.asarray(expected, np.float64)
    if got.shape != expected.shape:
        return math.inf
    if not np.all(np.isfinite(got)):
        return math.inf
    norm = max(float(np.linalg.norm(expected)), floor)
    difference = float(np.linalg.norm(got - expected))
    if norm == 0.0:
        return 0.0 if difference == 0.0 else math.inf
    return difference / norm


@dataclasses.dataclass
class StepCheck:
    """The step check on one captured batch.

    Attributes:
        batch: which captured batch.
        loss_scale: the scale the candidate's gradients were taken at.
        overflow: what overflowed with the candidate, in words (None: nothing).
        loss: the candidate's loss and float32's.
        loss_rel_error: their relative difference.
        gradient_rel_error / worst_gradient: the largest relative error of a
            variable's unscaled gradient, and that variable's path.
        output_rel_error / worst_output: the largest relative error of a
            layer's output, and that layer.
        headroom: the tightest half-precision layer: `{"layer", "dtype",
            "abs_max", "factor"}` (its largest output and how many times
            under its dtype's max; None: no layer computes in a half dtype).
        failed: the first quantity past its tolerance, in the order the
            step computes them ("overflow", "headroom", "output", "loss",
            "gradient"), None when none.
    """

    batch: int
    loss_scale: float
    overflow: str | None
    loss: dict
    loss_rel_error: float
    gradient_rel_error: float
    worst_gradient: str | None
    output_rel_error: float
    worst_output: str | None
    failed: str | None
    headroom: dict | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Trial:
    """The trial's trajectories and what was judged of them."""

    steps: int
    candidate_losses: list[float]
    float32_losses: list[float]
    candidate_decrease: float
    float32_decrease: float
    progress: float | None  # candidate's decrease / float32's (None: float32 flat)
    mean_rel_diff: float
    passed: bool
    reason: str
    skipped: int = 0  # steps the candidate's loss scale skipped (not updates)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "band": trial_band()}


def trial_band() -> dict:
    """The trial's constants, as written into every result."""
    return {"steps": TRIAL_STEPS, "min_progress": TRIAL_MIN_PROGRESS, "tail": TRIAL_TAIL,
            "mean_band": TRIAL_MEAN_BAND, "float32_flat_below": TRIAL_FLAT,
            "max_skips": TRIAL_MAX_SKIPS}


@dataclasses.dataclass
class Verification:
    """A candidate's verdict and every number behind it.

    Attributes:
        verified: both checks held.
        detail: one line, "verified: ..." or "not verified: ...", with numbers.
        dtype: the tolerances' dtype (`candidate_dtype`).
        tolerances: those tolerances.
        step: the step check per captured batch.
        trial: the trial (None where the step check failed first, or no trial
            could run: `trial_note` says why).
        candidate: what was verified.
    """

    verified: bool
    detail: str
    dtype: str
    tolerances: dict
    step: list[StepCheck]
    trial: Trial | None
    candidate: Candidate
    trial_note: str | None = None

    def to_dict(self) -> dict:
        return {"verified": self.verified, "verified_detail": self.detail,
                "dtype": self.dtype,
                "tolerances": {**self.tolerances, "headroom": HEADROOM_FACTOR},
                "step": [s.to_dict() for s in self.step],
                "trial": self.trial.to_dict() if self.trial else None,
                "trial_band": trial_band(),
                **({"trial_note": self.trial_note} if self.trial_note else {}),
                "candidate": self.candidate.to_dict()}


class Verifier:
    """Verifies candidates on one engine; float32's passes and trial are
    computed once per input change and shared.

    Args:
        engine: the backend's engine (`Engine`).
        trial_steps: the trial's length (`TRIAL_STEPS`).
    """

    def __init__(self, engine: Engine, trial_steps: int = TRIAL_STEPS):
        self.engine = engine
        self.trial_steps = trial_steps
        self._references: dict = {}
        self._reference_trials: dict = {}

    def reference_pass(self, batch: int, input_scale: float | None) -> PassResult:
        key = (batch, input_scale)
        if key not in self._references:
            self._references[key] = self.engine.run_pass(
                Candidate(input_scale=input_scale).reference(), batch, 1.0)
        return self._references[key]

    def reference_trial(self, input_scale: float | None) -> list[float]:
        if input_scale not in self._reference_trials:
            self._reference_trials[input_scale] = self.engine.train(
                Candidate(input_scale=input_scale).reference(), self.trial_steps)
        return self._reference_trials[input_scale]

    def verify(self, candidate: Candidate, *, trial_after_failure: bool = True
               ) -> Verification:
        """Both checks (the module docstring). The trial also runs when the
        step check failed (its numbers are then shown too), unless
        `trial_after_failure` is False."""
        dtype = candidate_dtype(candidate, self.engine.run_policies)
        tolerances = TOLERANCES[dtype]
        steps: list[StepCheck] = []
        failure = None
        for batch in range(self.engine.batch_count):
            reference = self.reference_pass(batch, candidate.input_scale)
            if not _clean(reference):
                return Verification(False, (
                    "not verified: the step overflows in float32 too "
                    f"({describe(reference)}); no dtype policy fixes it: lower the "
                    "learning rate, clip, or normalise the inputs"),
                    dtype, tolerances, steps, None, candidate)
            check = self._step_check(candidate, batch, dtype, reference, tolerances)
            steps.append(check)
            if check.failed:
                failure = _step_failure(check, tolerances)
                break
        if failure is not None and not trial_after_failure:
            return Verification(False, f"not verified: {failure}", dtype, tolerances, steps,
                                None, candidate)
        # The trial starts at the scale the step check settled on: steps a
        # dynamic loss scale skips while it halves are not a precision fault.
        scale = min((c.loss_scale for c in steps), default=None) if dtype == "float16" \
            else None
        try:
            trial = self._trial(candidate, scale)
        except Exception as e:  # noqa: BLE001 - the candidate cannot train so
            note = f"the trial could not run ({type(e).__name__}: {str(e)[:200]})"
            reasons = [r for r in (failure, note) if r]
            return Verification(False, "not verified: " + "; ".join(reasons), dtype,
                                tolerances, steps, None, candidate, trial_note=note)
        if failure is not None:
            return Verification(False, f"not verified: {failure}; {trial.reason}", dtype,
                                tolerances, steps, trial, candidate)
        if not trial.passed:
            return Verification(False, f"not verified: {trial.reason}", dtype, tolerances,
                                steps, trial, candidate)
        return Verification(True, f"verified: {_step_success(steps, tolerances)}; "
                            f"{trial.reason}", dtype, tolerances, steps, trial, candidate)

    def _step_check(self, candidate, batch, dtype, reference, tolerances) -> StepCheck:
        scale = 1.0
        if dtype == "float16":
            scale = self.engine.loss_scale if self.engine.loss_scale > 1 else DEFAULT_LOSS_SCALE
        result = self.engine.run_pass(candidate, batch, scale)
        lowerings = 0
        while (scale > 1.0 and lowerings < MAX_SCALE_LOWERINGS and result.forward_clean
               and math.isfinite(result.loss) and not _finite_gradients(result)):
            scale = max(1.0, scale / LOSS_SCALE_STEP)
            lowerings += 1
            result = self.engine.run_pass(candidate, batch, scale)
        overflow = None if _clean(result) else describe(result)
        loss_error = _scalar_error(result.loss, reference.loss)
        carried = scale if result.gradient_scale is None else result.gradient_scale
        gradient_error, worst_gradient = _worst_gradient(
            {path: np.asarray(g, np.float64) / carried
             for path, g in result.gradients.items()},
            _unscaled(reference.gradients, reference.gradient_scale))
        output_error, worst_output = _worst_layer(result.forward, reference.forward)
        headroom = _headroom(result.forward,
                             effective_policies(candidate, self.engine.run_policies))
        # In the order the step computes them: an output's error makes the
        # loss's and the gradients'.
        failed = "overflow" if overflow else "headroom" if (
            headroom is not None and headroom["factor"] < HEADROOM_FACTOR) else next(
            (name for name, value in (("output", output_error), ("loss", loss_error),
                                      ("gradient", gradient_error))
             if not value <= tolerances[name]), None)
        return StepCheck(batch=batch, loss_scale=scale, overflow=overflow,
                         loss={"candidate": result.loss, "float32": reference.loss},
                         loss_rel_error=loss_error, gradient_rel_error=gradient_error,
                         worst_gradient=worst_gradient, output_rel_error=output_error,
                         worst_output=worst_output, failed=failed, headroom=headroom)

    def _trial(self, candidate: Candidate, loss_scale: float | None) -> Trial:
        reference = self.reference_trial(candidate.input_scale)
        losses = self.engine.train(candidate, self.trial_steps, loss_scale)
        return judge_trial(losses, reference, getattr(self.engine, "skipped_steps", 0))


def judge_trial(losses: list[float], reference: list[float], skipped: int = 0) -> Trial:
    """The trial's verdict from the two loss trajectories (see the module
    docstring); `skipped`: the steps the candidate's loss scale skipped."""
    steps = len(reference)
    tail = min(TRIAL_TAIL, steps)
    if not steps or not all(math.isfinite(v) for v in reference):
        return Trial(steps, list(losses), list(reference), math.nan, math.nan, None,
                     math.inf, False, "float32's own trial did not train (no update "
                     "applied, or its loss went non-finite): the trial cannot judge the fix",
                     skipped)
    if len(losses) < steps and all(math.isfinite(v) for v in losses):
        return Trial(steps, list(losses), list(reference), math.nan,
                     _decrease(reference, tail), None, math.inf, False,
                     f"in the trial the loss scale skipped {skipped} steps: only "
                     f"{len(losses)} of {steps} updates were applied", skipped)
    if not losses or not all(math.isfinite(v) for v in losses):
        bad = next((i for i, v in enumerate(losses) if not math.isfinite(v)), len(losses))
        before = (f" (loss {losses[0]:.4g} -> {losses[bad - 1]:.4g} before it, against "
                  f"float32's {reference[0]:.4g} -> {reference[min(bad, steps) - 1]:.4g})"
                  if bad > 1 else "")
        return Trial(steps, list(losses), list(reference), math.nan,
                     _decrease(reference, tail), None, math.inf, False,
                     f"in a {steps}-step trial the loss went non-finite at step {bad + 1}"
                     f"{before} while float32's stayed finite", skipped)
    reference_decrease = _decrease(reference, tail)
    decrease = _decrease(losses, tail)
    mean, reference_mean = float(np.mean(losses)), float(np.mean(reference))
    mean_diff = _scalar_error(mean, reference_mean)
    trajectory = (f"loss {losses[0]:.4g} -> {_tail_mean(losses, tail):.4g} against "
                  f"float32's {reference[0]:.4g} -> {_tail_mean(reference, tail):.4g}")
    if reference_decrease < TRIAL_FLAT * abs(reference[0]):
        # Closeness to a float32 run that does not learn says nothing of
        # whether the candidate trains.
        return Trial(steps, list(losses), list(reference), decrease, reference_decrease,
                     None, mean_diff, False,
                     f"float32 itself does not learn in the {steps}-step trial ({trajectory}; "
                     f"a decrease under {TRIAL_FLAT:.0%} of its first loss), so the trial "
                     "cannot show that this fix trains", skipped)
    progress = decrease / reference_decrease
    if progress < TRIAL_MIN_PROGRESS:
        how = ("the loss stays flat" if decrease < TRIAL_FLAT * abs(losses[0])
               else "the loss falls too little")
        return Trial(steps, list(losses), list(reference), decrease, reference_decrease,
                     progress, mean_diff, False,
                     f"in a {steps}-step trial {how} ({trajectory}): {progress:.0%} of "
                     f"float32's decrease (band: at least {TRIAL_MIN_PROGRESS:.0%})", skipped)
    if not mean_diff <= TRIAL_MEAN_BAND:
        return Trial(steps, list(losses), list(reference), decrease, reference_decrease,
                     progress, mean_diff, False,
                     f"in a {steps}-step trial the mean loss is {mean_diff:.1%} from "
                     f"float32's ({mean:.4g} against {reference_mean:.4g}; band "
                     f"{TRIAL_MEAN_BAND:.0%}; {trajectory})", skipped)
    return Trial(steps, list(losses), list(reference), decrease, reference_decrease,
                 progress, mean_diff, True,
                 f"trains like float32 for {steps} steps ({trajectory}; {progress:.0%} of "
                 f"float32's decrease, mean within {mean_diff:.1%}; band: at least "
                 f"{TRIAL_MIN_PROGRESS:.0%}, within {TRIAL_MEAN_BAND:.0%}"
                 f"{_skips(skipped)})", skipped)


def _skips(skipped: int) -> str:
    return (f"; {skipped} steps skipped by the loss scale while it halved, not counted"
            if skipped else "")


def _tail_mean(losses: list[float], tail: int) -> float:
    return float(np.mean(losses[-tail:]))


def _decrease(losses: list[float], tail: int) -> float:
    return float(losses[0] - _tail_mean(losses, tail)) if losses else math.nan


def _scalar_error(got: float, expected: float) -> float:
    if not math.isfinite(got):
        return math.inf
    if expected == 0.0:
        return 0.0 if got == 0.0 else math.inf
    return abs(got - expected) / abs(expected)


def _worst_gradient(values: Mapping, reference: Mapping) -> tuple[float, str | None]:
    """The largest relative error of a variable's gradient; a variable whose
    float32 gradient is under `GRADIENT_FLOOR` of the whole gradient's norm
    is judged against that share (see the constant)."""
    total = math.sqrt(sum(float(np.sum(np.square(np.asarray(r, np.float64))))
                          for r in reference.values()))
    worst, where = 0.0, None
    for key, expected in reference.items():
        if key not in values:
            continue
        error = relative_error(values[key], expected, GRADIENT_FLOOR * total)
        if where is None or error > worst:
            worst, where = error, str(key)
    return worst, where


def _worst_layer(forward: Mapping, reference: Mapping) -> tuple[float, str | None]:
    """The largest relative error of a layer's output over its calls."""
    worst, where = 0.0, None
    for key, expected in reference.items():
        if key not in forward or not np.all(np.isfinite(expected)):
            continue
        error = relative_error(forward[key], expected)
        if where is None or error > worst:
            worst, where = error, key[0] if isinstance(key, tuple) else str(key)
    return worst, where


def _headroom(forward: Mapping, policies: Mapping[str, str]) -> dict | None:
    """The half-precision layer whose largest finite output (over its calls)
    is closest to its dtype's max (`StepCheck.headroom`); None where no layer
    computes in a half dtype. A finite value past the dtype's max was not
    output in it (a layer returning float32 under a half policy): it is not
    judged."""
    tightest = None
    for key, values in forward.items():
        name = key[0] if isinstance(key, tuple) else str(key)
        dtype = policy_compute_dtype(policies.get(name))
        if dtype not in HALF_DTYPES:
            continue
        finite = np.abs(np.asarray(values, np.float64))
        finite = finite[np.isfinite(finite)]
        peak = float(finite.max()) if finite.size else 0.0
        if peak > DTYPE_MAX[dtype]:
            continue
        factor = DTYPE_MAX[dtype] / peak if peak > 0 else math.inf
        if tightest is None or factor < tightest["factor"]:
            tightest = {"layer": name, "dtype": dtype, "abs_max": peak, "factor": factor}
    return tightest


def _unscaled(gradients: Mapping, carried: float | None) -> dict:
    """The reference pass runs at scale 1: only a pass that says its
    gradients carry another factor is divided."""
    factor = 1.0 if carried is None else carried
    return {key: np.asarray(g, np.float64) / factor for key, g in gradients.items()}


def _finite_gradients(result: PassResult) -> bool:
    if result.gradients:
        return all(bool(np.all(np.isfinite(g))) for g in result.gradients.values())
    return result.gradients_finite


def _clean(result: PassResult) -> bool:
    return (result.forward_clean and math.isfinite(result.loss)
            and _finite_gradients(result))


def _step_failure(check: StepCheck, tolerances: dict) -> str:
    if check.failed == "overflow":
        return f"the captured step still overflows ({check.overflow})"
    if check.failed == "headroom":
        room = check.headroom
        return (f"the output of layer {room['layer']} reaches {room['abs_max']:.3g} in "
                f"{room['dtype']}, only {room['factor']:.3g}x under its max "
                f"{DTYPE_MAX[room['dtype']]:g} (at least "
                f"{HEADROOM_FACTOR:g}x required, MP004's headroom): with the weights a little "
                "grown it overflows again; the values are too large for the dtype (bound the "
                "inputs, or keep that layer in float32 too)")
    if check.failed == "loss":
        return (f"the loss is {check.loss_rel_error:.3g} from float32's "
                f"({check.loss['candidate']:.6g} against {check.loss['float32']:.6g}; "
                f"tolerance {tolerances['loss']:g})")
    if check.failed == "gradient":
        return (f"the unscaled gradient of {check.worst_gradient} is "
                f"{check.gradient_rel_error:.3g} from float32's (relative L2; tolerance "
                f"{tolerances['gradient']:g})")
    return (f"the output of layer {check.worst_output} is "
            f"{check.output_rel_error:.3g} from float32's (relative L2; tolerance "
            f"{tolerances['output']:g})")


def _step_success(steps: list[StepCheck], tolerances: dict) -> str:
    loss = max(s.loss_rel_error for s in steps)
    gradient = max(steps, key=lambda s: s.gradient_rel_error)
    output = max(steps, key=lambda s: s.output_rel_error)
    batches = f"{len(steps)} captured batches" if len(steps) > 1 else "the captured step"
    return (f"on {batches} no overflow, loss within {loss:.2g} of float32's (tolerance "
            f"{tolerances['loss']:g}), gradients within {gradient.gradient_rel_error:.2g} "
            f"(worst {gradient.worst_gradient}; tolerance {tolerances['gradient']:g}), "
            f"layer outputs within {output.output_rel_error:.2g} (worst "
            f"{output.worst_output}; tolerance {tolerances['output']:g}){_room(steps)}")


def _room(steps: list[StepCheck]) -> str:
    rooms = [s.headroom for s in steps if s.headroom]
    if not rooms:
        return ""
    room = min(rooms, key=lambda r: r["factor"])
    return (f", half-precision outputs {room['factor']:.3g}x under their max (tightest "
            f"{room['layer']}; at least {HEADROOM_FACTOR:g}x)")
