"""A run in a few lines of text: what was recorded, and how its fit ended."""

from __future__ import annotations

import datetime

from mpprof.records import reader
from mpprof.terminal import printable


def summarize_run(run: reader.Run) -> str:
    """A few lines saying what was recorded in `run`, safe for a terminal."""
    lines = [f"run {run.name}:"]
    context = run.context
    if context:
        lines.append(
            f"  policy {context.model_policy} (global {context.global_policy}), "
            f"optimizer {context.optimizer}, strategy {context.strategy}"
        )
        if context.float32_matmuls:
            lines.append(f"  float32 matmuls: {context.float32_matmuls.get('setting')}")
    stopped = cut_short_text(run)
    if stopped:
        lines.append(f"  {stopped}")
    inventory = run.inventory
    if inventory:
        layers = [layer for layer in inventory.get("layers", []) if layer.get("is_leaf")]
        islands = [layer["name"] for layer in layers if layer.get("float32_island")]
        lines.append(
            f"  {len(layers)} leaf layers, model output "
            f"{inventory.get('model', {}).get('output_dtypes')}, "
            f"{len(inventory.get('casts', []))} casts, float32 islands: "
            f"{', '.join(islands) or 'none'}"
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


def cut_short_text(run: reader.Run) -> str | None:
    """The line saying a run's fit stopped without recording its end."""
    stopped = run.cut_short
    lost = run.recording_stopped
    if stopped is None and lost is not None:
        return (
            f"the records stop at step {lost['records_until_step']}: writing them failed "
            f"({lost['reason']}); the fit went on and {lost['fit_state']} at step "
            f"{lost['fit_step']}"
        )
    if stopped is None:
        return None
    when = datetime.datetime.fromtimestamp(stopped["wall_time"], datetime.timezone.utc)
    last = f"last record {when:%Y-%m-%d %H:%M:%S} UTC"
    if stopped["fit_state"] == "failed":
        return f"fit failed at step {stopped['step']}: model.fit raised ({last})"
    return (
        f"cut short at step {stopped['step']}: the fit never recorded its end "
        f"(killed, or still training; {last})"
    )
