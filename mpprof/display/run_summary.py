"""A run in a few lines of text: what was recorded, and how its fit ended."""

from __future__ import annotations

import datetime

from mpprof.jsonsafe import json_safe
from mpprof.records import reader
from mpprof.records.run_context import error_headline
from mpprof.terminal import printable


def run_facts(run: reader.Run) -> dict:
    """What was recorded in `run`, as JSON-ready values (`mpprof summary
    --format json`; `summarize_run` says the same in text).

    Keys: run, readable, fit_state ("ended", "failed", "cut_short", "unknown"),
    cut_short and recording_stopped (where the records stop, or None),
    model_policy, global_policy, optimizer, strategy (None without a run
    context), float32_matmuls (what float32 matmuls ran as, in words),
    inventory (leaf_layers, output_dtypes, casts, float32_islands:
    the layer names; None if not recorded), loss_scale (initial, final,
    first_step, steps_run, overflows, growths; None without a dynamic loss
    scale) and warnings.
    """
    context = run.context
    inventory = run.inventory
    layers = [layer for layer in (inventory or {}).get("layers", []) if layer.get("is_leaf")]
    loss_scale = run.loss_scale
    return json_safe({
        "run": run.name,
        "readable": run.readable,
        "fit_state": run.fit_outcome,
        "cut_short": run.cut_short,
        "recording_stopped": run.recording_stopped,
        **{key: getattr(context, key) if context else None
           for key in ("model_policy", "global_policy", "optimizer", "strategy")},
        # What float32 matmuls ran as (TF32 or not), in words; None if not recorded.
        "float32_matmuls": (context.float32_matmuls or {}).get("setting") if context else None,
        "inventory": None if not inventory else {
            "leaf_layers": len(layers),
            "output_dtypes": inventory.get("model", {}).get("output_dtypes"),
            "casts": len(inventory.get("casts", [])),
            "float32_islands": [layer["name"] for layer in layers
                                if layer.get("float32_island")],
        },
        "loss_scale": None if loss_scale is None else {
            "initial": loss_scale.initial_scale,
            "final": loss_scale.final_scale,
            "first_step": loss_scale.first_step,
            "steps_run": loss_scale.steps_run,
            "overflows": loss_scale.skipped_steps,
            "growths": len(loss_scale.growths),
        },
        "warnings": list(run.warnings),
    })


def summarize_run(run: reader.Run) -> str:
    """A few lines saying what was recorded in `run` (`run_facts`), safe for a terminal."""
    facts = run_facts(run)
    lines = [f"run {run.name}:"]
    if run.context:
        lines.append(
            f"  policy {facts['model_policy']} (global {facts['global_policy']}), "
            f"optimizer {facts['optimizer']}, strategy {facts['strategy']}"
        )
        if facts["float32_matmuls"]:
            lines.append(f"  float32 matmuls: {facts['float32_matmuls']}")
    stopped = cut_short_text(run)
    if stopped:
        lines.append(f"  {stopped}")
    inventory = facts["inventory"]
    if inventory:
        lines.append(
            f"  {inventory['leaf_layers']} leaf layers, model output "
            f"{inventory['output_dtypes']}, {inventory['casts']} casts, float32 islands: "
            f"{', '.join(inventory['float32_islands']) or 'none'}"
        )
    loss_scale = run.loss_scale
    if loss_scale is None and run.readable:
        lines.append("  no dynamic loss scale (not a LossScaleOptimizer)")
    elif loss_scale is not None:
        line = (
            f"  loss scale {loss_scale.initial_scale:g} -> {loss_scale.final_scale:g} over "
            f"{loss_scale.steps_run - loss_scale.first_step} steps: "
            f"{loss_scale.skipped_steps} overflows (skipped steps), "
            f"{len(loss_scale.growths)} growths"
        )
        if run.cut_short and run.cut_short["step"] > loss_scale.steps_run:
            line += (
                f" (read up to step {loss_scale.steps_run}; later records reach "
                f"step {run.cut_short['step']})"
            )
        lines.append(line)
    if not run.readable:
        lines.append(f"  {NOTHING_READABLE}")
    lines.extend(f"  warning: {w}" for w in run.warnings)
    return "\n".join(printable(line) for line in lines)


NOTHING_READABLE = "nothing readable: no record of this run could be read (see its warnings)"


# How a fit stood, from its fit-end file or run context, after its records.
_FIT_STATE_WORDS = {"ended": "ended", "failed": "failed", "running": "never recorded its end"}


def cut_short_text(run: reader.Run) -> str | None:
    """The line saying a run's fit stopped without recording its end."""
    stopped = run.cut_short
    lost = run.recording_stopped
    if stopped is None and lost is not None:
        where = ("no record could be written" if lost["records_until_step"] is None
                 else f"the records stop at step {lost['records_until_step']}")
        return (
            f"{where}: writing them failed ({lost['reason']}); the fit went on and "
            f"{lost['fit_state']} at step {lost['fit_step']}"
        )
    if stopped is None:
        return None
    when = datetime.datetime.fromtimestamp(stopped["wall_time"], datetime.timezone.utc)
    last = f"last record {when:%Y-%m-%d %H:%M:%S} UTC"
    if stopped.get("unreadable"):
        return (f"cut short at step {stopped['step']}: the records after it could not be "
                f"read ({stopped['unreadable']}); the fit "
                f"{_FIT_STATE_WORDS.get(stopped['fit_state'], 'may have gone on')} ({last})")
    if stopped["fit_state"] == "failed":
        error = run.context.fit_error
        raised = (f"model.fit raised {error.get('type')}: "
                  f"{error_headline(error.get('message'))[:200]}" if error else "model.fit raised")
        return f"fit failed at step {stopped['step']}: {raised} ({last})"
    return (
        f"cut short at step {stopped['step']}: the fit never recorded its end "
        f"(killed, or still training; {last})"
    )
