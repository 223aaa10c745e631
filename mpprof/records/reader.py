"""Reads mpprof records back from a logdir into plain Python and numpy values.

Every front end (CLI, HTML report, TensorBoard plugin) reads through here.
Only mpprof's own event files are read (the writer marks them with
`EVENT_FILE_SUFFIX`), so a logdir full of histograms stays cheap to read.

Reading never trusts the files: each record's checksums are verified
(`mpprof.records.tfrecord`) and its content checked against the schema
(`mpprof.records.validation`); a record that fails is skipped with a warning in
`Run.warnings`, one line per kind of problem however often it occurs
(`mpprof.records.event_file` reads one file). A directory that cannot be listed is
skipped with a warning, and symlink loops are not followed. Local logdirs are
read without importing TensorFlow (`mpprof.records.filesystem`).

This module owns the logdir (which runs, which files) and `Run`, the records
of one run; the typed views of a run (`LossScale`, `Numerics`, `Float8`,
`Gpu`) are built by `mpprof.records.views`, the float8 view by
`mpprof.records.float8`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import posixpath
from collections.abc import Callable

import numpy as np

from mpprof.records import filesystem, run_context, schema
from mpprof.records import float8 as float8_records
from mpprof.records import views as record_views
from mpprof.records.event_file import ReadWarnings, Record, read_event_file, series_key
from mpprof.records.float8 import Float8
from mpprof.records.run_context import RunContext
from mpprof.records.views import Gpu, LossScale, Numerics
from mpprof.terminal import printable

__all__ = [
    "Float8",
    "Gpu",
    "LogdirNotFoundError",
    "LossScale",
    "NoMpprofDataError",
    "Numerics",
    "OnWarning",
    "Record",
    "Run",
    "event_files",
    "run_files",
    "list_runs",
    "no_runs_error",
    "read_logdir",
    "read_run",
    "select_runs",
]

logger = logging.getLogger(__name__)

# Called with each warning about the logdir as a whole (a directory that
# cannot be listed, a file that is not a regular file).
OnWarning = Callable[[str], None]


class LogdirNotFoundError(FileNotFoundError):
    """The logdir does not exist."""


class NoMpprofDataError(LookupError):
    """The logdir exists but holds no mpprof records."""


@dataclasses.dataclass
class Run:
    """Everything mpprof recorded in one run directory."""

    name: str
    path: str
    records: dict[str, list[Record]]
    warnings: list[str]
    # How each writer's fit ended, from its fit-end file (see
    # `schema.fit_end_name`), newest writer last; empty for older logs.
    fit_ends: list[dict] = dataclasses.field(default_factory=list)

    def latest(self, record: str):
        found = self.records.get(record)
        return found[-1].value if found else None

    @property
    def readable(self) -> bool:
        """Whether any record of the run could be read."""
        return any(self.records.values())

    @functools.cached_property
    def last_record(self) -> tuple[int, float] | None:
        """(largest step, latest wall time) over the run's records, or None."""
        found = [r for records in self.records.values() for r in records]
        if not found:
            return None
        return max(r.step for r in found), max(r.wall_time for r in found)

    @property
    def cut_short(self) -> dict | None:
        """How a fit that never recorded its end stopped, or None.

        The callback's run context says "fit_state": "running" from train
        begin (rewritten at each flush), then "ended" when fit returned or
        "failed" when it raised. A run whose latest context still says
        "running" was killed (or is still training); logs older than that key
        say nothing, and give None like a run that ended.

        Returns:
            None, or `{"fit_state": "running"|"failed", "step": the largest
            step of any record, "wall_time": the latest record's time}`.
        """
        state = self.context.fit_state
        if state in (None, run_context.FIT_ENDED) or self.last_record is None:
            return None
        # The records stop early when a full disk stopped them: the fit-end
        # file, reserved at the start, says whether the fit itself ended.
        end = self.fit_ends[-1] if self.fit_ends else {}
        if end.get("fit_state") == run_context.FIT_ENDED:
            return None
        if end.get("fit_state") == run_context.FIT_FAILED:
            state = run_context.FIT_FAILED
        step, wall_time = self.last_record
        return {"fit_state": state, "step": step, "wall_time": wall_time}

    @property
    def recording_stopped(self) -> dict | None:
        """When a failed write (a full disk) stopped the records while the fit
        went on: `{"reason", "records_until_step", "fit_state" (how the fit
        ended), "fit_step" (its last step), "wall_time" (its end)}`, else None.
        """
        end = self.fit_ends[-1] if self.fit_ends else {}
        if not end.get("recording_stopped"):
            return None
        return {
            "reason": str(end["recording_stopped"]),
            "records_until_step": self.last_record[0] if self.last_record else None,
            "fit_state": end.get("fit_state"),
            "fit_step": end.get("step"),
            "wall_time": end.get("wall_time"),
        }

    @property
    def context(self) -> RunContext:
        """The latest run context (`RunContext`, empty when none was read)."""
        return RunContext(self.latest(schema.RUN_CONTEXT))

    @property
    def inventory(self) -> dict | None:
        return self.latest(schema.INVENTORY)

    @property
    def worker(self) -> dict | None:
        """For one worker's own run of a multi-worker fit (`train/worker_<i>`):
        `{"index", "role" ("chief"|"worker"), "model_run", "evidence"}`, where
        `model_run` names the run with the model-level records (inventory, loss
        scale, numerics), written by the chief. None for any other run.
        """
        context = self.context
        if context.run_role != "worker":
            return None
        distributed = context.distributed
        return {
            "index": distributed.get("worker_index"),
            "role": distributed.get("role"),
            "model_run": posixpath.dirname(self.name) or ".",
            "evidence": context.worker_evidence,
        }

    @functools.cached_property
    def loss_scale(self) -> LossScale | None:
        """The primary loss-scale series (the compiled optimizer's, or the
        first LossScaleOptimizer the train step applied), or None."""
        return self._loss_scale_series(None)

    @functools.cached_property
    def loss_scales(self) -> dict[str, LossScale]:
        """Every loss-scale series by optimizer name: the primary one under
        the name the run context gives it ("optimizer" in older runs), then
        the series of each other LossScaleOptimizer the step used (a GAN's
        `g_opt`, `d_opt`)."""
        found = {}
        if self.loss_scale is not None:
            loss_scale = self.context.collector("loss_scale")
            found[str(loss_scale.get("primary", "optimizer"))] = self.loss_scale
        prefix = schema.LOSS_SCALE_PROGRESS + schema.SERIES_SEPARATOR
        for key in sorted(self.records):
            if key.startswith(prefix):
                series = key[len(prefix):]
                found[series] = self._loss_scale_series(series)
        return found

    def _loss_scale_series(self, series: str | None) -> LossScale | None:
        return record_views.loss_scale(
            self._stacked(series_key(schema.LOSS_SCALE_EVENTS, series),
                          len(schema.LOSS_SCALE_EVENT_COLUMNS)),
            self._stacked(series_key(schema.LOSS_SCALE_PROGRESS, series),
                          len(schema.LOSS_SCALE_PROGRESS_COLUMNS)),
        )

    @property
    def health(self) -> dict | None:
        return self.latest(schema.HEALTH)
    @functools.cached_property
    def numerics(self) -> Numerics | None:
        """Per-layer numerics samples; None if the run holds no complete one."""
        return record_views.numerics(self.latest(schema.NUMERICS_LAYOUT), self.records)

    @functools.cached_property
    def float8(self) -> Float8 | None:
        """The float8 layers' scales and amax; None for a run without float8
        layers (or recorded before mpprof recorded them)."""
        return float8_records.float8(self.latest(schema.FLOAT8_LAYOUT), self.records)

    @functools.cached_property
    def gpu(self) -> Gpu | None:
        """GPU samples and kernel share; None if the run recorded no GPU entry."""
        return record_views.gpu(
            self.context.collector("gpu") or None,
            self._stacked(schema.GPU_SAMPLES, len(schema.GPU_SAMPLE_COLUMNS)),
            self.latest(schema.KERNEL_STATS),
        )

    def _stacked(self, record: str, columns: int) -> np.ndarray:
        return record_views.stacked_rows(self.records.get(record, []), columns)


