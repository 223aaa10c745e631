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
from mpprof.display import run_digest
from mpprof.display.run_summary import (
    NOTHING_READABLE,
    cut_short_text,
    run_facts,
    summarize_run,
)
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
     (corrupt files, or written by a newer mpprof); the warnings say why;
     diagnose --fail-on: also a run some of whose records could not be read
  report exits 0 once the file is written, 2 as above, or 3 as above (the
  report is written, and says what could not be read)"""

# Above this many bytes of event files, diagnose and summary say on stderr
# what they are reading (a 10M-step run is ~230 MB and takes seconds).
PROGRESS_BYTES = 32 * 2**20


def _say(lines: Iterable[str], stream=None) -> None:
    """Prints `lines` of untrusted text, control characters escaped."""
    for line in lines:
        print(printable(line), file=stream or sys.stdout)


def _warn(text: str) -> None:
    _say([f"mpprof: warning: {text}"], sys.stderr)


def _read(logdir: str, run: str | None, verbosity: int = 0,
          progress: Callable[[str], None] | None = None,
          skip: Iterable[str] = ()) -> tuple[dict[str, reader.Run], bool]:
    """The selected runs of `logdir` (less those in `skip`), and whether to
    say on stderr what is being done: with -v always, with -q never, else
    for big runs only (said here for the reading, to `progress` when given,
    else on stderr)."""
    skipped = set(skip)
    names = [name for name in reader.select_runs(logdir, run, on_warning=_warn)
             if name not in skipped]
    sizes = {name: _bytes(logdir, name) for name in names}
    chatty = verbosity > 0 or (verbosity == 0 and sum(sizes.values()) > PROGRESS_BYTES)
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


def _unreadable_status(runs: dict[str, reader.Run], whole: bool = False,
                       digested: int = 0) -> int | None:
    """EXIT_UNREADABLE, with a warning per run, where a run had nothing
    readable; with `whole` (a CI gate: `--fail-on`), also where any of a
    run's records could not be read: a gate never passes what it could not
    read whole as "no findings". `digested`: how many more runs were taken
    from their digests (each read whole by its fit)."""
    unreadable = [name for name, run in runs.items() if not run.readable]
    for name in unreadable:
        why = cut_short_text(runs[name])  # a write that failed before the first record
        _warn(f"run {name}: {NOTHING_READABLE}" + (f"; {why}" if why else ""))
    damaged = [name for name, run in runs.items()
               if whole and run.readable and run.losses]
    for name in damaged:
        lost = "; ".join(f"{loss.file}: {loss.describe()}" for loss in runs[name].losses)
        _warn(f"run {name}: records could not be read ({lost}); --fail-on does not pass a "
              "run it could not read whole")
    return EXIT_UNREADABLE if unreadable or damaged or not (runs or digested) else None


def _summary(args) -> int:
    runs, _ = _read(args.logdir, args.run, args.verbosity)
    if args.format == "json":
        # json.dumps escapes control characters (ensure_ascii).
        print(json.dumps([run_facts(run) for run in runs.values()], indent=2))
    else:
        for run in runs.values():
            print(summarize_run(run))
    return _unreadable_status(runs) or EXIT_OK


def _diagnose(args) -> int:
    # A sweep's JSON takes each run whose fit wrote a digest that still holds
    # from it, unread (`run_digest`); the text, --replay and --assume-gpu
    # read every run.
    digested = ({} if args.format == "text" or args.replay or args.assume_gpu
                else _digests(args.logdir, args.run))
    runs, chatty = _read(args.logdir, args.run, args.verbosity, skip=digested)
    names = sorted(runs.keys() | digested.keys())
    replays = {name: _replays_of(args.logdir, name, args.replay, args.verbosity)
               for name in names}
    # A digest is written only by a fit in one process: a job's run across
    # processes (`_with_process_replays`) is always read.
    for name, run in runs.items():
        replays[name] = _with_process_replays(run, replays, args)
    results = {}
    for name, run in runs.items():
        if run.readable:
            if chatty:
                _say([f"mpprof: diagnosing run {name}"], sys.stderr)
            results[name] = diagnosis.evaluate(run, assume_gpu=args.assume_gpu)
    findings = {name: result.findings for name, result in results.items()}
    findings.update({name: run_digest.findings_of(part) for name, part in digested.items()})
    # Each finding as JSON (`Finding.to_dict`): a digest holds them so.
    rows = ({} if args.format == "text" else
            {name: [f.to_dict() for f in result.findings] for name, result in results.items()})
    rows.update({name: part["findings"] for name, part in digested.items()})
    heads = {name: run_digest.run_head(run) for name, run in runs.items()}
    heads.update({name: {key: value for key, value in part.items() if key != "findings"}
                  for name, part in digested.items()})
    for name in names:
        for warning in heads[name]["warnings"]:
            _warn(f"run {name}: {warning}")
    if args.format == "json":
        listed = [
            {"run": name, "fit_state": heads[name]["fit_state"], **row,
             **_replay_field(row["code"], replays[name])}
            for name in names
            for row in rows.get(name, [])
        ]
        listed.sort(key=lambda row: diagnosis.SEVERITIES.index(row["severity"]))
        # json.dumps escapes control characters (ensure_ascii).
        print(json.dumps(listed, indent=2))
    elif args.format == "json-runs":
        print(json.dumps({"runs": [
            _run_json(heads[name], rows.get(name), replays[name]) for name in names
        ]}, indent=2))
    else:
        color = sys.stdout.isatty() and "NO_COLOR" not in os.environ
        print("\n\n".join(_diagnosis_text(run, results.get(name), color, replays[name])
                          for name, run in runs.items()))
    status = _unreadable_status(runs, whole=args.fail_on is not None, digested=len(digested))
    if status is not None:
        return status
    found = [f for found in findings.values() for f in found]
    return EXIT_FINDINGS if diagnosis.exceeds(found, args.fail_on) else EXIT_OK


def _digests(logdir: str, run: str | None) -> dict[str, dict]:
    """{run: its digest's "diagnose" part} for the selected runs whose
    digest holds (`run_digest.load_many`); the listing's warnings are said
    once, by `_read`."""
    files = reader.run_files(logdir, on_warning=lambda warning: None)
    if run is not None:
        files = {run: files[run]} if run in files else {}
    return run_digest.load_many(files, "diagnose")


def _run_json(head: dict, rows: list[dict] | None, replays: list[dict]) -> dict:
    """One run of `diagnose --format json-runs`: every run, readable or not
    (`head`: `run_digest.run_head`; `rows`: its findings as JSON)."""
    findings = [{**row, **_replay_field(row["code"], replays)} for row in rows or []]
    findings.sort(key=lambda row: diagnosis.SEVERITIES.index(row["severity"]))
    return {**head, "findings": findings}


def _replays_of(logdir: str, run: str, replay_missing: bool, verbosity: int) -> list[dict]:
    """The run's replay results; with `replay_missing`, captures without one
    are replayed first (imports Keras and the framework that trained them)."""
    captures = replay_files.find_captures(logdir, run, on_skipped=_warn)
    if replay_missing:
        for capture in captures:
            if capture.result() is None:
                if verbosity >= 0:
                    _say([_replaying(run, capture)], sys.stderr)
                _run_replay(logdir, run, capture.step)
    return [result for capture in captures if (result := capture.result()) is not None]


def _with_process_replays(run: reader.Run, replays: dict[str, list[dict]],
                          args) -> list[dict]:
    """A job's model run across processes (JAX's): its captures are in its
    processes' runs, each holding that process's rows of the batch. Shown
    under the model run's findings: the replays whose rows went wrong first."""
    processes = (run.context.distributed.get("worker_runs") or []) \
        if run.readable and run.worker is None else []
    found = list(replays[run.name])
    for name in processes:
        found += (replays[name] if name in replays
                  else _replays_of(args.logdir, name, args.replay, args.verbosity))
    return sorted(found, key=lambda result: result.get("first_op") is None) \
        if processes else found


