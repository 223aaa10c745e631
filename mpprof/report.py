"""One self-contained, offline HTML report of a logdir's mpprof runs.

`mpprof report LOGDIR -o report.html` writes it: a summary of every run
(most severe first, its worst findings linked), then per run its context,
findings and what could not be checked, the precision inventory, the
loss-scale timeline with overflow markers, per-layer numerics heatmaps
(layer x step, the dashboard's headroom measure and colours) and GPU tracks
when recorded. It follows the reader's light or dark colour scheme and
prints cleanly.
plotly.js is embedded from the installed `plotly` package, so the file opens
without a network and can be attached to a bug report.

Everything a user controls (layer, variable and run names, file contents) is
escaped: HTML text through `html.escape`, plot labels as HTML entities
(plotly renders its labels as markup), and the embedded JSON with `</`
escaped so it cannot close its <script> element.

Large runs are downsampled to what a screen can show, so a million-step run
still makes a report of a few megabytes.
"""

from __future__ import annotations

import datetime
import html
import json
import os
import pathlib
from collections.abc import Callable

import numpy as np

import mpprof
from mpprof import diagnosis, downsample, headroom, reader
from mpprof.jsonsafe import json_floats

# A plot is at most ~2,000 pixels wide: more points than this per line (the
# loss-scale step function is kept as min/max per bucket) cannot be seen.
MAX_TIMELINE_POINTS = 4_000
# Overflow/growth markers drawn one by one; beyond this, one marker per
# bucket of steps, its hover text saying how many it stands for.
MAX_EVENT_MARKERS = 2_000
# Numerics heatmap columns (sampled steps); consecutive samples are merged
# keeping the worst value, so an overflow never disappears.
MAX_HEATMAP_STEPS = 300
# Findings per run listed in the summary at the top (the rest: a link).
MAX_SUMMARY_FINDINGS = 3
# Tables longer than this start folded (a 200-layer inventory would bury the
# plots below it).
MAX_OPEN_TABLE_ROWS = 40
# GPU samples per line.
MAX_GPU_POINTS = 2_000
# GPU sample columns drawn as tracks (those present with any finite value).
GPU_TRACKS = (
    ("tensor_util", "Tensor Core activity (%)"),
    ("sm_util", "SM activity (%)"),
    ("gpu_util", "GPU utilisation (%)"),
    ("mem_util", "memory bandwidth utilisation (%)"),
    ("power_w", "power (W)"),
)

Progress = Callable[[str], None]


def write_report(
    logdir: str | os.PathLike,
    output: str | os.PathLike,
    *,
    run: str | None = None,
    progress: Progress | None = None,
) -> str:
    """Writes the HTML report of `logdir` (or only its run `run`) to `output`.

    Args:
        logdir: the log_dir given to `mpprof.MixedPrecisionProfiler`.
        output: the HTML file to write (its directory is created).
        run: only this run, by name (as `mpprof summary` names it).
        progress: called with a line of text at each stage (large logdirs
            take a while).

    Returns:
        The path written.

    Raises:
        reader.LogdirNotFoundError, reader.NoMpprofDataError: as the reader.
    """
    page = build_report(logdir, run=run, progress=progress)
    path = pathlib.Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return str(path)


def build_report(
    logdir: str | os.PathLike,
    *,
    run: str | None = None,
    progress: Progress | None = None,
) -> str:
    """The report of `logdir` as one HTML string (see `write_report`)."""
    say = progress or (lambda message: None)
    names = reader.list_runs(logdir)
    if run is not None:
        if run not in names:
            raise reader.NoMpprofDataError(
                f"No mpprof run {run!r} in {os.fspath(logdir)}; its runs: "
                f"{', '.join(names) or 'none'}"
            )
        names = [run]
    if not names:
        reader.read_logdir(logdir)  # raises NoMpprofDataError with its advice
    diagnosed = []
    for index, name in enumerate(names):
        say(f"reading run {name} ({index + 1}/{len(names)})")
        read = reader.read_run(logdir, name)
        say(f"diagnosing run {name}")
        diagnosed.append((read, diagnosis.evaluate(read)))
    # Most severe first (the listing's order on a tie), as the dashboard.
    diagnosed.sort(key=lambda item: _severity_key(item[1]))
    sections, data = [], []
    for index, (read, result) in enumerate(diagnosed):
        say(f"drawing run {read.name}")
        run_data = _run_data(read)
        sections.append(_run_section(index, read, result, run_data))
        data.append(run_data)
    say("embedding plotly.js")
    return _page(os.fspath(logdir), _summary_html(diagnosed), sections, data)


