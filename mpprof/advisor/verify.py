"""The plan verified on the run's own batches (`mpprof advise --verify`).

The same meaning of "verified" as a replay fix's (`mpprof.replay.verification`:
the step check against float32 on each kept batch, then the trial), applied
to the plan as one candidate, and to the current policy for comparison. The
batches are those `advise_batches=N` kept across the run; the weights are
those of the last of them. The engine is the one of the backend that trained
the run (`mpprof.backends.replay_engines.advise_engine`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from mpprof.advisor.facts import FLOAT8_GRADIENT_FORMAT, FLOAT8_INPUT_FORMAT
from mpprof.advisor.plan import FLOAT8, FLOAT32
from mpprof.backends import replay_engines
from mpprof.dtypes import FLOAT8_RANGES
from mpprof.replay import files
from mpprof.replay.verification import (
    DEFAULT_LOSS_SCALE,
    Candidate,
    Verifier,
    relative_error,
)


def _policy(dtype: str, half: str) -> str:
    if dtype == FLOAT8:
        dtype = half
    return FLOAT32 if dtype == FLOAT32 else f"mixed_{dtype}"


def plan_candidate(plan: dict) -> Candidate:
    """The plan as a verification candidate (float8 layers in their half
    dtype: Keras' float8 custom gradients do not run op by op)."""
    half = plan["half_dtype"]
    if plan["model_policy"] != plan["default_policy"]:
        # A float32 run going mixed: the plan's default, its float32 layers named.
        return Candidate(
            layer_policies={r["layer"]: FLOAT32 for r in plan["rows"]
                            if r["planned"] == FLOAT32},
            default_policy=plan["default_policy"], label="the advisor's plan")
    return Candidate(
        layer_policies={r["layer"]: _policy(r["planned"], half) for r in plan["rows"]
                        if r["action"] != "keep"},
        label="the advisor's plan")


def verify(logdir, run: str, plan: dict, captures: list[files.Capture],
           wrong: Sequence[files.Capture] = (), producers: dict | None = None) -> dict:
    """Verifies the plan and the current policy; marks the plan's rows.

    Args:
        producers: float8-eligible layer -> the layer its input comes from
            (the facts'), for their float8 rounding.
        captures: the kept (advise) batches; the weights are the last one's.
        wrong: replay captures of steps that went wrong: their batches are
            checked too (from the same weights).

    Returns:
        `{"state": "verified"|"not verified"|"failed", "detail", "batches",
        "weights_step", "plan": Verification dict, "current": ..., "seconds"}`.
    """
    started = time.perf_counter()
    try:
        model, scale = replay_engines.advise_model(captures)
        engine = replay_engines.verification_engine(model, [c.batch() for c in captures],
                                                    scale)
    except (files.ReplayError, files.NoCaptureError) as e:
        return {"state": "failed", "batches": len(captures),
                "detail": f"unverified: the kept batches cannot be replayed ({e})"}
    verifier = Verifier(engine)
    try:
        planned = verifier.verify(plan_candidate(plan))
        current = (planned if plan["nothing_to_change"]
                   else verifier.verify(Candidate(label="the current policy")))
    except Exception as e:  # noqa: BLE001 - a model the engine cannot run: said, not raised
        return {"state": "failed", "batches": len(captures),
                "detail": (f"unverified: the replay of the kept batches failed "
                           f"({type(e).__name__}: {str(e)[:300]})")}
    try:
        sensitivity = layer_sensitivity(engine, verifier, _float8_inputs(plan, producers))
    except Exception as e:  # noqa: BLE001 - the verdict stands without it
        sensitivity = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    try:
        on_overflowed = _on_overflowed(model, scale, plan_candidate(plan), wrong)
    except Exception as e:  # noqa: BLE001 - the verdict stands without it
        on_overflowed = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    float8 = [r["layer"] for r in plan["rows"] if r["action"] == FLOAT8]
    for row in plan["rows"]:
        if row["action"] != "keep":
            row["verified"] = planned.verified
    detail = planned.detail
    if float8:
        detail += (f" (float8 layers {', '.join(float8)} verified in "
                   f"{plan['half_dtype']}: their float8 quantization is not replayed)")
    return {
        "state": "verified" if planned.verified else "not verified",
        "detail": detail,
        "batches": len(captures),
        "batch_steps": [c.step for c in captures],
        "on_overflowed_steps": on_overflowed,
        "weights_step": captures[-1].step,
        "plan": planned.to_dict(),
        "current": current.to_dict(),
        "sensitivity": sensitivity,
        "seconds": time.perf_counter() - started,
    }


def _on_overflowed(model, scale: float, candidate: Candidate,
                   wrong: Sequence[files.Capture]) -> dict | None:
    """The batches of the steps that went wrong (replay captures), run from
    the same weights with the plan and with the current policy: whether each
    overflows. They are not in the verification (an outlier batch, such as
    inputs in the wrong units, is the data's fault, not a policy's: see
    `mpprof replay`'s input-bound fix), but the plan must not overflow on them
    where the current policy did."""
    if not wrong:
        return None
    engine = replay_engines.verification_engine(model, [c.batch() for c in wrong], scale)
    rows = []
    for index, capture in enumerate(wrong):
        row: dict[str, object] = {"step": capture.step}
        for label, tried in (("plan", candidate), ("current", Candidate())):
            result = engine.run_pass(tried, index, scale)
            clean = (result.forward_clean and np.isfinite(result.loss)
                     and result.gradients_finite)
            row[label] = "clean" if clean else (
                f"overflows ({result.offender.phase} {result.offender.op} in "
                f"{result.offender.layer})" if result.offender else "non-finite")
        rows.append(row)
    return {"steps": rows,
            "plan_clean": all(r["plan"] == "clean" for r in rows),
            "current_clean": all(r["current"] == "clean" for r in rows)}


def _float8_inputs(plan: dict, producers: dict | None) -> dict[str, str]:
    """The float8-eligible layers of the plan's rows with one known producer."""
    layers = {r["layer"] for r in plan["rows"]}
    return {layer: producer for layer, producer in (producers or {}).items()
            if layer in layers and producer}


def layer_sensitivity(engine, verifier: Verifier, float8_inputs: dict[str, str] | None = None,
                      batch: int = 0) -> dict:
    """Per layer, the relative error of its output and of the gradient flowing
    into it with the whole model in float16 and in bfloat16, against the
    verifier's float32 pass, on one kept batch (the first after the
    overflowed ones; float16 at the run's loss scale, its gradients
    unscaled, as it would train). Float8 is not replayed op by op (Keras'
    float8 gradients are custom): for each layer of `float8_inputs` (layer ->
    its producer), the error float8 rounding puts on its GEMM's operands on
    the float32 pass instead (`float8_rounding`).
    `{"float16": {layer: {"output", "gradient"}}, "bfloat16": {...},
    "float8": {layer: {"input", "gradient"}}}`."""
    reference = verifier.reference_pass(batch, None)
    found = {}
    for dtype in ("float16", "bfloat16"):
        scale = 1.0
        if dtype == "float16":
            scale = engine.loss_scale if engine.loss_scale > 1 else DEFAULT_LOSS_SCALE
        lowered = engine.run_pass(Candidate(default_policy=f"mixed_{dtype}"), batch, scale)
        found[dtype] = {
            layer: {"output": _worst(lowered.forward, reference.forward, layer),
                    "gradient": _worst(lowered.backward, reference.backward, layer, scale)}
            for layer in sorted({key[0] for key in reference.forward})
        }
    if float8_inputs:
        found["float8"] = {
            layer: {"input": _first_rounding(reference.forward, producer, FLOAT8_INPUT_FORMAT),
                    "gradient": _first_rounding(reference.backward, layer,
                                                FLOAT8_GRADIENT_FORMAT)}
            for layer, producer in sorted(float8_inputs.items())}
    return found


def float8_rounding(values, fmt: str) -> float | None:
    """The relative error (`relative_error`) of `values` rounded to the float8
    format `fmt` at amax scaling (x * max / amax, Keras' float8 scaling with
    the tensor's own amax: delayed scaling's best case); None for a tensor
    of zeros or with non-finite values."""
    import ml_dtypes  # with the framework: only --verify runs this

    values = np.asarray(values, np.float64)
    amax = float(np.max(np.abs(values))) if values.size else 0.0
    if amax == 0.0 or not np.isfinite(amax):
        return None
    scale = FLOAT8_RANGES[fmt].max / amax
    rounded = (values * scale).astype(getattr(ml_dtypes, fmt)).astype(np.float64) / scale
    return relative_error(rounded, values)


def _first_rounding(values: dict, layer: str, fmt: str) -> float | None:
    """`float8_rounding` of the layer's first call's tensor in `values`."""
    key = min((k for k in values if k[0] == layer), default=None)
    return None if key is None else float8_rounding(values[key], fmt)


def _worst(values: dict, reference: dict, layer: str, scale: float = 1.0) -> float | None:
    """The largest relative error over the layer's calls (None: not seen);
    `values` divided by `scale` first."""
    errors = [relative_error(np.asarray(values[key], np.float64) / scale, expected)
              for key, expected in reference.items() if key[0] == layer and key in values]
    return max(errors) if errors else None
