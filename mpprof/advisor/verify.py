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

from mpprof.advisor.plan import FLOAT8, FLOAT32
from mpprof.backends import replay_engines
from mpprof.replay import files
from mpprof.replay.verification import Candidate, Verifier


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


def verify(logdir, run: str, plan: dict, captures: list[files.Capture]) -> dict:
    """Verifies the plan and the current policy; marks the plan's rows.

    Returns:
        `{"state": "verified"|"not verified"|"failed", "detail", "batches",
        "weights_step", "plan": Verification dict, "current": ..., "seconds"}`.
    """
    started = time.perf_counter()
    try:
        engine = replay_engines.advise_engine(captures)
    except (files.ReplayError, files.NoCaptureError) as e:
        return {"state": "failed", "batches": len(captures),
                "detail": f"unverified: the kept batches cannot be replayed ({e})"}
    verifier = Verifier(engine)
    try:
        planned = verifier.verify(plan_candidate(plan))
        current = verifier.verify(Candidate(label="the current policy"))
    except Exception as e:  # noqa: BLE001 - a model the engine cannot run: said, not raised
        return {"state": "failed", "batches": len(captures),
                "detail": (f"unverified: the replay of the kept batches failed "
                           f"({type(e).__name__}: {str(e)[:300]})")}
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
        "weights_step": captures[-1].step,
        "plan": planned.to_dict(),
        "current": current.to_dict(),
        "seconds": time.perf_counter() - started,
    }