def _replay_field(code: str, replays: list[dict]) -> dict:
    """The JSON row's "replay", under the findings (of rule `code`) it bears on."""
    result = replay_text.replay_for(code, replays)
    return {} if result is None else {"replay": result}


def _diagnosis_text(run: reader.Run, result, color: bool, replays: list[dict]) -> str:
    """One run's section of `mpprof diagnose`'s text output."""
    if result is None:
        why = cut_short_text(run)  # a write that failed before the first record
        lines = [f"== run {run.name} ==", *(f"  ! {w}" for w in run.warnings),
                 f"  {NOTHING_READABLE}", *([f"  ! {why}"] if why else [])]
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
        if args.verbosity >= 0:
            _say([f"mpprof: {message}"], sys.stderr)

    runs, _ = _read(args.logdir, args.run, args.verbosity, progress)
    path = report.save_report(
        report.render_report(args.logdir, list(runs.values()), progress=progress), args.output)
    size = os.path.getsize(path) / 1e6
    progress(f"wrote {path} ({size:.1f} MB)")
    return _unreadable_status(runs) or EXIT_OK


def _replay(args) -> int:
    names = reader.select_runs(args.logdir, args.run, on_warning=_warn)
    with_captures = [name for name in names
                     if replay_files.find_captures(args.logdir, name, on_skipped=_warn)
                     or replay_files.has_capture_folder(args.logdir, name, args.step)]
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
            # JSON on stdout is for tools: the line only when asked for (-v).
            if (args.format != "json" and args.verbosity >= 0) or args.verbosity > 0:
                _say([_replaying(name, capture)], sys.stderr)
            result = _run_replay(args.logdir, name, capture.step)
        results.append(result)
    if args.format == "json":
        # json.dumps escapes control characters (ensure_ascii).
        print(json.dumps(results[0] if len(results) == 1 else results, indent=2))
    else:
        print("\n\n".join("\n".join(replay_text.result_lines(r)) for r in results))
    return EXIT_OK