def _severity_key(result: diagnosis.Diagnosis) -> list[int]:
    """Sorts runs with more critical, then warning, then info findings first."""
    return [-sum(f.severity == s for f in result.findings) for s in diagnosis.SEVERITIES]


# ----------------------------------------------------------------- the data


def _run_data(run: reader.Run) -> dict:
    """What the plots of one run need, downsampled and JSON-ready."""
    data: dict = {"name": _label(run.name)}
    if run.loss_scale is not None:
        data["loss_scale"] = _loss_scale_data(run.loss_scale)
    numerics = run.numerics
    if numerics is not None and len(numerics.steps) and len(numerics.layers):
        data["numerics"] = _numerics_data(run)
    if run.gpu is not None:
        tracks = _gpu_data(run.gpu)
        if tracks:
            data["gpu"] = tracks
    return data


def _loss_scale_data(loss_scale: reader.LossScale) -> dict:
    steps, scales = loss_scale.series()
    kept = downsample.envelope(steps, scales, MAX_TIMELINE_POINTS)
    overflows = loss_scale.overflows
    growths = loss_scale.growths
    return {
        "steps": steps[kept].tolist(),
        "scales": json_floats(scales[kept]),
        "overflows": _markers(overflows[:, 0], overflows[:, 1]),
        "growths": _markers(growths[:, 0], growths[:, 2]),
        "overflow_count": len(overflows),
        "growth_count": len(growths),
    }


def _markers(steps: np.ndarray, scales: np.ndarray) -> dict:
    """Marker positions; beyond MAX_EVENT_MARKERS one per bucket, with counts."""
    steps = steps.astype(np.int64)
    if len(steps) <= MAX_EVENT_MARKERS:
        return {"steps": steps.tolist(), "scales": json_floats(scales), "counts": None}
    edges = np.linspace(steps.min(), steps.max() + 1, MAX_EVENT_MARKERS + 1)
    bucket = np.clip(np.searchsorted(edges, steps, side="right") - 1, 0, MAX_EVENT_MARKERS - 1)
    used, first, counts = np.unique(bucket, return_index=True, return_counts=True)
    peak = np.full(MAX_EVENT_MARKERS, -np.inf)
    np.maximum.at(peak, bucket, scales)
    return {
        "steps": steps[first].tolist(),
        "scales": json_floats(peak[used]),
        "counts": counts.tolist(),
    }


