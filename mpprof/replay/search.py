"""The framework-free half of a replay: what a pass saw, float16 against
float32 per layer, and the greedy float32 map (`find_fix`, verified by
`mpprof.replay.verification`), given a way to run one pass (each backend's engine brings its own:
`mpprof.backends.tensorflow.replay_engine`, `mpprof.backends.jax.replay_engine`).

Layers are whatever the engine's layer tree holds: only their
`dtype_policy.compute_dtype`, `name`, `path` and class name are read.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from mpprof import dtypes

# Where ops outside any layer run: the loss and its gradient, and inside the
# model but between its layers.
LOSS = "(loss)"
BETWEEN_LAYERS = "(between layers)"

# Replays a fix search may run at most (each is one forward and backward).
MAX_FIX_REPLAYS = 24


@dataclasses.dataclass
class Offender:
    """The first op whose output is non-finite or beyond its dtype's max.

    Attributes:
        layer: the innermost layer running it (qualified name), or `LOSS`.
        op: the op's type (TensorFlow: `MatMul`, `Exp`, ...; JAX: the
            primitive, `dot_general`, `exp`, ...).
        phase: "forward" or "backward".
        input_abs_max: each floating input's largest magnitude (None when
            that input holds no finite value).
        output: what is wrong with its output, in words.
        dtype: the output's dtype.
    """

    layer: str
    op: str
    phase: str
    input_abs_max: list
    output: str
    dtype: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class PassResult:
    """What one pass saw.

    Attributes:
        forward: (layer, call index) -> its first floating output, float64.
        backward: (layer, call index) -> the gradient flowing into that output.
        offender: the first offending forward op, else the first backward one.
        forward_clean: whether no forward op (loss included) offended.
        loss: the (unscaled) loss.
        gradients_finite: whether every variable's gradient is finite.
        gradients: variable path (or the optimizer's order, for a custom
            step) -> its gradient, as computed.
        gradient_scale: what `gradients` are multiplied by (None: the
            pass's loss scale; 1.0: already unscaled).
    """

    forward: dict
    backward: dict
    offender: Offender | None
    forward_clean: bool
    loss: float
    gradients_finite: bool
    gradients: dict = dataclasses.field(default_factory=dict)
    gradient_scale: float | None = None


def subtree(tree: dict[str, object], name: str) -> list[str]:
    """`name` and every layer nested in it."""
    return [n for n in tree if n == name or n.startswith(name + "/")]


def problem(values: np.ndarray, dtype_name: str) -> str | None:
    """What is wrong with an op's (floating) output, or None."""
    if values.size == 0:
        return None
    values = values.astype(np.float64)
    nan = int(np.isnan(values).sum())
    inf = int(np.isinf(values).sum())
    if nan or inf:
        return f"{inf} inf and {nan} NaN of {values.size} values"
    limit = dtypes.DTYPE_MAX.get(dtype_name)
    peak = float(np.abs(values).max())
    if limit is not None and peak > limit:
        return f"abs max {peak:.6g} beyond {dtype_name}'s {limit:.6g}"
    return None


def abs_max(values: np.ndarray) -> float | None:
    """The largest finite magnitude (None: no finite value)."""
    values = np.abs(np.asarray(values).astype(np.float64))
    finite = values[np.isfinite(values)]
    return float(finite.max()) if finite.size else None


def divergence(run_policy: PassResult, reference: PassResult, tree: dict) -> list[dict]:
    """Per layer computing in a half dtype: how far its output and incoming
    gradient are from float32's, largest first."""
    rows = []
    for name, layer in tree.items():
        if layer.dtype_policy.compute_dtype not in dtypes.HALF_DTYPES:
            continue
        forward = _layer_error(run_policy.forward, reference.forward, name)
        backward = _layer_error(run_policy.backward, reference.backward, name)
        if forward is None and backward is None:
            continue
        rows.append({"layer": name, "compute_dtype": layer.dtype_policy.compute_dtype,
                     "forward_rel_error": forward, "backward_rel_error": backward})
    rows.sort(key=_rank_key, reverse=True)
    return rows


def _rank_key(row: dict) -> tuple[float, float]:
    """The larger of the two errors; between equals (non-finite gradients
    reach every layer below an overflow) the forward error, which marks
    where it began."""
    forward = row["forward_rel_error"] or 0.0
    errors = [e for e in (row["forward_rel_error"], row["backward_rel_error"]) if e is not None]
    return max(errors, default=0.0), forward


def _layer_error(run_values: dict, reference_values: dict, name: str) -> float | None:
    """The largest relative error over the layer's calls (inf where the run
    is non-finite and float32 is not; None where float32 is non-finite too)."""
    errors = []
    for key, expected in reference_values.items():
        if key[0] != name or key not in run_values:
            continue
        got = run_values[key]
        if got.shape != expected.shape or not np.all(np.isfinite(expected)):
            continue
        if not np.all(np.isfinite(got)):
            errors.append(math.inf)
            continue
        norm = float(np.linalg.norm(expected))
        difference = float(np.linalg.norm(got - expected))
        errors.append(difference / norm if norm else (0.0 if difference == 0 else math.inf))
    return max(errors) if errors else None


def find_fix(run_unscaled: Callable[[list[str] | None], PassResult], scale: float,
             run_policy: PassResult, reference: PassResult, divergence: list[dict],
             tree: dict, paths: dict[str, str], verify: Callable[[list[str]], object]) -> dict:
    """The greedy float32 set, then verified by `verify`.

    `run_unscaled(float32_layers)` replays the step without loss scaling
    with those layers (each with its sublayers) in float32 (None: the run's
    policies), and raises when the model cannot run so. The search stops at
    the first set whose replay is finite; `verify(float32_layers)` (a
    `mpprof.replay.verification.Verification` of that map: tolerances to
    float32 and a short trial) then says whether it is a fix.

    The fix is judged without loss scaling: gradients that overflow only once
    multiplied by the step's loss scale are what the dynamic loss scale
    handles itself (it halves), not a per-layer precision problem.
    """
    if not reference.forward_clean:
        where = reference.offender
        return _fix_result([], tree, paths, False, (
            "not verified: the step overflows in float32 too "
            f"({where.op} in {where.layer}: {where.output}); no per-layer float32 "
            "policy fixes it: lower the learning rate, clip, or normalise the inputs"), None)
    unscaled = run_policy if scale == 1.0 else run_unscaled(None)
    if _healthy(unscaled):
        return _fix_result([], tree, paths, False, (
            "not verified: with the run's policy the forward pass, the loss and the "
            "unscaled gradients are finite; only the gradients scaled by the loss scale "
            f"{scale:g} overflow, which the dynamic loss scale handles by halving (no "
            "per-layer change needed)" if scale != 1.0 else
            "not verified: this replay of the step has no overflow (the capture's weights "
            "may differ from the step's, see weights_are_the_steps)"), None)
    candidates = _candidates(run_policy, divergence, tree)
    chosen: list[str] = []
    replays = 0
    last = unscaled
    for candidate in candidates:
        if replays >= MAX_FIX_REPLAYS:
            break
        while (candidate is not None and candidate not in chosen
               and replays < MAX_FIX_REPLAYS):
            outcome = _try_pass(run_unscaled, [*chosen, candidate])
            replays += 1
            if outcome is not None:
                # A parent tried whole covers the sublayers chosen before it.
                chosen = [*(c for c in chosen if not c.startswith(f"{candidate}/")), candidate]
                last = outcome
                break
            # The layer cannot compute in float32 alone (its parent mixes
            # its output with half-precision values): try the parent whole.
            candidate = _parent(candidate, tree)
        if _healthy(last):
            break
    if not _healthy(last):
        return _fix_result(chosen, tree, paths, False, (
            f"not verified: with {len(chosen)} layers in float32 the replay still "
            f"overflows ({describe(last)})"), None)
    # The layers added before the last one may no longer be needed: drop
    # them, latest first (the first offender's layer is tried last).
    for candidate in reversed(chosen[:-1]):
        if replays >= MAX_FIX_REPLAYS:
            break
        trial = [c for c in chosen if c != candidate]
        outcome = _try_pass(run_unscaled, trial)
        replays += 1
        if outcome is not None and _healthy(outcome):
            chosen, last = trial, outcome
    error = _max_forward_error(last, reference)
    verification = verify(chosen)
    return _fix_result(chosen, tree, paths, verification.verified, verification.detail,
                       error, verification.to_dict())


def _try_pass(run_unscaled, float32_layers: list[str]) -> PassResult | None:
    """The step replayed unscaled with `float32_layers` in float32, or None
    when the model cannot run so (a layer in float32 whose output meets a
    half-precision tensor inside its parent: a dtype error)."""
    try:
        return run_unscaled(float32_layers)
    except Exception:  # noqa: BLE001 - that map is not a fix; others are tried
        return None


def _parent(name: str, tree: dict) -> str | None:
    """The qualified name of the layer enclosing `name`, if any."""
    parent = name.rpartition("/")[0]
    return parent if parent in tree else None


def _candidates(run_policy: PassResult, divergence: list[dict], tree: dict) -> list[str]:
    """Layers to try in float32: the first offender's, then by divergence."""
    order = []
    offender = run_policy.offender
    if offender is not None and offender.layer != LOSS:
        order.append(offender.layer)
    order += [row["layer"] for row in divergence]
    order += [name for name, layer in tree.items()
              if layer.dtype_policy.compute_dtype in dtypes.HALF_DTYPES]
    return list(dict.fromkeys(order))


def _healthy(result: PassResult) -> bool:
    return (result.forward_clean and math.isfinite(result.loss)
            and result.gradients_finite)


def describe(result: PassResult) -> str:
    """A pass's fault in words: its offending op, else the non-finite loss or
    gradients."""
    if result.offender is not None:
        o = result.offender
        return f"{o.phase} {o.op} in {o.layer}: {o.output}"
    return "non-finite loss" if not math.isfinite(result.loss) else "non-finite gradients"


def _max_forward_error(result: PassResult, reference: PassResult) -> float:
    names = {key[0] for key in reference.forward}
    errors = [_layer_error(result.forward, reference.forward, n) for n in names]
    return max((e for e in errors if e is not None), default=0.0)


def _fix_result(chosen: list[str], tree: dict, paths: dict[str, str], verified: bool,
                detail: str, error: float | None, verification: dict | None = None) -> dict:
    """The fix as a DTypePolicyMap (layer path in the trained model -> policy,
    each chosen layer with its sublayers) and as `dtype="float32"` lines."""
    policy_map = {}
    for name in chosen:
        for inner in subtree(tree, name):
            path = paths.get(inner) or getattr(tree[inner], "path", None) or inner
            policy_map[path] = "float32"
    lines = [
        f'{name}: {type(tree[name]).__name__}(..., name="{tree[name].name}", dtype="float32")'
        for name in chosen
    ]
    return {"float32_layers": chosen, "policy_map": policy_map, "dtype_lines": lines,
            "verified": verified, "verified_detail": detail,
            "max_rel_error_with_fix": error, "verification": verification}
