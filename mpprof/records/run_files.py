"""Which runs a logdir holds and which event files make each run.

A run is a directory holding mpprof event files (TensorBoard's run naming),
or, where two fits wrote into one directory at once, each writer's files
(`split_writers`). Listing costs one walk of the logdir: sizes and mtimes
come from the listing, so a cache of many runs learns which changed from it.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
from collections.abc import Callable

from mpprof.records import filesystem, schema
from mpprof.terminal import printable

# Logdir warnings are the reader's, whichever module finds them.
logger = logging.getLogger("mpprof.records.reader")

# Called with each warning about the logdir as a whole (a directory that
# cannot be listed, a file that is not a regular file).
OnWarning = Callable[[str], None]


class LogdirNotFoundError(FileNotFoundError):
    """The logdir does not exist."""


class NoMpprofDataError(LookupError):
    """The logdir exists but holds no mpprof records."""


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


def run_files(logdir: str | os.PathLike, on_warning: OnWarning | None = None,
              listings: filesystem.Listings | None = None) -> dict[str, tuple[FileState, ...]]:
    """Every run of `logdir` (as `list_runs` names them) with the state of
    each of its mpprof event files, sorted, from one walk of the logdir.

    What a cache of many runs compares to know which runs changed: reading
    a sweep of 1,000 runs again costs this walk, not 1,000 reads. A file that
    vanished between the listing and its stat is left out.

    Args:
        listings: directory listings kept between calls (`filesystem.Listings`):
            an unchanged directory costs a stat, not a listing.
    """
    logdir = _existing_logdir(logdir)
    warn = on_warning or log_warning
    runs: dict[str, tuple[FileState, ...]] = {}

    def unlisted(directory: str, error: OSError) -> None:
        warn(f"{filesystem.shown(directory)}: cannot be listed "
             f"({filesystem.error_text(error)}); skipped")

    for directory, entries in filesystem.walk(logdir, unlisted, listings):
        files, others = _event_file_entries(entries)
        for name in others:
            warn(f"{filesystem.shown(filesystem.join(directory, name))}: "
                 f"{filesystem.Kind.OTHER.value}; skipped")
        states = _listed_states(directory, entries, files)
        if files:
            run = filesystem.relative(directory, logdir)
            for suffix, group in split_writers(states).items():
                runs[run + suffix] = tuple(group)
    if listings is not None:
        listings.forget_unvisited()
    return dict(sorted(runs.items()))


def directory_runs(directory: str | os.PathLike) -> dict[str, tuple[FileState, ...]]:
    """The runs whose event files lie in `directory` itself, not below it,
    named relative to it as `run_files` names them: "." and, for fits that
    wrote there at once, ".@<host>-<pid>". One listing, no walk: for a caller
    that knows each run's directory already (TensorBoard's multiplexer).
    Raises OSError if `directory` cannot be listed."""
    directory = os.fspath(directory)
    entries = filesystem.scan(directory)
    files, _ = _event_file_entries(entries)
    if not files:
        return {}
    groups = split_writers(_listed_states(directory, entries, files))
    return {"." + suffix: tuple(group) for suffix, group in sorted(groups.items())}


# How far apart (seconds) a writer's start (its file name's whole second)
# and an earlier writer's last write may be and still be one after the other.
_START_RESOLUTION_S = 1.0


def split_writers(states: list[FileState]) -> dict[str, list[FileState]]:
    """The event files of one run directory, by the fit that wrote them.

    Each event file is one writer's (its name holds its start time, host,
    pid and a count; a remote writer's parts, `schema.part_name`, are one
    file). Writers one after the other (a later fit into the same log_dir)
    stay one run, under the suffix "". A writer that started while an earlier
    one was still writing (two fits into one log_dir at once) is kept apart,
    never mixed into the same series: its run is named `<run>@<host>-<pid>`
    (and `.<count>` for two in one process).
    """
    if len(states) == 1:  # the common case: one local writer
        return {"": list(states)}
    writers: dict[str, list[FileState]] = {}
    for state in states:
        writers.setdefault(_writer_path(state[0]), []).append(state)
    groups: dict[str, list[FileState]] = {"": []}
    main_end = float("-inf")
    for path in sorted(writers, key=_start_time):
        parts = writers[path]
        start = _start_time(path)[0]
        times = [state[2] / 1e9 for state in parts if state[2] is not None]
        end = max(times) if times else start
        # A file whose name names no writer (not `<time>.<host>.<pid>.<n>`:
        # copied in, or damaged) cannot be told apart: it stays in the run.
        # Nor does it say when a writer was active.
        if len(_writer_fields(path)) < 4:
            groups[""].extend(parts)
            continue
        if start + _START_RESOLUTION_S >= main_end or not groups[""]:
            groups[""].extend(parts)
            main_end = max(main_end, end)
            continue
        suffix = "@" + _writer_name(path)
        if suffix in groups:
            suffix += "." + _writer_count(path)
        groups.setdefault(suffix, []).extend(parts)
    return {suffix: sorted(group) for suffix, group in groups.items() if group}


def _writer_path(path: str) -> str:
    """The writer's event file of `path`, an event file or a part of one."""
    _, name = _split(path)
    base = schema.event_file_base(name) or name
    return path if base == name else path[: len(path) - len(name)] + base