def _numerics_data(run: reader.Run) -> dict:
    """The heatmaps (layer x merged samples) and their overflow markers."""
    numerics = run.numerics
    steps = np.asarray(numerics.steps, dtype=np.int64)
    # Consecutive samples merged into columns; each keeps its worst value.
    starts = downsample.group_starts(len(steps), MAX_HEATMAP_STEPS)
    forward_max = np.asarray(numerics.forward["abs_max"], dtype=np.float64)
    backward_max = np.asarray(numerics.backward["abs_max"], dtype=np.float64)
    # Overflowed or not: the diagnosis decides, by each layer's own dtype.
    forward_overflowed = diagnosis.forward_overflow_mask(run)
    bits = headroom.headroom_bits(numerics.policy_max, forward_max, forward_overflowed)
    maps = {
        # The worst (least) headroom of the samples a column merges.
        "forward_headroom": json_floats(-_worst_per_column(-bits, starts), decimals=2),
        "backward_log10_abs_max": _log10_map(backward_max, starts),
        "forward_nonfinite_frac": json_floats(
            _worst_per_column(numerics.forward["nonfinite_frac"], starts), decimals=3
        ),
        "backward_underflow_frac": json_floats(
            _worst_per_column(numerics.backward["underflow_frac"], starts), decimals=3
        ),
    }
    overflow = {
        "forward": _overflow_cells(forward_overflowed, starts),
        "backward": _overflow_cells(diagnosis.backward_overflow_mask(run), starts),
    }
    return {
        "layers": [_label(name) for name in numerics.layers],
        "steps": steps[starts].tolist(),
        **headroom.dtype_fields(numerics.policy_max),
        "maps": maps,
        "overflow": overflow,
        "forensic_steps": steps[np.asarray(numerics.forensic, dtype=bool)].tolist()[
            :MAX_EVENT_MARKERS
        ],
    }


def _worst_per_column(values, starts: np.ndarray) -> np.ndarray:
    """[samples, layers] values as [layers, columns], each column the max of
    the samples it merges (NaN ignored)."""
    values = np.asarray(values, dtype=np.float64).T
    return downsample.pool_max(values, np.arange(len(values)), starts)


def _log10_map(abs_max: np.ndarray, starts: np.ndarray) -> list:
    with np.errstate(all="ignore"):
        finite = np.where(np.isfinite(abs_max) & (abs_max > 0), abs_max, np.nan)
        return json_floats(np.log10(_worst_per_column(finite, starts)), decimals=2)


def _overflow_cells(overflowed: np.ndarray, starts: np.ndarray) -> dict:
    """(layer, column) cells where any merged sample overflowed, for markers
    over a heatmap."""
    merged = np.logical_or.reduceat(np.asarray(overflowed, dtype=bool), starts, axis=0).T
    layer, column = np.nonzero(merged)
    keep = slice(0, MAX_EVENT_MARKERS)
    return {"layer": layer[keep].tolist(), "column": column[keep].tolist()}


def _gpu_data(gpu: reader.Gpu) -> list[dict]:
    """One track per recorded GPU_TRACKS column, a line per device (bucket
    means over time), x in seconds since the first sample."""
    tracks_by_device = downsample.device_tracks(gpu.samples, MAX_GPU_POINTS)
    if not tracks_by_device:
        return []
    with np.errstate(all="ignore"):
        start = np.nanmin([np.nanmin(t["wall_time"]) for t in tracks_by_device.values()])
    tracks = []
    for column, title in GPU_TRACKS:
        if not any(np.isfinite(t[column]).any() for t in tracks_by_device.values()):
            continue
        lines = [
            {
                "name": f"GPU {device}",
                "x": json_floats(track["wall_time"] - start, decimals=2),
                "y": json_floats(track[column], decimals=2),
            }
            for device, track in tracks_by_device.items()
        ]
        tracks.append({"title": title, "lines": lines})
    return tracks


def _label(text) -> str:
    """`text` for a plotly label: plotly renders labels as markup, so escape it."""
    return html.escape(str(text), quote=False)


# ------------------------------------------------------------------ the HTML


def _e(value) -> str:
    return html.escape("" if value is None else str(value))


def _run_section(index: int, run: reader.Run, result: diagnosis.Diagnosis, data: dict) -> str:
    parts = [f'<section class="run" id="run-{index}"><h2>Run {_e(run.name)}</h2>']
    if run.warnings:
        items = "".join(f"<li>{_e(w)}</li>" for w in run.warnings)
        parts.append(
            f'<div class="warnings"><b>Could not read everything:</b><ul>{items}</ul></div>'
        )
    if not run.readable:
        parts.append('<div class="warnings"><b>Nothing readable:</b> no record of this '
                     "run could be read (see the warnings above).</div>")
    stopped = run.cut_short
    if stopped is not None:
        parts.append(
            f'<div class="warnings"><b>Cut short:</b> the fit never recorded its end '
            f'(fit_state {_e(stopped["fit_state"])}); its records stop at step '
            f'{int(stopped["step"])}.</div>'
        )
    parts.append(_context_html(run))
    parts.append(_findings_html(index, result))
    parts.append(_inventory_html(run.inventory))
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
    parts.append("</section>")
    return "\n".join(parts)


