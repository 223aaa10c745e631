"""The `mpprof` command line.

Everything printed that comes from a logdir (run names, layer names,
recorded text, warnings quoting file names) goes through
`mpprof.terminal.printable`, so a hostile name cannot drive the terminal.
Reading a local logdir imports neither TensorFlow nor Keras.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterable

from mpprof import diagnosis
from mpprof._version import __version__
from mpprof.display.run_summary import NOTHING_READABLE, cut_short_text, summarize_run
from mpprof.records import filesystem, reader
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
            _warn(f"run {name}: cannot be read ({filesystem.error_text(e)}); skipped")
        except reader.NoMpprofDataError as e:  # removed since it was listed
            _warn(f"run {name}: {e}; skipped")
    return runs, chatty


def _bytes(logdir: str, run: str) -> int:
    try:
        return sum(size for _, size, _ in reader.run_file_states(logdir, run))
    except (OSError, reader.NoMpprofDataError):
        return 0  # reading it will say what is wrong


def _unreadable_status(runs: dict[str, reader.Run]) -> int | None:
    unreadable = [name for name, run in runs.items() if not run.readable]
    for name in unreadable:
        _warn(f"run {name}: {NOTHING_READABLE}")
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
            {"run": name, "fit_state": runs[name].fit_outcome, **finding.to_dict(),
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


def _run_json(run: reader.Run, result, replays: list[dict]) -> dict:
    """One run of `diagnose --format json-runs`: every run, readable or not."""
    findings = [] if result is None else [
        {**f.to_dict(), **_replay_field(f, replays)} for f in result.findings]
    findings.sort(key=lambda row: diagnosis.SEVERITIES.index(row["severity"]))
    return {
        "run": run.name,
        "readable": run.readable,
        "fit_state": run.fit_outcome,
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
                 f"  {NOTHING_READABLE}"]
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
    stopped = cut_short_text(run)
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


def _advise(args) -> int:
    from mpprof import advisor
    from mpprof.advisor import gpus, text

    try:
        gpus.gpu(args.gpu) if args.gpu is not None else None
    except gpus.UnknownGpuError as e:
        _say([f"mpprof: {e}"], sys.stderr)
        return EXIT_USAGE
    names = reader.select_runs(args.logdir, args.run, on_warning=_warn)
    advice = []
    for name in names:
        if args.verify and args.format != "json":
            _say([f"mpprof: verifying run {name}'s plan on its kept batches (imports the "
                  "framework that trained it)"], sys.stderr)
        advice.append(advisor.advise(args.logdir, name, gpu=args.gpu, verify=args.verify))
    if args.format == "json":
        # json.dumps escapes control characters (ensure_ascii).
        print(json.dumps(advice[0] if len(advice) == 1 else advice, indent=2))
    else:
        print("\n\n".join("\n".join(text.advice_lines(a)) for a in advice))
    return EXIT_OK


def _run_replay(logdir: str, run: str, step: int) -> dict:
    """Replays one capture (Keras and the backend that trained it are
    imported only here)."""
    from mpprof.backends import replay_engines

    return replay_engines.replay(logdir, run, step)


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
    advise = command(
        "advise",
        "a per-layer precision plan from the run's data: which layers must be float32, "
        "which can go lower (half precision, float8), the code, and the speed it buys",
    )
    advise.add_argument("logdir")
    advise.add_argument("--run", help="only this run (as `mpprof summary` names it)")
    advise.add_argument("--format", choices=("text", "json"), default="text")
    advise.add_argument("--gpu", help="the GPU to project for (default: the run's own, "
                        "else H100); an unknown name lists the known ones")
    advise.add_argument("--verify", action="store_true",
                        help="replay the plan on the run's advise batches "
                             "(imports the framework that trained it)")
    advise.set_defaults(handler=_advise)
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