def _split(path: str) -> tuple[str, str]:
    name = posixpath.basename(path.replace(os.sep, "/"))
    return path[: len(path) - len(name)], name


def _writer_fields(path: str) -> list[str]:
    """[time, host..., pid, count] from `events.out.tfevents.<time>.<host>.<pid>.<n><suffix>`."""
    name = posixpath.basename(path.replace(os.sep, "/"))
    name = (schema.event_file_base(name) or name).split("tfevents.", 1)[-1]
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


def _listed_states(directory: str, entries: list[filesystem.Entry],
                   names: list[str]) -> list[FileState]:
    """(path, size, mtime) of each file `names` of `directory`, sorted: from
    the listing where it says (a local listing's stat, an object store's
    listing), else from a stat; a file gone since the listing is left out.

    An empty file holds no record: it is left out (not a run, nor a writer
    of one), unless its fit-end file says why its records could not be
    written (a full disk before the first record)."""
    listed = {entry.name: entry for entry in entries}
    states = []
    for name in sorted(names):
        path = filesystem.join(directory, name)
        entry = listed.get(name)
        if entry is not None and entry.size is not None:
            state = (path, entry.size, entry.mtime_ns)
        else:
            try:
                state = (path, *filesystem.size_and_mtime(path))
            except OSError:
                continue
        if state[1] == 0 and not any(end.get("recording_stopped")
                                     for end in fit_ends_of([path])):
            continue
        states.append(state)
    return states


def event_files(logdir: str | os.PathLike, run: str) -> list[str]:
    """Paths of the mpprof event files of `run` (a name from `list_runs`), sorted.

    Only regular files are listed. Raises NoMpprofDataError for a name that
    is not a run under `logdir` (absolute paths and ".." included) or a run
    without mpprof records, and OSError if its directory cannot be listed.
    """
    return [state[0] for state in run_file_states(logdir, run)]


def run_file_states(logdir: str | os.PathLike, run: str) -> list[FileState]:
    """(path, size, mtime) of each mpprof event file of `run`, sorted, from
    one listing of its directory (no request per file on an object store).
    Raises as `event_files`."""
    directory, suffix, groups = _run_groups(_existing_logdir(logdir), run)
    group = groups.get(suffix)
    if not group:
        raise NoMpprofDataError(f"No run {run!r} in {logdir}")
    return group


def writers_of_directory(logdir: str | os.PathLike, run: str) -> tuple[str, dict[str, str]]:
    """(the directory of `run`, relative to `logdir`, {writer id: the writer
    suffix of the run its files belong to} for every writer in it): what
    tells the replay captures of two fits that wrote into one directory at
    once apart (`writer_id`). Raises as `event_files`."""
    directory, _, groups = _run_groups(_existing_logdir(logdir), run)
    return directory, {writer_id(state[0]): suffix
                       for suffix, group in groups.items() for state in group}


def writer_id(path: str) -> str:
    """The id of the writer of an event file (or part): `<time>.<host>.<pid>.<n>`
    from its name (`writer.event_file_name`)."""
    return ".".join(_writer_fields(path))


def _run_groups(logdir: str, run: str) -> tuple[str, str, dict[str, list[FileState]]]:
    """(the run's directory, its writer suffix, the directory's event files by
    writer suffix) for a run name from `list_runs`."""
    directory, _, writer = run.rpartition("@") if "@" in run.rsplit("/", 1)[-1] else (run, "", "")
    try:
        return run, "", _writer_groups(logdir, run)
    except NoMpprofDataError:
        if not writer:
            raise
    # `<run>@<host>-<pid>`: one writer's files of a run written by two fits at once.
    return directory, "@" + writer, _writer_groups(logdir, directory)


def _writer_groups(logdir: str, run: str) -> dict[str, list[FileState]]:
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
    return split_writers(_listed_states(path, entries, files))


def fit_ends_of(paths: list[str]) -> list[dict]:
    """The fit-end files of the event files `paths` that have one, oldest
    writer first (by the start time in each event file's name)."""
    found = []
    for path in sorted({_writer_path(path) for path in paths}, key=_start_time):
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
    name = schema.event_file_base(name) or name
    parts = name.split("tfevents.", 1)[-1].split(".", 1)
    return (int(parts[0]) if parts[0].isdigit() else 0, name)


def log_warning(text: str) -> None:
    """Logs a warning about a logdir (the default `OnWarning`)."""
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
    return schema.event_file_base(name) is not None


def _existing_logdir(logdir: str | os.PathLike) -> str:
    logdir = os.fspath(logdir)
    try:
        found = filesystem.isdir(logdir)
    except OSError as e:
        raise LogdirNotFoundError(
            f"Logdir {filesystem.shown(logdir)!r} cannot be read ({filesystem.error_text(e)})"
        ) from e
    if not found and not filesystem.is_remote(logdir) and os.path.isfile(logdir):
        raise LogdirNotFoundError(
            f"Logdir {logdir!r} is a file, not a directory: pass the log_dir given to "
            "mpprof.MixedPrecisionProfiler (the directory that holds train/)."
        )
    if not found:
        raise LogdirNotFoundError(
            f"Logdir {filesystem.shown(logdir)!r} does not exist: pass the log_dir given to "
            "mpprof.MixedPrecisionProfiler."
        )
    return logdir
