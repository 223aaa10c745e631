"""The `mpprof` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys

from mpprof import diagnosis, reader


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


def _selected_runs(logdir: str, run: str | None) -> dict[str, reader.Run]:
    if run is None:
        return reader.read_logdir(logdir)
    available = reader.list_runs(logdir)
    if run not in available:
        raise reader.NoMpprofDataError(
            f"No mpprof run {run!r} in {logdir}; its runs: "
            f"{', '.join(available) or 'none'}"
        )
    return {run: reader.read_run(logdir, run)}


def _diagnose(args) -> int:
    runs = _selected_runs(args.logdir, args.run)
    results = {name: diagnosis.evaluate(run) for name, run in runs.items()}
    for name, run in runs.items():
        for warning in run.warnings:
            print(f"mpprof: warning: run {name}: {warning}", file=sys.stderr)
    if args.format == "json":
        rows = [
            {"run": name, **finding.to_dict()}
            for name, result in results.items()
            for finding in result.findings
        ]
        rows.sort(key=lambda row: diagnosis.SEVERITIES.index(row["severity"]))
        print(json.dumps(rows, indent=2))
    else:
        color = sys.stdout.isatty() and "NO_COLOR" not in os.environ
        print("\n\n".join(
            diagnosis.format_text(runs[name], result, color=color)
            for name, result in results.items()
        ))
    findings = [f for result in results.values() for f in result.findings]
    return 1 if diagnosis.exceeds(findings, args.fail_on) else 0


def _report(args) -> int:
    from mpprof import report  # plotly is only needed here

    def progress(message: str) -> None:
        if not args.quiet:
            print(f"mpprof: {message}", file=sys.stderr, flush=True)

    path = report.write_report(
        args.logdir, args.output, run=args.run, progress=progress
    )
    size = os.path.getsize(path) / 1e6
    print(f"mpprof: wrote {path} ({size:.1f} MB)", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpprof", description="Inspect mixed-precision runs recorded by mpprof."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    summary = commands.add_parser("summary", help="say what was recorded in LOGDIR")
    summary.add_argument("logdir")
    summary.set_defaults(handler=_summary)
    diagnose = commands.add_parser(
        "diagnose", help="list what is wrong in LOGDIR's runs and what to change"
    )
    diagnose.add_argument("logdir")
    diagnose.add_argument("--run", help="only this run (as `mpprof summary` names it)")
    diagnose.add_argument("--format", choices=("text", "json"), default="text")
    diagnose.add_argument(
        "--fail-on", choices=("critical", "warning"), default=None,
        help="exit with status 1 if a finding is at least this severe (for CI)",
    )
    diagnose.set_defaults(handler=_diagnose)
    report = commands.add_parser(
        "report", help="write one self-contained HTML report of LOGDIR's runs"
    )
    report.add_argument("logdir")
    report.add_argument("-o", "--output", default="mpprof-report.html")
    report.add_argument("--run", help="only this run")
    report.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    report.set_defaults(handler=_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (reader.LogdirNotFoundError, reader.NoMpprofDataError) as e:
        print(f"mpprof: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader of our output went away (`mpprof diagnose ... | head`):
        # stop quietly, and keep Python from complaining when it flushes.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives until exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
