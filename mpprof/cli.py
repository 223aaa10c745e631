"""The `mpprof` command line.

Everything printed that comes from a logdir (run names, layer names,
recorded text, warnings quoting file names) goes through
`mpprof.terminal.printable`, so a hostile name cannot drive the terminal.
Reading a local logdir imports neither TensorFlow nor Keras.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Callable, Iterable

from mpprof import diagnosis
from mpprof._version import __version__
from mpprof.records import filesystem, reader, run_context
from mpprof.replay import files as replay_files
from mpprof.replay import text as replay_text
from mpprof.terminal import printable

# Exit statuses, a public interface (CI gates read them): see `EXIT_STATUSES`.
EXIT_OK = 0
EXIT_FINDINGS = 1  # diagnose --fail-on: a finding at least that severe
EXIT_USAGE = 2  # bad arguments, missing logdir, no mpprof run there
EXIT_UNREADABLE = 3  # a run whose records could not be read at all

EXIT_STATUSES = f"""\
exit status:
  {EXIT_OK}  success
  {EXIT_FINDINGS}  diagnose --fail-on: a finding at least that severe
  {EXIT_USAGE}  bad arguments, no such logdir or run, or no mpprof records in it;
     replay, bundle: no such capture, or one that cannot be replayed
  {EXIT_UNREADABLE}  nothing readable: a run none of whose records could be read
     (corrupt files, or written by a newer mpprof); the warnings say why"""

# Above this many bytes of event files, diagnose and summary say on stderr
# what they are reading (a 10M-step run is ~230 MB and takes seconds).
PROGRESS_BYTES = 32 * 2**20


def summarize_run(run: reader.Run) -> str:
    """A few lines saying what was recorded in `run`, safe for a terminal."""
    lines = [f"run {run.name}:"]
    context = run.context
    if context:
        lines.append(
            f"  policy {context.model_policy} (global {context.global_policy}), "
            f"optimizer {context.optimizer}, strategy {context.strategy}"
        )
    stopped = _cut_short_text(run)
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
        lines.append(f"  {_NOTHING_READABLE}")
    lines.extend(f"  warning: {w}" for w in run.warnings)
    return "\n".join(printable(line) for line in lines)


_NOTHING_READABLE = "nothing readable: no record of this run could be read (see its warnings)"


def _cut_short_text(run: reader.Run) -> str | None:
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


def _say(lines: Iterable[str], stream=None) -> None:
    """Prints `lines` of untrusted text, control characters escaped."""
    for line in lines:
        print(printable(line), file=stream or sys.stdout)


def _warn(text: str) -> None:
    _say([f"mpprof: warning: {text}"], sys.stderr)


def _read(logdir: str, run: str | None,
          progress: Callable[[str], None] | None = None) -> tuple[dict[str, reader.Run], bool]:
    """The selected runs of `logdir`, and whether they are big enough to say
    on stderr what is being done (said here for the reading, to `progress`
    when given, else on stderr for big runs only)."""
    names = reader.select_runs(logdir, run, on_warning=_warn)
    sizes = {name: _bytes(logdir, name) for name in names}
    chatty = sum(sizes.values()) > PROGRESS_BYTES
    if progress is None and chatty:
        def progress(message: str) -> None:
            _say([f"mpprof: {message}"], sys.stderr)
    runs = {}
    for index, name in enumerate(names):
        if progress is not None:
            progress(f"reading run {name} ({index + 1}/{len(names)}, "
                     f"{sizes[name] / 1e6:.0f} MB)")
        try:
            runs[name] = reader.read_run(logdir, name)
        except OSError as e:
            _warn(f"run {name}: cannot be read ({e.strerror or e}); skipped")
        except reader.NoMpprofDataError as e:  # removed since it was listed
            _warn(f"run {name}: {e}; skipped")
    return runs, chatty


def _bytes(logdir: str, run: str) -> int:
    try:
        return sum(filesystem.size_and_mtime(p)[0] for p in reader.event_files(logdir, run))
    except (OSError, reader.NoMpprofDataError):
        return 0  # reading it will say what is wrong


def _unreadable_status(runs: dict[str, reader.Run]) -> int | None:
    unreadable = [name for name, run in runs.items() if not run.readable]
    for name in unreadable:
        _warn(f"run {name}: {_NOTHING_READABLE}")
    return EXIT_UNREADABLE if unreadable or not runs else None


def _summary(args) -> int:
    runs, _ = _read(args.logdir, None)
    for run in runs.values():
        print(summarize_run(run))
    return _unreadable_status(runs) or EXIT_OK


def _diagnose(args) -> int:
    runs, chatty = _read(args.logdir, args.run)
    replays = {name: _replays_of(args.logdir, name, args.replay) for name in runs}
    results = {}
    for name, run in runs.items():
        if run.readable:
            if chatty:
                _say([f"mpprof: diagnosing run {name}"], sys.stderr)
            results[name] = diagnosis.evaluate(run)
    for name, run in runs.items():
        for warning in run.warnings:
            _warn(f"run {name}: {warning}")
    if args.format == "json":
        rows = [
            {"run": name, "fit_state": _fit_state(runs[name]), **finding.to_dict(),
             **_replay_field(finding, replays[name])}
            for name, result in results.items()
            for finding in result.findings
        ]
        rows.sort(key=lambda row: diagnosis.SEVERITIES.index(row["severity"]))
        # json.dumps escapes control characters (ensure_ascii).
        print(json.dumps(rows, indent=2))
    elif args.format == "json-runs":
        print(json.dumps({"runs": [
            _run_json(run, results.get(name), replays[name]) for name, run in runs.items()
        ]}, indent=2))
    else:
        color = sys.stdout.isatty() and "NO_COLOR" not in os.environ
        print("\n\n".join(_diagnosis_text(run, results.get(name), color, replays[name])
                          for name, run in runs.items()))
    status = _unreadable_status(runs)
    if status is not None:
        return status
    findings = [f for result in results.values() for f in result.findings]
    return EXIT_FINDINGS if diagnosis.exceeds(findings, args.fail_on) else EXIT_OK


def _fit_state(run: reader.Run) -> str:
    """How the run's (latest) fit stands: "ended", "failed", "cut_short" (it
    never recorded its end: killed, or still training), or "unknown" (a run
    recorded before mpprof said, or nothing readable)."""
    stopped = run.cut_short
    if stopped is not None:
        return (run_context.FIT_FAILED if stopped["fit_state"] == run_context.FIT_FAILED
                else "cut_short")
    return run_context.FIT_ENDED if run.context.fit_state else "unknown"


def _run_json(run: reader.Run, result, replays: list[dict]) -> dict:
    """One run of `diagnose --format json-runs`: every run, readable or not."""
    findings = [] if result is None else [
        {**f.to_dict(), **_replay_field(f, replays)} for f in result.findings]
    findings.sort(key=lambda row: diagnosis.SEVERITIES.index(row["severity"]))
    return {
        "run": run.name,
        "readable": run.readable,
        "fit_state": _fit_state(run),
        "cut_short": run.cut_short,
        "recording_stopped": run.recording_stopped,
        "warnings": run.warnings,
        "findings": findings,
    }


def _replays_of(logdir: str, run: str, replay_missing: bool) -> list[dict]:
    """The run's replay results; with `replay_missing`, captures without one
    are replayed first (imports TensorFlow)."""
    captures = replay_files.find_captures(logdir, run, on_skipped=_warn)
    if replay_missing:
        for capture in captures:
            if capture.result() is None:
                _say([f"mpprof: replaying run {run}, step {capture.step}"], sys.stderr)
                _run_replay(logdir, run, capture.step)
    return [result for capture in captures if (result := capture.result()) is not None]


def _replay_field(finding, replays: list[dict]) -> dict:
    """The JSON row's "replay", under the findings it bears on."""
    result = replay_text.replay_for(finding.code, replays)
    return {} if result is None else {"replay": result}