def list_runs(logdir: str | os.PathLike, on_warning: OnWarning | None = None) -> list[str]:
    """Names of the runs under `logdir` that hold mpprof records, sorted.

    A run's name is its directory relative to `logdir` ("." for logdir
    itself), as TensorBoard names runs. Directories that cannot be listed and
    mpprof-named entries that are not regular files (a FIFO, a dangling
    symlink) are skipped, each with a warning; symlinks back into the logdir
    are not followed.

    Args:
        logdir: a local path or a remote one (`gs://...`).
        on_warning: receives each warning; by default they are logged.
    """
    # Two fits that wrote into one directory at once are two runs: the
    # listing needs each file's state (`run_files`, `split_writers`).
    return list(run_files(logdir, on_warning))


# One event file as listed: (path, size in bytes, modification time in ns).
FileState = tuple[str, int, int]


def run_files(logdir: str | os.PathLike,
              on_warning: OnWarning | None = None) -> dict[str, tuple[FileState, ...]]:
    """Every run of `logdir` (as `list_runs` names them) with the state of
    each of its mpprof event files, sorted, from one walk of the logdir.

    What a cache of many runs compares to know which runs changed: reading
    a sweep of 1,000 runs again costs this walk, not 1,000 reads. A file that
    vanished between the listing and its stat is left out.
    """
    logdir = _existing_logdir(logdir)
    warn = on_warning or _log_warning
    runs: dict[str, tuple[FileState, ...]] = {}

    def unlisted(directory: str, error: OSError) -> None:
        warn(f"{directory}: cannot be listed ({filesystem.error_text(error)}); skipped")

    for directory, entries in filesystem.walk(logdir, on_error=unlisted):
        files, others = _event_file_entries(entries)
        for name in others:
            warn(f"{filesystem.join(directory, name)}: {filesystem.Kind.OTHER.value}; skipped")
        states = []
        for name in sorted(files):
            path = filesystem.join(directory, name)
            size, mtime = _listed_state(entries, name, path)
            if size is not None:
                states.append((path, size, mtime))
        if files:
            run = filesystem.relative(directory, logdir)
            for suffix, group in split_writers(states).items():
                runs[run + suffix] = tuple(group)
    return dict(sorted(runs.items()))