def _context_html(run: reader.Run) -> str:
    context = run.context
    if not context:
        return "<h3>Run context</h3><p class=muted>No run context was recorded.</p>"
    loss_scale = context.get("collectors", {}).get("loss_scale", {})
    rows = [
        ("model policy", context.get("model_policy")),
        ("global policy", context.get("global_policy")),
        ("optimizer", context.get("optimizer")),
        ("loss scale", ", ".join(f"{k}={v}" for k, v in loss_scale.items())),
        ("jit_compile", context.get("jit_compile")),
        ("steps_per_execution", context.get("steps_per_execution")),
        (
            "strategy",
            f"{context.get('distribution_strategy')} x{context.get('num_replicas')}",
        ),
        ("devices", ", ".join(str(d.get("name")) for d in context.get("devices", []))),
        ("GPUs visible to TensorFlow", context.get("gpus_visible_to_tensorflow")),
        ("hardware", context.get("hardware")),
        (
            "versions",
            f"TensorFlow {context.get('tensorflow_version')}, Keras "
            f"{context.get('keras_version')}, mpprof "
            f"{context.get('mpprof_version')}, Python "
            f"{context.get('python_version')}",
        ),
        ("host", context.get("host")),
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
        f"<tr><th>{_e(k)}</th><td>{_value_html(v)}</td></tr>" for k, v in rows if v is not None
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
            f"<tr><th>{_e(k)}</th><td>{_value_html(v)}</td></tr>" for k, v in value.items()
        )
        return f'<table class="nested">{rows}</table>'
    if isinstance(value, list):
        if all(not isinstance(v, (dict, list)) for v in value):
            return _e(", ".join(str(v) for v in value))
        return "".join(f"<div>{_value_html(v)}</div>" for v in value)
    return _e(value)


