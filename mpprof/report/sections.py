"""The HTML of the report: the summary of every run and each run's section
(context, findings, what could not be checked, inventory, plot placeholders).

Everything a user controls (layer, variable and run names, file contents)
goes through `escape`.
"""

from __future__ import annotations

import html
import json

from mpprof import diagnosis
from mpprof.display.run_summary import cut_short_text
from mpprof.records import reader
from mpprof.replay import text as replay_text
from mpprof.report import advice
from mpprof.terminal import printable

# Findings per run listed in the summary at the top (the rest: a link).
MAX_SUMMARY_FINDINGS = 3
# Tables longer than this start folded (a 200-layer inventory would bury the
# plots below it).
MAX_OPEN_TABLE_ROWS = 40


def escape(value) -> str:
    """`value` as HTML text (None as nothing), control and bidi-override
    characters written as escapes (as the terminal shows them): U+202E would
    reverse a run name on the page."""
    return html.escape("" if value is None else printable(value))


def escape_block(text: str) -> str:
    """`text` as the HTML of a `<pre>` block: its line breaks kept, every other
    control character escaped as `escape` does (`escape` would write each
    newline as a literal `\\n`)."""
    return "\n".join(escape(line) for line in str(text).split("\n"))


def run_section(index: int, run: reader.Run, result: diagnosis.Diagnosis, data: dict,
                replays: list[dict] = ()) -> str:
    parts = [f'<section class="run" id="run-{index}"><h2>Run {escape(run.name)}</h2>']
    if run.warnings:
        items = "".join(f"<li>{escape(w)}</li>" for w in run.warnings)
        parts.append(
            f'<div class="warnings"><b>Could not read everything:</b><ul>{items}</ul></div>'
        )
    if not run.readable:
        parts.append('<div class="warnings"><b>Nothing readable:</b> no record of this '
                     "run could be read (see the warnings above).</div>")
    if run.cut_short is not None:
        # The CLI's words: one reading of how a run stopped in every front end.
        parts.append(f'<div class="warnings"><b>Cut short:</b> {escape(cut_short_text(run))}.'
                     "</div>")
    parts.append(_context_html(run))
    parts.append(_findings_html(index, result))
    parts.append(_replays_html(replays))
    parts.append(advice.advice_html(run))
    parts.append(_inventory_html(run.inventory, run.context))
    parts.append("<h3>Loss scale</h3>")
    if "loss_scale" in data:
        parts.append(f'<div class="plot" data-kind="loss_scale" data-run="{index}"></div>')
    else:
        parts.append(
            "<p class=muted>No dynamic loss scale was recorded (the optimizer "
            "is not a LossScaleOptimizer).</p>"
        )
    parts.append("<h3>Per-layer numerics</h3>")
    if "numerics" in data:
        for key in data["numerics"]["maps"]:
            parts.append(
                f'<div class="plot heatmap" data-kind="numerics" '
                f'data-map="{key}" data-run="{index}"></div>'
            )
    else:
        parts.append(
            "<p class=muted>Not recorded: pass numerics_every=N to "
            "mpprof.MixedPrecisionProfiler to sample per-layer activations "
            "and gradients.</p>"
        )
    parts.append(_gpu_html(run, data, index))
    if "float8" in data:
        parts.append(_float8_html(run, data["float8"], index))
    parts.append("</section>")
    return "\n".join(parts)


def _context_html(run: reader.Run) -> str:
    context = run.context
    if not context:
        return "<h3>Run context</h3><p class=muted>No run context was recorded.</p>"
    loss_scale = context.collector("loss_scale")
    rows = [
        ("model policy", context.model_policy),
        ("global policy", context.global_policy),
        ("optimizer", context.optimizer),
        ("loss scale", ", ".join(f"{k}={v}" for k, v in loss_scale.items())),
        ("jit_compile", context.jit_compile),
        ("steps_per_execution", context.steps_per_execution),
        ("strategy", context.strategy),
        ("devices", ", ".join(str(d.get("name")) for d in context.devices)),
        ("GPUs visible to the framework", context.gpus_visible),
        ("hardware", context.hardware),
        ("float32 matmuls", (context.float32_matmuls or {}).get("setting")),
        ("versions", context.versions),
        ("host", context.host),
    ]
    loss = run.loss_scale
    if loss is not None:
        rows.append(
            (
                "loss scale run",
                f"{loss.initial_scale:g} -> {loss.final_scale:g}"
                f" over {loss.steps_run - loss.first_step} steps; "
                f"{loss.skipped_steps} overflows, {len(loss.growths)} growths",
            )
        )
    if run.health:
        rows.append(("health", run.health))
    body = "".join(
        f"<tr><th>{escape(k)}</th><td>{_value_html(v)}</td></tr>" for k, v in rows if v is not None
    )
    return f'<h3>Run context</h3><table class="context">{body}</table>'