def _diagnosis_text(run: reader.Run, result, color: bool, replays: list[dict]) -> str:
    """One run's section of `mpprof diagnose`'s text output."""
    if result is None:
        lines = [f"== run {run.name} ==", *(f"  ! {w}" for w in run.warnings),
                 f"  {_NOTHING_READABLE}"]
        return "\n".join(printable(line) for line in lines)
    # format_text escapes what it prints from the run itself (and adds ANSI
    # colours of its own, so it is not escaped again here).
    notes = {f.code: replay_text.result_lines(shown, indent="         ")
             for f in result.findings
             if (shown := replay_text.replay_for(f.code, replays)) is not None}
    header, _, rest = diagnosis.format_text(run, result, color=color,
                                            notes=notes).partition("\n")
    if replays and not notes:
        rest += "\n" + "\n".join(replay_text.result_lines(replays[0], indent="  "))
    stopped = _cut_short_text(run)
    if stopped:
        header += "\n" + printable(f"  ! {stopped}")
    return f"{header}\n{rest}" if rest else header


def _report(args) -> int:
    from mpprof import report  # plotly is only needed here

    def progress(message: str) -> None:
        if not args.quiet:
            _say([f"mpprof: {message}"], sys.stderr)

    runs, _ = _read(args.logdir, args.run, progress)
    path = report.save_report(
        report.render_report(args.logdir, list(runs.values()), progress=progress), args.output)
    size = os.path.getsize(path) / 1e6
    _say([f"mpprof: wrote {path} ({size:.1f} MB)"], sys.stderr)
    return _unreadable_status(runs) or EXIT_OK


