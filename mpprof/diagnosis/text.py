"""Findings as text for a terminal; the judge (`evaluate`) knows nothing of it."""

from __future__ import annotations

import json

from mpprof.diagnosis.core import SEVERITIES, Diagnosis, Finding
from mpprof.terminal import printable


def exceeds(findings: list[Finding], fail_on: str | None) -> bool:
    """Whether any finding is at least as severe as `fail_on` (None: never)."""
    if fail_on is None:
        return False
    limit = SEVERITIES.index(fail_on)
    return any(SEVERITIES.index(f.severity) <= limit for f in findings)


_COLORS = {"critical": "\033[1;31m", "warning": "\033[1;33m", "info": "\033[1;36m"}
_BOLD, _DIM, _RESET = "\033[1m", "\033[2m", "\033[0m"


def format_text(run, result: Diagnosis, *, color: bool = False,
                notes: dict[str, list[str]] | None = None) -> str:
    """`result` as text for a terminal: grouped by severity, the fix beneath.

    Args:
        run: the `mpprof.records.reader.Run` that was diagnosed (for its name,
            context and read warnings).
        result: what `evaluate(run)` returned.
        color: use ANSI colours (for a terminal).
        notes: lines to print under each finding of a code (already escaped:
            a replay of the step, say).
    """

    def paint(text: str, style: str) -> str:
        return f"{style}{text}{_RESET}" if color else text

    lines = [paint(f"== run {printable(run.name)} ==", _BOLD) + _run_line(run)]
    lines += [f"  ! {printable(w)}" for w in run.warnings]
    for severity in SEVERITIES:
        group = [f for f in result.findings if f.severity == severity]
        if not group:
            continue
        lines.append(paint(f"{severity.upper()} ({len(group)})", _COLORS[severity]))
        for finding in group:
            code = paint(finding.code, _COLORS[severity])
            lines.append(f"  {code}  {printable(finding.title)}")
            where = []
            if finding.layer is not None:
                where.append(f"layer {printable(finding.layer)}")
            if finding.step is not None:
                where.append(f"step {finding.step}")
            if where:
                lines.append(f"         {', '.join(where)}")
            lines.append(paint(f"         evidence: {_evidence_text(finding)}", _DIM))
            lines.append("         fix:")
            fix_lines = finding.fix.splitlines()
            lines += [f"           {printable(line)}" for line in fix_lines]
            lines += (notes or {}).get(finding.code, [])
    if not result.findings:
        lines.append("No findings.")
    # Rules that lack the same data say so once, e.g. the four numerics rules.
    reasons: dict[str, list[str]] = {}
    for check in result.not_measured:
        reasons.setdefault(check.reason, []).append(check.code)
    for reason, codes in reasons.items():
        lines.append(paint(f"  not measured: {', '.join(codes)}: {printable(reason)}", _DIM))
    counts = [
        f"{sum(f.severity == s for f in result.findings)} {s}" for s in SEVERITIES
    ]
    lines.append(", ".join(counts))
    return "\n".join(lines)


def _run_line(run) -> str:
    context = run.context
    optimizers = context.optimizers
    if isinstance(optimizers, list) and optimizers:
        used = ", ".join(
            f"{o.get('name')} {o.get('class')}" if o.get("name") != "optimizer"
            else str(o.get("class"))
            for o in optimizers if isinstance(o, dict)
        )
    else:
        used = context.optimizer
    parts = [context.model_policy, used]
    loss_scale = run.loss_scale
    if loss_scale is not None:
        steps = loss_scale.steps_run - loss_scale.first_step
        parts.append(f"{steps} steps, {loss_scale.skipped_steps} skipped")
    else:
        # No loss scale to count steps and skips by: the last health check's.
        health = getattr(run, "health", None)
        if isinstance(health, dict) and isinstance(health.get("checked_step"), int):
            parts.append(f"{health['checked_step']} steps")
    parts = [printable(str(p)) for p in parts if p]
    return f"  ({', '.join(parts)})" if parts else ""


def _evidence_text(finding: Finding, limit: int = 300) -> str:
    items = []
    for key, value in finding.to_dict()["evidence"].items():
        if isinstance(value, float):
            value = f"{value:.4g}"
        elif not isinstance(value, (int, str)):
            value = json.dumps(value, separators=(",", ":"))
        items.append(f"{key}={value}")
    text = printable(", ".join(items))
    return text if len(text) <= limit else text[: limit - 3] + "..."