def _summary_html(diagnosed: list[tuple[reader.Run, diagnosis.Diagnosis]]) -> str:
    """Every run in one table, most severe first: counts, worst findings, links."""
    rows = []
    for index, (run, result) in enumerate(diagnosed):
        counts = "".join(
            f'<span class="badge {s}">{n} {s}</span>'
            for s in diagnosis.SEVERITIES
            if (n := sum(f.severity == s for f in result.findings))
        ) or '<span class="ok">no findings</span>'
        worst = "".join(
            f'<li><a href="#run-{index}-finding-{i}"><span class="code">{_e(f.code)}</span> '
            f"{_e(f.title)}</a></li>"
            for i, f in enumerate(result.findings[:MAX_SUMMARY_FINDINGS])
        )
        more = len(result.findings) - MAX_SUMMARY_FINDINGS
        if more > 0:
            worst += f'<li><a href="#run-{index}-findings">{more} more</a></li>'
        policy = (run.context or {}).get("model_policy")
        rows.append(
            f'<tr><td><a href="#run-{index}">{_e(run.name)}</a></td><td>{_e(policy)}</td>'
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
            where.append(f"layer <code>{_e(finding.layer)}</code>")
        if finding.step is not None:
            where.append(f"step {finding.step}")
        parts.append(
            f'<div class="finding {_e(finding.severity)}" id="run-{index}-finding-{number}">'
            f'<div class="head"><span class="sev">{_e(finding.severity)}</span> '
            f'<span class="code">{_e(finding.code)}</span> {_e(finding.title)}</div>'
            f'<div class="where">{" · ".join(where)}</div>'
            f"<details><summary>evidence</summary><pre>"
            f"{_e(json.dumps(item['evidence'], indent=1))}</pre></details>"
            f'<div class="fix"><b>Fix</b><pre>{_e(finding.fix)}</pre></div></div>'
        )
    unchecked = [c for c in result.checks if c.status != "checked"]
    if unchecked:
        items = "".join(
            f"<li><b>{_e(c.code)}</b> {_e(c.status)}: {_e(c.reason)}</li>" for c in unchecked
        )
        parts.append(
            f'<div class="muted not-checked">Not checked ({len(unchecked)}):<ul>{items}</ul></div>'
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


def _inventory_html(inventory: dict | None) -> str:
    if not inventory:
        return (
            "<h3>Precision inventory</h3><p class=muted>Not recorded (the train "
            "step never traced).</p>"
        )
    model = inventory.get("model", {})
    head = "".join(f"<th>{_e(title)}</th>" for _, title in _INVENTORY_COLUMNS)
    rows = []
    for layer in inventory.get("layers", []):
        cells = []
        for key, _ in _INVENTORY_COLUMNS:
            value = layer.get(key)
            if isinstance(value, list):
                value = ", ".join(str(v) for v in value)
            cells.append(f"<td>{_e(value)}</td>")
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
        f"<tr><td>{_e(c.get('from_layer') or 'input')}</td>"
        f"<td>{_e(c.get('layer'))}</td>"
        f"<td>{_e(c.get('from_dtype'))} &rarr; {_e(c.get('to_dtype'))}</td></tr>"
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
        f"<h3>Precision inventory</h3><p>Model <code>{_e(model.get('name'))}</code> "
        f"({_e(model.get('class'))}), policy {_e(model.get('policy'))}, output "
        f"{_e(', '.join(model.get('output_dtypes', [])))}, {_e(model.get('params'))} "
        f"parameters.</p>{table}"
        f"<h4>Casts between layers ({len(casts)})</h4>"
        + (cast_table if casts else "<p class=muted>None.</p>")
    )


def _gpu_html(run: reader.Run, data: dict, index: int) -> str:
    gpu = run.gpu
    parts = ["<h3>GPU</h3>"]
    if gpu is None:
        parts.append("<p class=muted>No GPU data was recorded.</p>")
        return "\n".join(parts)
    parts.append(f"<p>Sampler mode: {_e(gpu.mode)}</p>")
    for track in range(len(data.get("gpu", []))):
        parts.append(
            f'<div class="plot gpu" data-kind="gpu" data-track="{track}" data-run="{index}"></div>'
        )
    if gpu.kernels:
        parts.append(f"<h4>Kernels</h4>{_value_html(gpu.kernels)}")
    return "\n".join(parts)


def _page(logdir: str, summary: str, sections: list[str], data: list[dict]) -> str:
    generated = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    payload = _script_json(data)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>mpprof report: {_e(logdir)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>{_static("report.css")}</style>
<script>{_plotly_js()}</script>
</head><body>
<header><h1>mpprof report</h1>
<p>Logdir <code>{_e(logdir)}</code>, {len(sections)} run(s), generated {_e(generated)}
by mpprof {_e(mpprof.__version__)}.</p></header>
{summary}
{"".join(sections)}
<script type="application/json" id="mpprof-data">{payload}</script>
<script>{_static("report.js")}</script>
</body></html>
"""


def _script_json(value) -> str:
    """JSON safe inside <script>: no `</` can end the element early."""
    text = json.dumps(value, separators=(",", ":"), allow_nan=False)
    return text.replace("</", "<\\/").replace("<!--", "<\\u0021--")


def _plotly_js() -> str:
    import plotly

    path = pathlib.Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    return path.read_text(encoding="utf-8").replace("</script", "<\\/script")


def _static(name: str) -> str:
    """A file shipped beside this module in report_static/."""
    return (pathlib.Path(__file__).parent / "report_static" / name).read_text(encoding="utf-8")
