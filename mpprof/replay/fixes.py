"""A replay's fixes, lead first, each verified (`mpprof.replay.verification`).

Two kinds:

- `bound_inputs`: a model input holds values past the run's half dtype's
  max (`mpprof.replay.input_bounds`): the inputs are scaled into range. When
  it applies it is the lead fix; the float32 map is then an alternative.
- `float32_layers`: the greedy per-layer float32 map
  (`mpprof.replay.search.find_fix`).

The result keeps the map's keys (`float32_layers`, `policy_map`,
`dtype_lines`) and adds `fixes` (each fix with its own `verified`,
`verified_detail` and `verification`), `lead_fix`, and the lead fix's
`verified`, `verified_detail`, `verification`, `tolerances` and `trial`.
Framework-free.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mpprof.replay import input_bounds, search
from mpprof.replay.search import PassResult
from mpprof.replay.verification import Candidate, Verifier, policy_compute_dtype

MAP = "float32_layers"
BOUND_INPUTS = "bound_inputs"


def find_fixes(*, verifier: Verifier, run_unscaled: Callable[[list[str] | None], PassResult],
               scale: float, run_policy: PassResult, reference: PassResult,
               divergence: list[dict], tree: dict, paths: dict[str, str],
               inputs: list[np.ndarray], backend: str | None,
               keras_flavor: str | None = None) -> dict:
    """Every fix that applies, verified, lead first (see the module docstring).

    Args:
        verifier: the engine's verifier.
        run_unscaled, scale, run_policy, reference, divergence, tree, paths:
            as `mpprof.replay.search.find_fix`.
        inputs: the captured batch's model inputs (x), flattened.
        backend, keras_flavor: the run's, for the code shown.
    """
    map_fix = search.find_fix(
        run_unscaled, scale, run_policy, reference, divergence, tree, paths,
        lambda chosen: verifier.verify(Candidate(
            layer_policies=dict.fromkeys(chosen, "float32"),
            label=f"{', '.join(chosen)} in float32")))
    map_entry = {"kind": MAP, "float32_layers": map_fix["float32_layers"],
                 "policy_map": map_fix["policy_map"], "dtype_lines": map_fix["dtype_lines"],
                 "verified": map_fix["verified"], "verified_detail": map_fix["verified_detail"],
                 "verification": map_fix["verification"]}
    fixes = [map_entry] if map_fix["float32_layers"] else []
    half = _run_half_dtype(tree)
    offending = (input_bounds.past_range(input_bounds.observe(inputs), half)
                 if half is not None else [])
    lead = None
    if offending:
        first = run_policy.offender.to_dict() if run_policy.offender else None
        lead = input_bounds.bound_inputs_fix(offending, half, backend, keras_flavor, first)
        verification = verifier.verify(Candidate(input_scale=lead["scale"],
                                                 label=f"inputs times {lead['scale_text']}"))
        lead.update(verified=verification.verified, verified_detail=verification.detail,
                    verification=verification.to_dict())
        fixes.insert(0, lead)
    chosen = fixes[0] if fixes else map_entry
    verification = chosen.get("verification") or {}
    return {
        **map_fix,
        "fixes": fixes,
        "lead_fix": chosen["kind"] if fixes else None,
        "verified": chosen["verified"],
        "verified_detail": chosen["verified_detail"],
        "verification": verification or None,
        "tolerances": ({"dtype": verification.get("dtype"), **verification["tolerances"]}
                       if verification else None),
        "trial": verification.get("trial") if verification else None,
    }


def _run_half_dtype(tree: dict) -> str | None:
    """float16 when any layer of the run computes in it, else bfloat16 when
    any does, else None."""
    computed = {policy_compute_dtype(layer.dtype_policy.name) for layer in tree.values()}
    return next((d for d in ("float16", "bfloat16") if d in computed), None)
