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

import os

from mpprof.records import filesystem
from mpprof.records.event_file import ReadWarnings, Record, read_event_file
from mpprof.records.float8 import Float8
from mpprof.records.run import Run
from mpprof.records.run_files import (
    FileState,
    LogdirNotFoundError,
    NoMpprofDataError,
    OnWarning,
    directory_runs,
    event_files,
    fit_ends_of,
    list_runs,
    log_warning,
    run_file_states,
    run_files,
)
from mpprof.records.views import Gpu, LossScale, Numerics

__all__ = [
    "Float8",
    "Gpu",
    "LogdirNotFoundError",
    "LossScale",
    "NoMpprofDataError",
    "Numerics",
    "OnWarning",
    "FileReads",
    "Record",
    "Run",
    "directory_runs",
    "event_files",
    "run_files",
    "list_runs",
    "no_runs_error",
    "read_logdir",
    "read_run",
    "run_file_states",
    "select_runs",
]

class FileReads:
    """What each event file of a run held when last read, by path, with the
    size and mtime it was read at: a run read again with the same
    `FileReads` reads only the files that changed since (on an object store,
    the new parts: one request each; the others are not fetched again)."""

    def __init__(self):
        self._files: dict[str, tuple[int, int | None, dict[str, list[Record]],
                                     ReadWarnings]] = {}

    def read(self, states: list[FileState]) -> tuple[dict[str, list[Record]], ReadWarnings]:
        """The records and warnings of the files `states`, joined in order;
        forgets every other file."""
        records: dict[str, list[Record]] = {}
        warnings = ReadWarnings()
        kept = {}
        changed = [path for path, size, mtime in states
                   if self._files.get(path, (None, None))[:2] != (size, mtime)]
        fetched = _Fetched(changed)
        for path, size, mtime in states:
            found = self._files.get(path)
            if found is None or found[:2] != (size, mtime):
                own: dict[str, list[Record]] = {}
                own_warnings = ReadWarnings()
                read_event_file(path, own, own_warnings, fetched.take(path))
                found = (size, mtime, own, own_warnings)
            kept[path] = found
            for key, values in found[2].items():
                records.setdefault(key, []).extend(values)
            warnings.merge(found[3])
        self._files = kept
        return records, warnings


class _Fetched:
    """The remote files of `paths` fetched a batch at a time
    (`filesystem.fetch_all`), taken in the same order."""

    def __init__(self, paths: list[str]):
        self._found = filesystem.fetch_all(paths)

    def take(self, path: str) -> bytes | OSError | None:
        """`path`'s bytes (or error); None for a local file (opened by the reader)."""
        if not filesystem.is_remote(path):
            return None
        found, value = next(self._found, (None, None))
        if found != path:  # never: the same order; read it alone then
            return None
        return value


def read_run(logdir: str | os.PathLike, run: str, reuse: FileReads | None = None) -> Run:
    """Reads one run; raises NoMpprofDataError if it holds no mpprof records.

    Args:
        reuse: keeps each file's records between reads of this run (see
            `FileReads`); by default every file is read.

    Raises:
        NoMpprofDataError: `run` is not a run of `logdir`.
        OSError: the run's directory cannot be listed.
    """
    states = run_file_states(logdir, run)
    files = [state[0] for state in states]
    if reuse is not None:
        records, warnings = reuse.read(states)
    else:
        records = {}
        warnings = ReadWarnings()
        fetched = _Fetched(files)
        for path in files:
            read_event_file(path, records, warnings, fetched.take(path))
    for found in records.values():
        found.sort(key=lambda r: (r.wall_time, r.step))
    path = filesystem.dirname(files[0])
    directory = filesystem.relative(path, os.fspath(logdir))
    return Run(
        name=run, path=path, records=records, warnings=warnings.lines(),
        fit_ends=fit_ends_of(files),
        writer_suffix=run[len(directory):] if run.startswith(directory) else "",
        losses=list(warnings.losses.values()),
    )


def read_logdir(logdir: str | os.PathLike, on_warning: OnWarning | None = None) -> dict[str, Run]:
    """Reads every mpprof run under `logdir`, keyed by run name.

    A run whose directory became unreadable since it was listed is skipped
    with a warning, like any directory that cannot be listed.
    """
    warn = on_warning or log_warning
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
                f"No mpprof run {run!r} in {filesystem.shown(os.fspath(logdir))}; its runs: "
                f"{', '.join(names) or 'none'}"
            )
        names = [run]
    if not names:
        raise no_runs_error(logdir)
    return names


def no_runs_error(logdir: str | os.PathLike) -> NoMpprofDataError:
    """The error for a logdir without mpprof runs, saying how to record one."""
    return NoMpprofDataError(
        f"{filesystem.shown(os.fspath(logdir))} holds no mpprof records. Record a run with "
        "model.fit(..., callbacks=[mpprof.MixedPrecisionProfiler(log_dir=...)]) "
        "and point mpprof at that log_dir."
    )
