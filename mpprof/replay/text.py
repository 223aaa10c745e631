"""A replay result as lines of text, for `mpprof replay` and `mpprof diagnose`.

Every value comes from files a logdir holds (layer names, op names): each
line is escaped with `mpprof.terminal.printable`. Needs no TensorFlow.
"""

from __future__ import annotations

import json

from mpprof.terminal import printable

# Layers of the float16-vs-float32 ranking shown (the JSON holds them all).
RANKING_SHOWN = 5

# The findings a replay bears on: forward overflow, non-finite loss,
# gradient underflow. `mpprof diagnose` and the report show it under them.
FINDING_CODES = ("MP003", "MP012", "MP005")


def replay_for(code: str, results: list[dict]) -> dict | None:
    """The replay shown under a finding of `code`: the run's first, for the
    codes a replay bears on; else None."""
    return results[0] if code in FINDING_CODES and results else None


def headline(result: dict) -> str:
    """One line: the first offending op and the lead fix, verified or not."""
    first = result.get("first_op")
    where = (f"{first.get('op')} in {first.get('layer')} ({first.get('phase')})"
             if isinstance(first, dict) else "no op overflowed in the replay")
    lead = _lead(result)
    if lead is not None and lead.get("kind") == "bound_inputs":
        fix = f"bound the inputs (times {lead.get('scale_text')})"
    else:
        layers = result.get("float32_layers") or []
        fix = (f"keep {', '.join(map(str, layers))} in float32" if layers
               else "no per-layer fix")
    state = "verified" if result.get("verified") else "not verified"
    return printable(f"replay of step {result.get('step')}: {where}; {fix} ({state})")


def result_lines(result: dict, indent: str = "") -> list[str]:
    """The whole result: the op, the ranking, each fix and its verification."""
    lines = [f"replay of run {result.get('run')}, step {result.get('step')}: "
             f"{'; '.join(map(str, result.get('capture_reasons') or []))}"]
    first = result.get("first_op")
    if isinstance(first, dict):
        inputs = ", ".join(_number(v) for v in first.get("input_abs_max") or [])
        lines.append(
            f"  first op: {first.get('op')} in layer {first.get('layer')} "
            f"({first.get('phase')}, {first.get('dtype')}): {first.get('output')}; "
            f"its inputs' abs max: {inputs or 'none'}"
        )
    else:
        lines.append("  first op: none overflowed in the replay")
    ranking = result.get("divergence") or []
    if ranking:
        lines.append("  float16 vs float32, relative error (largest first):")
        for row in ranking[:RANKING_SHOWN]:
            lines.append(
                f"    {row.get('layer')}: forward {_number(row.get('forward_rel_error'))}, "
                f"incoming gradient {_number(row.get('backward_rel_error'))}"
            )
        if len(ranking) > RANKING_SHOWN:
            lines.append(f"    ... {len(ranking) - RANKING_SHOWN} more (--format json)")
    lead = _lead(result)
    policy_map = result.get("policy_map") or {}
    if lead is not None and lead.get("kind") == "bound_inputs":
        lines.append(f"  fix: {lead.get('why')}:")
        lines += [f"      {line}" for line in lead.get("code") or []]
        lines.append(f"    {lead.get('verified_detail')}")
        if policy_map:
            alternative = next((f for f in result.get("fixes") or []
                                if f.get("kind") == "float32_layers"), {})
            lines.append("  alternative: keep these layers in float32, as a keras.dtype_"
                         f"policies.DTypePolicyMap: {json.dumps(policy_map)}")
            lines.append(f"    {alternative.get('verified_detail')}")
    else:
        if policy_map:
            lines.append("  fix: keep these layers in float32, as a keras.dtype_policies."
                         f"DTypePolicyMap: {json.dumps(policy_map)}")
            lines.append("    or, where the layers are made:")
            lines += [f"      {line}" for line in result.get("dtype_lines") or []]
        lines.append(f"  {result.get('verified_detail')}")
    criteria = criteria_line(result)
    if criteria:
        lines.append(f"  {criteria}")
    return [printable(indent + line) for line in lines]


def criteria_line(result: dict) -> str | None:
    """What "verified" was judged by: the tolerances and the trial's band
    (None for a result saved before they existed, or with no fix judged)."""
    tolerances = result.get("tolerances")
    verification = result.get("verification") or {}
    band = verification.get("trial_band")
    if not isinstance(tolerances, dict) or not isinstance(band, dict):
        return None
    return (f"verified means: relative error to float32 at most {_number(tolerances.get('loss'))}"
            f" for the loss, {_number(tolerances.get('gradient'))} for each variable's "
            f"gradient and {_number(tolerances.get('output'))} for each layer's output "
            f"({tolerances.get('dtype')} tolerances), no overflow"
            f"{_headroom(tolerances.get('headroom'))}; and in a "
            f"{band.get('steps')}-step trial from the captured weights, at least "
            f"{_percent(band.get('min_progress'))} of float32's loss decrease and a mean loss "
            f"within {_percent(band.get('mean_band'))} of float32's")


def _headroom(factor) -> str:
    """The headroom clause (absent from results saved before it existed)."""
    if not isinstance(factor, (int, float)) or isinstance(factor, bool):
        return ""
    return f", every half-precision layer's output at least {factor:g}x under its dtype's max"


def _percent(value) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:.0%}"
    return str(value)


def _lead(result: dict) -> dict | None:
    fixes = result.get("fixes")
    return fixes[0] if isinstance(fixes, list) and fixes and isinstance(fixes[0], dict) \
        else None


def _number(value) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:.3g}"
    return str(value)