# How far apart (seconds) a writer's start (its file name's whole second)
# and an earlier writer's last write may be and still be one after the other.
_START_RESOLUTION_S = 1.0


def split_writers(states: list[FileState]) -> dict[str, list[FileState]]:
    """The event files of one run directory, by the fit that wrote them.

    Each event file is one writer's (its name holds its start time, host,
    pid and a count). Writers one after the other (a later fit into the same
    log_dir) stay one run, under the suffix "". A writer that started while
    an earlier one was still writing (two fits into one log_dir at once) is
    kept apart, never mixed into the same series: its run is named
    `<run>@<host>-<pid>` (and `.<count>` for two in one process).
    """
    groups: dict[str, list[FileState]] = {"": []}
    main_end = float("-inf")
    for state in sorted(states, key=lambda s: _start_time(s[0])):
        start = _start_time(state[0])[0]
        end = state[2] / 1e9 if state[2] is not None else start
        # A file whose name names no writer (not `<time>.<host>.<pid>.<n>`:
        # copied in, or damaged) cannot be told apart: it stays in the run.
        # Nor does it say when a writer was active.
        if len(_writer_fields(state[0])) < 4:
            groups[""].append(state)
            continue
        if start + _START_RESOLUTION_S >= main_end or not groups[""]:
            groups[""].append(state)
            main_end = max(main_end, end)
            continue
        suffix = "@" + _writer_name(state[0])
        if suffix in groups:
            suffix += "." + _writer_count(state[0])
        groups.setdefault(suffix, []).append(state)
    return {suffix: sorted(group) for suffix, group in groups.items() if group}