def _replaying(run: str, capture: replay_files.Capture) -> str:
    """The progress line of a replay, naming the framework it imports."""
    from mpprof.backends import replay_engines

    return (f"mpprof: replaying run {run}, step {capture.step} (imports Keras and "
            f"{replay_engines.framework(capture.manifest)})")


def _bundle(args) -> int:
    from mpprof.replay import bundle

    written = bundle.write_bundle(args.logdir, args.output, run=args.run, step=args.step,
                                  include_batch=args.include_batch, on_skipped=_warn)
    held = "with the batch and weights" if args.include_batch else (
        "statistics and shapes only (no batch, no weights: --include-batch adds them)")
    if args.verbosity >= 0:
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
        if args.verify and args.format != "json" and args.verbosity >= 0:
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


LOGDIR_HELP = (
    "the log_dir given to MixedPrecisionProfiler, or a folder above it (every run "
    "below is read): a local path or a URL, s3://bucket/logs (mpprof[s3]; "
    "AWS_ENDPOINT_URL for S3-compatible stores), gs://bucket/logs (mpprof[gcs]) or "
    "any fsspec URL")

# Each command's `--help` ends with these, then the exit statuses.
EXAMPLES = {
    "summary": """\
  mpprof summary logs
  mpprof summary logs --run run1/train --format json
  mpprof summary s3://bucket/logs""",
    "diagnose": """\
  mpprof diagnose logs
  mpprof diagnose logs --replay                      # first op and a verified fix
  mpprof diagnose logs --fail-on critical            # a CI gate: exit 1 on a critical finding
  mpprof diagnose logs --run run1/train --format json""",
    "report": """\
  mpprof report logs                                 # writes mpprof-report.html
  mpprof report logs -o report.html --run run1/train -q""",
    "replay": """\
  mpprof replay logs/run1
  mpprof replay logs --run run1/train --step 12 --format json
  KERAS_BACKEND=jax mpprof replay logs/jax_run      # a capture trained on JAX""",
    "bundle": """\
  mpprof bundle logs/run1 -o repro.zip
  mpprof bundle logs/run1 --include-batch            # with the batch and weights (private?)""",
    "advise": """\
  mpprof advise logs/run1 --gpu H100                 # the plan, its code, the projection
  mpprof advise logs/run1 --verify                   # replayed on the run's kept batches
  mpprof advise logs --run run1/train --format json""",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpprof",
        description="Inspect mixed-precision runs recorded by mpprof.",
        epilog="examples:\n" + "\n".join(
            line for name in ("summary", "diagnose", "report") for line in
            EXAMPLES[name].splitlines()[:1]) + "\n\n" + EXIT_STATUSES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"mpprof {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    # Every command: the logdir, and how much it says on stderr.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("logdir", help=LOGDIR_HELP)
    loudness = common.add_mutually_exclusive_group()
    loudness.add_argument("-q", "--quiet", dest="verbosity", action="store_const", const=-1,
                          default=0, help="no progress lines on stderr (warnings and "
                                          "errors still)")
    loudness.add_argument("-v", "--verbose", dest="verbosity", action="store_const", const=1,
                          help="a progress line for every run read, whatever its size (by "
                               f"default only over {PROGRESS_BYTES >> 20} MiB of records)")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return commands.add_parser(
            name, help=help, description=help, parents=[common],
            epilog=(f"examples:\n{EXAMPLES[name]}\n\n" if name in EXAMPLES else "")
            + EXIT_STATUSES,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    summary = command("summary", "say what was recorded in LOGDIR")
    summary.add_argument("--run", help="only this run (as `mpprof summary` names it)")
    summary.add_argument(
        "--format", choices=("text", "json"), default="text",
        help="json: a list of runs, each with its fit state, policy, optimizer, "
             "inventory counts, loss scale and warnings (default: %(default)s)")
    summary.set_defaults(handler=_summary)
    diagnose = command("diagnose", "list what is wrong in LOGDIR's runs and what to change")
    diagnose.add_argument("--run", help="only this run (as `mpprof summary` names it)")
    diagnose.add_argument(
        "--format", choices=("text", "json", "json-runs"), default="text",
        help="json: a list of findings, most severe first, each with its run and the "
             "run's fit_state; json-runs: every run (unreadable ones too) with its fit "
             "state, warnings and findings (default: %(default)s)")
    diagnose.add_argument(
        "--fail-on", choices=("critical", "warning"), default=None,
        help=f"exit with status {EXIT_FINDINGS} if a finding is at least this severe "
             "(for CI; default: never)",
    )
    diagnose.add_argument(
        "--assume-gpu", action="store_true",
        help="judge what only matters on a GPU (Tensor Core shapes, MP007) as a projection "
             "for a run that had none")
    diagnose.add_argument(
        "--replay", action="store_true",
        help="replay captured steps that have no replay result yet (imports Keras and the "
             "framework that trained each run: mpprof[tensorflow], mpprof[jax] or "
             "mpprof[torch])",
    )
    diagnose.set_defaults(handler=_diagnose)
    report = command("report", "write one self-contained HTML report of LOGDIR's runs")
    report.add_argument("-o", "--output", default="mpprof-report.html",
                        help="the HTML file to write (default: %(default)s)")
    report.add_argument("--run", help="only this run (default: every run)")
    report.set_defaults(handler=_report)
    replay = command(
        "replay",
        "run a captured step again: the first op that overflowed, float16 vs float32 "
        "per layer, and a verified per-layer float32 fix",
    )
    replay.add_argument("--run", help="only this run (as `mpprof summary` names it)")
    replay.add_argument("--step", type=int, help="the captured step (default: the first)")
    replay.add_argument("--format", choices=("text", "json"), default="text",
                        help="json: the replay's result as saved beside the capture "
                             "(default: %(default)s)")
    replay.add_argument("--again", action="store_true",
                        help="replay even when a saved result exists")
    replay.set_defaults(handler=_replay)
    bundle = command(
        "bundle",
        "write a repro zip of a captured step for a bug report (statistics and shapes; "
        "the batch and weights only with --include-batch)",
    )
    bundle.add_argument("-o", "--output", default="mpprof-bundle.zip",
                        help="the zip file to write (default: %(default)s)")
    bundle.add_argument("--run", help="only this run (default: the first with a capture)")
    bundle.add_argument("--step", type=int, help="the captured step (default: the first)")
    bundle.add_argument("--include-batch", action="store_true",
                        help="also the step's batch and weights (they may be private)")
    bundle.set_defaults(handler=_bundle)
    advise = command(
        "advise",
        "a per-layer precision plan from the run's data: which layers must be float32, "
        "which can go lower (half precision, float8), the code, and the speed it buys",
    )
    advise.add_argument("--run", help="only this run (as `mpprof summary` names it)")
    advise.add_argument("--format", choices=("text", "json"), default="text",
                        help="json: one run's advice as an object, several as a list "
                             "(default: %(default)s)")
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