def _replay(args) -> int:
    names = reader.select_runs(args.logdir, args.run, on_warning=_warn)
    with_captures = [name for name in names
                     if replay_files.find_captures(args.logdir, name, on_skipped=_warn)
                     or _has_step_folder(args.logdir, name, args.step)]
    if not with_captures:
        raise replay_files.NoCaptureError(
            f"no replay capture in {args.logdir} (runs: {', '.join(names)}): mpprof "
            "captures a step only when a sampled step overflowed or had a non-finite "
            "loss, with MixedPrecisionProfiler(replay_budget > 0)"
        )
    results = []
    for name in with_captures:
        capture = replay_files.select_capture(args.logdir, name, args.step)
        result = None if args.again else capture.result()
        if result is None:
            if args.format != "json":
                _say([f"mpprof: replaying run {name}, step {capture.step} (imports "
                      "TensorFlow)"], sys.stderr)
            result = _run_replay(args.logdir, name, capture.step)
        results.append(result)
    if args.format == "json":
        # json.dumps escapes control characters (ensure_ascii).
        print(json.dumps(results[0] if len(results) == 1 else results, indent=2))
    else:
        print("\n\n".join("\n".join(replay_text.result_lines(r)) for r in results))
    return EXIT_OK


def _has_step_folder(logdir: str, run: str, step: int | None) -> bool:
    """Whether `run` has a folder for the capture of `step` (readable or not:
    asking for a damaged one must name its damage, not say it is missing)."""
    if step is None:
        return False
    folder = filesystem.join(replay_files.run_path(logdir, run), replay_files.step_folder(step))
    try:
        return filesystem.isdir(folder)
    except OSError:
        return False


def _bundle(args) -> int:
    from mpprof.replay import bundle

    written = bundle.write_bundle(args.logdir, args.output, run=args.run, step=args.step,
                                  include_batch=args.include_batch, on_skipped=_warn)
    held = "with the batch and weights" if args.include_batch else (
        "statistics and shapes only (no batch, no weights: --include-batch adds them)")
    _say([f"mpprof: wrote {written['path']} ({written['bytes'] / 1e3:.0f} kB): run "
          f"{written['run']}, step {written['step']}, {held}"], sys.stderr)
    return EXIT_OK


def _run_replay(logdir: str, run: str, step: int) -> dict:
    """Replays one capture (TensorFlow and Keras are imported only here)."""
    from mpprof.backends.tensorflow import replay_engine as engine

    return engine.replay(logdir, run, step)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpprof",
        description="Inspect mixed-precision runs recorded by mpprof.",
        epilog=EXIT_STATUSES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"mpprof {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return commands.add_parser(
            name, help=help, description=help, epilog=EXIT_STATUSES,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    summary = command("summary", "say what was recorded in LOGDIR")
    summary.add_argument("logdir")
    summary.set_defaults(handler=_summary)
    diagnose = command("diagnose", "list what is wrong in LOGDIR's runs and what to change")
    diagnose.add_argument("logdir")
    diagnose.add_argument("--run", help="only this run (as `mpprof summary` names it)")
    diagnose.add_argument(
        "--format", choices=("text", "json", "json-runs"), default="text",
        help="json: a list of findings, most severe first, each with its run and the "
             "run's fit_state; json-runs: every run (unreadable ones too) with its fit "
             "state, warnings and findings")
    diagnose.add_argument(
        "--fail-on", choices=("critical", "warning"), default=None,
        help=f"exit with status {EXIT_FINDINGS} if a finding is at least this severe (for CI)",
    )
    diagnose.add_argument(
        "--replay", action="store_true",
        help="replay captured steps that have no replay result yet (imports TensorFlow)",
    )
    diagnose.set_defaults(handler=_diagnose)
    report = command("report", "write one self-contained HTML report of LOGDIR's runs")
    report.add_argument("logdir")
    report.add_argument("-o", "--output", default="mpprof-report.html")
    report.add_argument("--run", help="only this run")
    report.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    report.set_defaults(handler=_report)
    replay = command(
        "replay",
        "run a captured step again: the first op that overflowed, float16 vs float32 "
        "per layer, and a verified per-layer float32 fix",
    )
    replay.add_argument("logdir")
    replay.add_argument("--run", help="only this run (as `mpprof summary` names it)")
    replay.add_argument("--step", type=int, help="the captured step (default: the first)")
    replay.add_argument("--format", choices=("text", "json"), default="text")
    replay.add_argument("--again", action="store_true",
                        help="replay even when a saved result exists")
    replay.set_defaults(handler=_replay)
    bundle = command(
        "bundle",
        "write a repro zip of a captured step for a bug report (statistics and shapes; "
        "the batch and weights only with --include-batch)",
    )
    bundle.add_argument("logdir")
    bundle.add_argument("-o", "--output", default="mpprof-bundle.zip")
    bundle.add_argument("--run", help="only this run")
    bundle.add_argument("--step", type=int, help="the captured step (default: the first)")
    bundle.add_argument("--include-batch", action="store_true",
                        help="also the step's batch and weights (they may be private)")
    bundle.set_defaults(handler=_bundle)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (reader.LogdirNotFoundError, reader.NoMpprofDataError,
            replay_files.NoCaptureError, replay_files.ReplayError) as e:
        _say([f"mpprof: {e}"], sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # The reader of our output went away (`mpprof diagnose ... | head`):
        # stop quietly, and keep Python from complaining when it flushes.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives until exit
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
