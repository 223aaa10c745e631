"""The report's precision-advice section: the plan in three parts, each
layer's evidence, the code, the projection with its assumptions and what
verification there is (`mpprof.advisor`). Everything from the run is
escaped."""

from __future__ import annotations

import html

from mpprof.advisor import advise_run, saved_verification
from mpprof.advisor.plan import attention_rows
from mpprof.records import reader

_ACTIONS = {"float32": "must be float32", "lower": "can go lower", "float8": "float8 candidate",
            "keep": "no change"}


def advice_html(run: reader.Run) -> str:
    """The section for one read run (no replay: the verification is the one
    `mpprof advise --verify` saved, else says what verifying needs)."""
    if not run.inventory:
        return ""
    advice = advise_run(run)
    plan, projection = advice["plan"], advice["projection"]
    escape = html.escape
    parts = ["<h3>Precision advice</h3>"]
    parts += [f'<p class="muted">{escape(note)}</p>' for note in advice["notes"]]
    if plan["nothing_to_change"]:
        parts.append("<p><b>Nothing to change:</b> the data support the current policies.</p>")
    rows = [r for r in plan["rows"] if r["action"] != "keep" or r["planned"] == "float32"]
    if rows:
        parts.append('<table class="advice"><tr><th>layer</th><th>class</th><th>now</th>'
                     "<th>plan</th><th>why (evidence)</th></tr>")
        for row in rows:
            parts.append(
                f'<tr class="advice-{escape(row["action"])}"><td>{escape(row["layer"])}</td>'
                f"<td>{escape(row['cls'])}</td><td>{escape(row['now'])}</td>"
                f"<td>{escape(row['planned'])} ({escape(_ACTIONS[row['action']])})</td>"
                f"<td>{escape('; '.join(row['reasons']))}</td></tr>")
        parts.append("</table>")
    attention = attention_rows(plan)
    if attention:
        parts.append("<p><b>Attention</b> (sized from the recorded shapes):</p><ul>")
        parts += [f"<li>{escape(row['layer'])} ({escape(row['cls'])}): {escape(evidence)}</li>"
                  for row, evidence in attention]
        parts.append("</ul>")
    if not plan["nothing_to_change"]:
        parts.append(f"<pre>{escape(plan['code'])}</pre>")
    speedup = projection.get("gemm_speedup")
    parts.append(
        f"<p><b>Projection</b> on {escape(projection['gpu_full_name'])} (float32 as "
        f"{escape(projection['float32_runs_as'].upper())}): GEMMs and casts "
        f"{projection['gemm_seconds_now'] * 1e6:.3g} us now, "
        f"{projection['gemm_seconds_plan'] * 1e6:.3g} us with the plan"
        + (f" ({speedup:.2f}x)" if speedup else "")
        + (f"; the whole step {projection['step_speedup']:.2f}x (Amdahl, the GEMMs' share "
           f"from {escape(projection['amdahl_detail'])})" if projection.get("step_speedup")
           else "")
        + ". A roofline projection (78% of peak compute, 92% of peak bandwidth), not a "
        "measurement: <code>mpprof advise LOGDIR --gpu NAME</code> for another GPU.</p>")
    verification = saved_verification(run.path)
    parts.append(f'<p class="advice-{escape(verification["state"].replace(" ", "-"))}">'
                 f"<b>Verification:</b> {escape(verification['detail'])}</p>")
    return "\n".join(parts)