def _writer_fields(path: str) -> list[str]:
    """[time, host..., pid, count] from `events.out.tfevents.<time>.<host>.<pid>.<n><suffix>`."""
    name = posixpath.basename(path.replace(os.sep, "/"))
    name = name.split("tfevents.", 1)[-1]
    if name.endswith(schema.EVENT_FILE_SUFFIX):
        name = name[: -len(schema.EVENT_FILE_SUFFIX)]
    return name.split(".")


def _writer_name(path: str) -> str:
    fields = _writer_fields(path)
    if len(fields) >= 4:
        return f"{'.'.join(fields[1:-2])}-{fields[-2]}"
    return posixpath.basename(path.replace(os.sep, "/"))


def _writer_count(path: str) -> str:
    return _writer_fields(path)[-1]


def _listed_state(entries: list[filesystem.Entry], name: str,
                  path: str) -> tuple[int | None, int | None]:
    """(size, mtime) of `name`: from the listing where it says (an object
    store lists sizes), else from a stat; (None, None) if it is gone."""
    for entry in entries:
        if entry.name == name and entry.size is not None:
            return entry.size, entry.mtime_ns
    try:
        return filesystem.size_and_mtime(path)
    except OSError:
        return None, None


def event_files(logdir: str | os.PathLike, run: str) -> list[str]:
    """Paths of the mpprof event files of `run` (a name from `list_runs`), sorted.

    Only regular files are listed. Raises NoMpprofDataError for a name that
    is not a run under `logdir` (absolute paths and ".." included) or a run
    without mpprof records, and OSError if its directory cannot be listed.
    """
    logdir = _existing_logdir(logdir)
    directory, _, writer = run.rpartition("@") if "@" in run.rsplit("/", 1)[-1] else (run, "", "")
    try:
        return _writer_files(logdir, run, "")
    except NoMpprofDataError:
        if not writer:
            raise
    # `<run>@<host>-<pid>`: one writer's files of a run written by two fits at once.
    return _writer_files(logdir, directory, "@" + writer)


def _writer_files(logdir: str, run: str, suffix: str) -> list[str]:
    parts = run.split("/")
    # A backslash is an ordinary character of a POSIX or object-store name
    # (`list_runs` lists such runs); only where it separates paths (Windows)
    # could it reach outside the logdir.
    separators = "\\" in run and not filesystem.is_remote(logdir) and (
        os.sep == "\\" or os.altsep == "\\")
    if run.startswith("/") or separators or ".." in parts or "" in parts:
        raise NoMpprofDataError(f"No run {run!r} in {logdir}")
    path = logdir if run == "." else filesystem.join(logdir, run)
    if not filesystem.isdir(path):
        raise NoMpprofDataError(f"No run {run!r} in {logdir}")
    entries = filesystem.scan(path)
    files, _ = _event_file_entries(entries)
    if not files:
        raise NoMpprofDataError(f"Run {run!r} in {logdir} holds no mpprof records")
    states = []
    for name in sorted(files):
        size, mtime = _listed_state(entries, name, filesystem.join(path, name))
        if size is not None:
            states.append((filesystem.join(path, name), size, mtime))
    group = split_writers(states).get(suffix)
    if not group:
        raise NoMpprofDataError(f"No run {run + suffix!r} in {logdir}")
    return [state[0] for state in group]


def _fit_ends(paths: list[str]) -> list[dict]:
    """The fit-end files of the event files `paths` that have one, oldest
    writer first (by the start time in each event file's name)."""
    found = []
    for path in sorted(paths, key=_start_time):
        end = filesystem.join(filesystem.dirname(path),
                              schema.fit_end_name(posixpath.basename(path.replace(os.sep, "/"))))
        try:
            with filesystem.open_file(end) as f:
                value = json.loads(f.read(schema.FIT_END_SIZE * 2))
        except (OSError, ValueError):
            continue  # older logs, or a writer that could not reserve it
        if isinstance(value, dict) and isinstance(value.get("fit_state"), str):
            found.append(value)
    return found


def _start_time(path: str) -> tuple[int, str]:
    """An event file's start time from its name (`...tfevents.<time>....`)."""
    name = posixpath.basename(path.replace(os.sep, "/"))
    parts = name.split("tfevents.", 1)[-1].split(".", 1)
    return (int(parts[0]) if parts[0].isdigit() else 0, name)