def _value_html(value) -> str:
    """A context value: dicts as nested key/value tables, lists one per line."""
    if value is None or value == [] or value == "":
        return "<span class=muted>none</span>"
    if isinstance(value, dict):
        if not value:
            return "<span class=muted>none</span>"
        rows = "".join(
            f"<tr><th>{escape(k)}</th><td>{_value_html(v)}</td></tr>" for k, v in value.items()
        )
        return f'<table class="nested">{rows}</table>'
    if isinstance(value, list):
        if all(not isinstance(v, (dict, list)) for v in value):
            return escape(", ".join(str(v) for v in value))
        return "".join(f"<div>{_value_html(v)}</div>" for v in value)
    return escape(value)


def summary_html(diagnosed: list[tuple[reader.Run, diagnosis.Diagnosis]]) -> str:
    """Every run in one table, most severe first: counts, worst findings, links."""
    rows = []
    for index, (run, result) in enumerate(diagnosed):
        counts = "".join(
            f'<span class="badge {s}">{n} {s}</span>'
            for s in diagnosis.SEVERITIES
            if (n := sum(f.severity == s for f in result.findings))
        ) or '<span class="ok">no findings</span>'
        worst = "".join(
            f'<li><a href="#run-{index}-finding-{i}"><span class="code">{escape(f.code)}</span> '
            f"{escape(f.title)}</a></li>"
            for i, f in enumerate(result.findings[:MAX_SUMMARY_FINDINGS])
        )
        more = len(result.findings) - MAX_SUMMARY_FINDINGS
        if more > 0:
            worst += f'<li><a href="#run-{index}-findings">{more} more</a></li>'
        policy = run.context.model_policy
        rows.append(
            f'<tr><td><a href="#run-{index}">{escape(run.name)}</a></td><td>{escape(policy)}</td>'
            f"<td>{counts}</td><td><ul>{worst}</ul></td></tr>"
        )
    return (
        '<section class="summary"><h2>Summary</h2><table class="summary-table">'
        "<tr><th>run</th><th>policy</th><th>findings</th><th>worst findings</th></tr>"
        f'{"".join(rows)}</table></section>'
    )


def _findings_html(index: int, result: diagnosis.Diagnosis) -> str:
    parts = [f'<h3 id="run-{index}-findings">Findings ({len(result.findings)})</h3>']
    if not result.findings:
        parts.append("<p>No findings.</p>")
    for number, finding in enumerate(result.findings):
        item = finding.to_dict()
        where = []
        if finding.layer is not None:
            where.append(f"layer <code>{escape(finding.layer)}</code>")
        if finding.step is not None:
            where.append(f"step {finding.step}")
        parts.append(
            f'<div class="finding {escape(finding.severity)}" id="run-{index}-finding-{number}">'
            f'<div class="head"><span class="sev">{escape(finding.severity)}</span> '
            f'<span class="code">{escape(finding.code)}</span> {escape(finding.title)}</div>'
            f'<div class="where">{" · ".join(where)}{_view_link(index, finding)}</div>'
            f"<details><summary>evidence</summary><pre>"
            f"{escape_block(json.dumps(item['evidence'], indent=1))}</pre></details>"
            f'<div class="fix"><b>Fix</b><pre>{escape_block(finding.fix)}</pre></div></div>'
        )
    unchecked = [c for c in result.checks if c.status != "checked"]
    if unchecked:
        items = "".join(
            f"<li><b>{escape(c.code)}</b> {escape(c.status)}: {escape(c.reason)}</li>"
            for c in unchecked
        )
        parts.append(
            f'<div class="muted not-checked">Not checked ({len(unchecked)}):<ul>{items}</ul></div>'
        )
    return "\n".join(parts)


def _replays_html(replays: list[dict]) -> str:
    """Each replay of a captured step: the op, the ranking, the verified map."""
    if not replays:
        return ""
    parts = [f"<h3>Replays of captured steps ({len(replays)})</h3>"]
    for result in replays:
        state = "verified" if result.get("verified") else "not verified"
        parts.append(
            f'<div class="replay {state.replace(" ", "-")}"><b>'
            f"{escape(replay_text.headline(result))}</b>"
            f"<pre>{escape_block(chr(10).join(replay_text.result_lines(result)))}</pre></div>"
        )
    return "\n".join(parts)


_INVENTORY_COLUMNS = (
    ("name", "layer"),
    ("class", "class"),
    ("policy", "policy"),
    ("compute_dtype", "compute"),
    ("variable_dtype", "variables"),
    ("output_dtypes", "outputs"),
    ("params", "params"),
    ("gemm_dims", "GEMM dims"),
    ("tensor_core_friendly", "Tensor Core friendly"),
    ("float32_island", "float32 island"),
)


