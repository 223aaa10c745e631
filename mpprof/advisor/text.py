"""The advice as terminal text (`mpprof advise LOGDIR`)."""

from __future__ import annotations

from mpprof.advisor.plan import ATTENTION_EVIDENCE, FLOAT8, FLOAT32, LOWER, attention_rows
from mpprof.terminal import printable


def _seconds(value: float | None) -> str:
    if value is None:
        return "n/a"
    if value >= 1e-3:
        return f"{value * 1e3:.3g} ms"
    return f"{value * 1e6:.3g} us"


def advice_lines(advice: dict) -> list[str]:
    """One run's advice, line by line, escaped for the terminal."""
    plan, projection = advice["plan"], advice["projection"]
    baseline = advice["baseline"]
    lines = [f"== run {advice['run']}: precision advice ==",
             f"  policy now: {plan['model_policy']}; float32 matmuls: "
             f"{baseline['float32_matmuls'].get('setting')} "
             f"(on {projection['gpu']}: {baseline['float32_runs_as'].upper()})"]
    lines += [f"  ! {note}" for note in advice["notes"]]
    if plan["nothing_to_change"]:
        lines.append("  nothing to change: the data support the current policies")
    sections = (
        ("must be float32", lambda r: r["planned"] == FLOAT32 and r["action"] == FLOAT32),
        ("stay float32 (the data show why)",
         lambda r: r["planned"] == FLOAT32 and r["now"] == FLOAT32),
        (f"can go lower (-> {plan['half_dtype']})", lambda r: r["action"] == LOWER),
        ("float8 candidates (model.quantize)", lambda r: r["action"] == FLOAT8),
    )
    sensitivity = {f["name"]: f.get("sensitivity") for f in advice["facts"]}
    for title, chosen in sections:
        rows = [r for r in plan["rows"] if chosen(r)]
        if not rows:
            continue
        lines.append(f"  {title}:")
        for row in rows:
            lines.append(f"    {row['layer']} ({row['cls']}, {row['now']} -> {row['planned']})")
            # An attention layer's sizing has its own section below.
            lines += [f"      - {reason}" for reason in row["reasons"]
                      if not reason.startswith(ATTENTION_EVIDENCE)]
            replayed = sensitivity.get(row["layer"]) or {}
            errors = [f"{dtype} output {e['output']:.2g}, gradient {e['gradient']:.2g}"
                      for dtype, e in replayed.items()
                      if e and e.get("output") is not None and e.get("gradient") is not None]
            if errors:
                lines.append(f"      - replayed against float32: {'; '.join(errors)}")
            rounding = replayed.get("float8") or {}
            if rounding.get("input") is not None and rounding.get("gradient") is not None:
                lines.append(f"      - float8 rounding on the float32 pass: input (e4m3) "
                             f"{rounding['input']:.2g}, gradient (e5m2) "
                             f"{rounding['gradient']:.2g}")
    attention = attention_rows(plan)
    if attention:
        lines.append("  attention (sized from the recorded shapes):")
        lines += [f"    {row['layer']} ({row['cls']}): {evidence}" for row, evidence in attention]
    if not plan["nothing_to_change"]:
        lines.append("  code:")
        lines += [f"    {line}" for line in plan["code"].splitlines()]
    lines.append(f"  projection on {projection['gpu_full_name']} (a projection, not a "
                 "measurement; docs/advisor.md):")
    speedup = projection.get("gemm_speedup")
    lines.append(
        f"    GEMMs + casts per step: {_seconds(projection['gemm_seconds_now'])} now -> "
        f"{_seconds(projection['gemm_seconds_plan'])} with the plan"
        + (f" ({speedup:.2f}x)" if speedup else ""))
    if projection.get("step_speedup"):
        lines.append(f"    whole step (Amdahl, the GEMMs' share from "
                     f"{projection['amdahl_detail']}): {projection['step_speedup']:.2f}x")
    elif projection.get("step_note"):
        lines.append(f"    {projection['step_note']}")
    slower = [t["layer"] for t in projection["layers"] if t.get("float8_pays") is False]
    if slower:
        lines.append(f"    float8 is projected slower than {plan['half_dtype']} at these shapes "
                     f"on {projection['gpu']} (its casts cost more than the GEMM saves): "
                     f"{', '.join(slower)}")
    if projection["unsized_layers"]:
        lines.append(f"    not sized (no sampled element counts): "
                     f"{', '.join(projection['unsized_layers'])}")
    verification = advice.get("verification") or {}
    lines.append(f"  verification: {verification.get('detail', 'unverified')}")
    if verification.get("batch_steps"):
        lines.append(f"    (on the run's batches of steps {verification['batch_steps']}, "
                     f"from the weights of step {verification['weights_step']})")
    for row in (verification.get("on_overflowed_steps") or {}).get("steps", []):
        lines.append(f"  the batch of step {row['step']}, which overflowed in the run: with the "
                     f"plan {row['plan']}; with the current policy {row['current']}")
    current = verification.get("current") or {}
    if current.get("verified_detail") and not advice["plan"]["nothing_to_change"]:
        lines.append(f"  the current policy on the same batches: {current['verified_detail']}")
    return [printable(line) for line in lines]