def read_run(logdir: str | os.PathLike, run: str) -> Run:
    """Reads one run; raises NoMpprofDataError if it holds no mpprof records.

    Raises:
        NoMpprofDataError: `run` is not a run of `logdir`.
        OSError: the run's directory cannot be listed.
    """
    files = event_files(logdir, run)
    records: dict[str, list[Record]] = {}
    warnings = ReadWarnings()
    for path in files:
        read_event_file(path, records, warnings)
    for found in records.values():
        found.sort(key=lambda r: (r.wall_time, r.step))
    return Run(
        name=run, path=filesystem.dirname(files[0]), records=records, warnings=warnings.lines(),
        fit_ends=_fit_ends(files),
    )


def read_logdir(logdir: str | os.PathLike, on_warning: OnWarning | None = None) -> dict[str, Run]:
    """Reads every mpprof run under `logdir`, keyed by run name.

    A run whose directory became unreadable since it was listed is skipped
    with a warning, like any directory that cannot be listed.
    """
    warn = on_warning or _log_warning
    runs = list_runs(logdir, warn)
    if not runs:
        raise no_runs_error(logdir)
    read = {}
    for name in runs:
        try:
            read[name] = read_run(logdir, name)
        except OSError as e:
            warn(f"run {name}: cannot be read ({filesystem.error_text(e)}); skipped")
        except NoMpprofDataError as e:  # removed since it was listed
            warn(f"run {name}: {e}; skipped")
    return read


def select_runs(logdir: str | os.PathLike, run: str | None = None,
                on_warning: OnWarning | None = None) -> list[str]:
    """The runs of `logdir` (see `list_runs`), or only `run`.

    Raises:
        NoMpprofDataError: `run` is not among them, or there is none at all.
    """
    names = list_runs(logdir, on_warning=on_warning)
    if run is not None:
        if run not in names:
            raise NoMpprofDataError(
                f"No mpprof run {run!r} in {os.fspath(logdir)}; its runs: "
                f"{', '.join(names) or 'none'}"
            )
        names = [run]
    if not names:
        raise no_runs_error(logdir)
    return names


def no_runs_error(logdir: str | os.PathLike) -> NoMpprofDataError:
    """The error for a logdir without mpprof runs, saying how to record one."""
    return NoMpprofDataError(
        f"{os.fspath(logdir)} holds no mpprof records. Record a run with "
        "model.fit(..., callbacks=[mpprof.MixedPrecisionProfiler(log_dir=...)]) "
        "and point mpprof at that log_dir."
    )


def _log_warning(text: str) -> None:
    # Logs end up on terminals: a hostile directory name must not drive one.
    logger.warning("%s", printable(text))


def _event_file_entries(entries: list[filesystem.Entry]) -> tuple[list[str], list[str]]:
    """Names of the mpprof event files among `entries`: (regular files, others)."""
    files, others = [], []
    for entry in entries:
        if _is_mpprof_event_file(entry.name) and entry.kind is not filesystem.Kind.DIRECTORY:
            (files if entry.kind is filesystem.Kind.FILE else others).append(entry.name)
    return files, others


def _is_mpprof_event_file(name: str) -> bool:
    return "tfevents" in name and name.endswith(schema.EVENT_FILE_SUFFIX)


def _existing_logdir(logdir: str | os.PathLike) -> str:
    logdir = os.fspath(logdir)
    try:
        found = filesystem.isdir(logdir)
    except OSError as e:
        raise LogdirNotFoundError(f"Logdir {logdir!r} cannot be read ({e})") from e
    if not found and not filesystem.is_remote(logdir) and os.path.isfile(logdir):
        raise LogdirNotFoundError(
            f"Logdir {logdir!r} is a file, not a directory: pass the log_dir given to "
            "mpprof.MixedPrecisionProfiler (the directory that holds train/)."
        )
    if not found:
        raise LogdirNotFoundError(
            f"Logdir {logdir!r} does not exist: pass the log_dir given to "
            "mpprof.MixedPrecisionProfiler."
        )
    return logdir