def _inventory_html(inventory: dict | None, context) -> str:
    if not inventory:
        reason = diagnosis.inventory_missing_reason(context)
        return f"<h3>Precision inventory</h3><p class=muted>{escape(reason)}.</p>"
    model = inventory.get("model", {})
    head = "".join(f"<th>{escape(title)}</th>" for _, title in _INVENTORY_COLUMNS)
    rows = []
    for layer in inventory.get("layers", []):
        cells = []
        for key, _ in _INVENTORY_COLUMNS:
            value = layer.get(key)
            if isinstance(value, list):
                value = ", ".join(str(v) for v in value)
            cells.append(f"<td>{escape(value)}</td>")
        classes = []
        if not layer.get("is_leaf"):
            classes.append("container")
        if layer.get("float32_island"):
            classes.append("island")
        if layer.get("misaligned_dims"):
            classes.append("misaligned")
        rows.append(f'<tr class="{" ".join(classes)}">{"".join(cells)}</tr>')
    casts = inventory.get("casts", [])
    cast_rows = "".join(
        f"<tr><td>{escape(c.get('from_layer') or 'input')}</td>"
        f"<td>{escape(c.get('layer'))}</td>"
        f"<td>{escape(c.get('from_dtype'))} &rarr; {escape(c.get('to_dtype'))}</td></tr>"
        for c in casts
    )
    table = (
        f'<div class="scroll"><table class="inventory"><tr>{head}</tr>{"".join(rows)}</table></div>'
    )
    if len(rows) > MAX_OPEN_TABLE_ROWS:
        table = f"<details><summary>{len(rows)} layers</summary>{table}</details>"
    cast_table = (
        f'<table class="casts"><tr><th>from</th><th>into</th><th>cast</th></tr>{cast_rows}</table>'
    )
    if len(casts) > MAX_OPEN_TABLE_ROWS:
        cast_table = f"<details><summary>{len(casts)} casts</summary>{cast_table}</details>"
    return (
        f"<h3>Precision inventory</h3><p>Model <code>{escape(model.get('name'))}</code> "
        f"({escape(model.get('class'))}), policy {escape(model.get('policy'))}, output "
        f"{escape(', '.join(model.get('output_dtypes', [])))}, {escape(model.get('params'))} "
        f"parameters.</p>{table}"
        f"<h4>Casts between layers ({len(casts)})</h4>"
        + (cast_table if casts else "<p class=muted>None.</p>")
    )


# Findings whose evidence a section of the report draws: view -> anchor suffix.
_VIEW_SECTIONS = {"float8": "float8"}


def _view_link(index: int, finding) -> str:
    """A link to the report section that draws the finding's evidence, if any."""
    section = _VIEW_SECTIONS.get(finding.view)
    if section is None:
        return ""
    separator = " · " if finding.layer is not None or finding.step is not None else ""
    link = f'<a class="view-link" href="#run-{index}-{section}">see the {section} view</a>'
    return separator + link


def _float8_html(run: reader.Run, data: dict, index: int) -> str:
    float8 = run.float8
    policies = ", ".join(sorted(set(float8.policies)))
    parts = [
        f'<h3 id="run-{index}-float8">Float8</h3>',
        f"<p>{len(float8.layers)} float8 layers ({escape(policies)}). Keras quantizes "
        "x / scale, the scale set from the amax history up to two steps before "
        "(delayed scaling).</p>",
    ]
    if data["steps"]:
        for share in data["maps"]:
            parts.append(f'<div class="plot heatmap" data-kind="float8_share" '
                         f'data-map="{escape(share)}" data-run="{index}"></div>')
    else:
        parts.append("<p class=muted>Saturation and underflow shares not measured: no step "
                     "was sampled (numerics_every=None, or the run is shorter).</p>")
    if data["layers_total"] > len(data["layers"]):
        parts.append(f"<p class=muted>Scales and amax of the first {len(data['layers'])} of "
                     f"{data['layers_total']} float8 layers.</p>")
    for tensor in data["tensors"]:
        parts.append(f'<div class="plot" data-kind="float8_scale" '
                     f'data-tensor="{escape(tensor)}" data-run="{index}"></div>')
    return "\n".join(parts)


def _gpu_html(run: reader.Run, data: dict, index: int) -> str:
    gpu = run.gpu
    parts = ["<h3>GPU</h3>"]
    if gpu is None:
        parts.append("<p class=muted>No GPU data was recorded.</p>")
        return "\n".join(parts)
    parts.append(f"<p>Sampler mode: {escape(gpu.mode)}</p>")
    for track in range(len(data.get("gpu", []))):
        parts.append(
            f'<div class="plot gpu" data-kind="gpu" data-track="{track}" data-run="{index}"></div>'
        )
    if gpu.kernels:
        parts.append(f"<h4>Kernels</h4>{_value_html(gpu.kernels)}")
    return "\n".join(parts)
