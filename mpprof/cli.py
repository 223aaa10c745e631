"""The `mpprof` command line."""

from __future__ import annotations

import argparse
import sys

from mpprof import reader


def summarize_run(run: reader.Run) -> str:
    """A few lines saying what was recorded in `run`."""
    context = run.context
    lines = [f"run {run.name}:"]
    if context:
        lines.append(
            f"  policy {context['model_policy']} (global {context['global_policy']}), "
            f"optimizer {context['optimizer']}, strategy "
            f"{context['distribution_strategy']} x{context['num_replicas']}"
        )
    inventory = run.inventory
    if inventory:
        layers = [layer for layer in inventory["layers"] if layer["is_leaf"]]
        islands = [layer["name"] for layer in layers if layer["float32_island"]]
        lines.append(
            f"  {len(layers)} leaf layers, model output {inventory['model']['output_dtypes']}, "
            f"{len(inventory['casts'])} casts, float32 islands: {islands or 'none'}"
        )
    loss_scale = run.loss_scale
    if loss_scale is None:
        lines.append("  no dynamic loss scale (not a LossScaleOptimizer)")
    else:
        lines.append(
            f"  loss scale {loss_scale.initial_scale:g} -> {loss_scale.final_scale:g} over "
            f"{loss_scale.steps_run - loss_scale.first_step} steps: "
            f"{loss_scale.skipped_steps} overflows (skipped steps), "
            f"{len(loss_scale.growths)} growths"
        )
    lines.extend(f"  warning: {w}" for w in run.warnings)
    return "\n".join(lines)


def _summary(args) -> int:
    for run in reader.read_logdir(args.logdir).values():
        print(summarize_run(run))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpprof", description="Inspect mixed-precision runs recorded by mpprof."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    summary = commands.add_parser("summary", help="say what was recorded in LOGDIR")
    summary.add_argument("logdir")
    summary.set_defaults(handler=_summary)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (reader.LogdirNotFoundError, reader.NoMpprofDataError) as e:
        print(f"mpprof: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
