"""Runs read through `mpprof.records.reader`, cached until their event files change.

Reading a large run takes seconds; a dashboard asks for it on every route,
and a sweep holds hundreds of runs. Two tiers, both keyed by each run's
signature (the path, size and mtime of each of its mpprof event files, all
from one walk of the logdir, `reader.run_files`):

- the run list's summary of every run (a few hundred bytes each) is kept for
  as long as the run is unchanged, whatever the number of runs, so `/runs`
  re-reads only the runs that changed since the last request;
- a run's full read and the payloads derived from it (findings, downsampled
  matrices) are kept in a least-recently-used cache bounded by their
  estimated memory (`MPPROF_CACHE_MB`, 1 GiB by default), not by a count.

The first read of many runs says how far it got in TensorBoard's log.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable

from tensorboard import errors

from mpprof.records import filesystem, reader
from mpprof.terminal import printable
from tensorboard_plugin_mpprof.run_sources import LogdirRuns, MultiplexerRuns
from tensorboard_plugin_mpprof.summary_store import SummaryStore

logger = logging.getLogger(__name__)

# {run: the state of each of its files} -> {run: its summary} (`run_digest.load_many`).
Digests = Callable[[dict[str, tuple]], dict[str, dict]]

# Listing runs walks the whole logdir; every route validates its run name
# against the listing, so it is reused for this long.
_RUN_LIST_TTL_S = 2.0
# A read run takes about this many bytes of memory per byte of event files
# (numpy arrays plus the records' Python objects), payloads included.
_MEMORY_PER_FILE_BYTE = 3
_DEFAULT_BUDGET_MB = 1024
# The first read of at least this many runs logs its progress, at most once
# per this many seconds.
_PROGRESS_RUNS = 20
_PROGRESS_EVERY_S = 5.0


class CachedRun:
    """One read of a run and what was derived from it (the latest few)."""

    # Derived payloads kept per run: a handful of views and screen sizes.
    MAX_DERIVED = 64

    def __init__(self, run: reader.Run, signature: tuple, files: reader.FileReads):
        self.run = run
        self.signature = signature
        # Each event file's records, so the next read of this run reads only
        # the files that changed (a remote run's new parts).
        self.files = files
        self.bytes = _MEMORY_PER_FILE_BYTE * sum(size for _, size, _ in signature) + 64_000
        self._derived: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def derive(self, key: Hashable, compute: Callable[[reader.Run], object]):
        """`compute(run)`, computed once per key for this read of the run."""
        with self._lock:
            if key not in self._derived:
                self._derived[key] = compute(self.run)
                while len(self._derived) > self.MAX_DERIVED:
                    self._derived.popitem(last=False)
            self._derived.move_to_end(key)
            return self._derived[key]


class RunCache:
    """Reads runs of `logdir` on demand.

    Args:
        logdir: the logdir TensorBoard serves (local or a URL), or where the
            runs are when there is none (`run_sources`: `--logdir_spec`).
        budget_bytes: the memory the full reads may take together (the most
            recent run is kept whatever its size); default `MPPROF_CACHE_MB`
            MiB, else 1 GiB.
    """

    def __init__(self, logdir: str | LogdirRuns | MultiplexerRuns,
                 budget_bytes: int | None = None):
        self._source = LogdirRuns(logdir) if isinstance(logdir, str) else logdir
        self.logdir = self._source.logdir
        if budget_bytes is None:
            budget_bytes = int(os.environ.get("MPPROF_CACHE_MB", _DEFAULT_BUDGET_MB)) * 2**20
        self._budget = budget_bytes
        self._runs: collections.OrderedDict[str, CachedRun] = collections.OrderedDict()
        self._bytes = 0
        # Run -> (signature, summary, the summary as JSON text); those saved by
        # an earlier TensorBoard on this logdir are trusted while their run's
        # files are unchanged (`summary_store`).
        self._store = SummaryStore(self.logdir)
        self._summaries: dict[str, tuple[tuple, dict, str]] = self._store.load()
        self._run_locks: dict[str, threading.Lock] = collections.defaultdict(threading.Lock)
        self._lock = threading.Lock()
        self._listing: tuple[float, dict[str, tuple]] = (float("-inf"), {})
        self._warned: set[str] = set()
        # Listings of the logdir's directories, kept while each is unchanged.
        self._listings = filesystem.Listings()

    def _files(self, fresh: bool = False) -> dict[str, tuple]:
        """Every run with its signature, from a walk at most `_RUN_LIST_TTL_S`
        old (`fresh`: walked now)."""
        listed_at, runs = self._listing
        if fresh or time.monotonic() - listed_at > _RUN_LIST_TTL_S:
            runs = self._source.runs(self._warn_once, self._listings)
            self._listing = (time.monotonic(), runs)
        return runs

    def list_runs(self) -> list[str]:
        return list(self._files())

    def _warn_once(self, warning: str) -> None:
        """Logs a listing warning (an unreadable directory) once, not at
        every listing."""
        if warning not in self._warned:
            self._warned.add(warning)
            logger.warning("mpprof: %s", printable(warning))

    def summaries(self, summarize: Callable[[CachedRun], dict],
                  digests: Digests | None = None) -> list[dict]:
        """`summarize(run)` of every run, computed again only for runs whose
        files changed; unreadable runs are left out (logged once).

        Args:
            digests: {run: its summary} of the runs (given with the state of
                each's files) whose summary their fit wrote and that still
                holds for those files (`run_digest.load_many`): those runs
                are not read.
        """
        return [entry[1] for entry in self._summary_entries(summarize, digests)]

    def summaries_json(self, summarize: Callable[[CachedRun], dict],
                       digests: Digests | None = None) -> str:
        """`{"runs": summaries(summarize, digests)}` as JSON text: each run's
        summary is serialised once, when computed, not at every request."""
        entries = self._summary_entries(summarize, digests)
        return '{"runs": [' + ", ".join(e[2] for e in entries) + "]}"

    def _summary_entries(self, summarize: Callable[[CachedRun], dict],
                         digests: Digests | None) -> list[tuple]:
        # Walked now: the run list is what a page load asks first, and it
        # must not list a run removed (or locked) a moment ago.
        files = self._files(fresh=True)
        stale = [name for name, signature in files.items()
                 if self._summaries.get(name, (None,))[0] != signature]
        changed = bool(stale)
        if stale and digests is not None:
            for name, summary in digests({name: files[name] for name in stale}).items():
                text = json.dumps(summary, allow_nan=False)
                with self._lock:
                    self._summaries[name] = (files[name], summary, text)
            stale = [name for name in stale if self._summaries.get(name, (None,))[0]
                     != files[name]]
        progress = _Progress(len(stale)) if len(stale) >= _PROGRESS_RUNS else None
        for index, name in enumerate(stale):
            if progress is not None:
                progress.step(index)
            try:
                cached = self.get(name, files)  # not a walk per run
            except errors.NotFoundError as e:
                self._warn_once(f"run {name} left out of the run list: {e}")
                continue
            summary = summarize(cached)
            text = json.dumps(summary, allow_nan=False)
            with self._lock:
                self._summaries[name] = (cached.signature, summary, text)
        if progress is not None:
            progress.done()
        with self._lock:
            removed = set(self._summaries) - set(files)
            for name in removed:
                del self._summaries[name]
            kept = dict(self._summaries)
        if changed or removed:
            self._store.save(kept)
        return [kept[name] for name in files if name in kept]

    def get(self, run: str | None, listed: dict[str, tuple] | None = None) -> CachedRun:
        """The run named `run`; NotFoundError unless the logdir lists it.

        Only names from the listing reach the file system, so a run name
        cannot point outside the logdir.
        """
        if not run:
            raise errors.InvalidArgumentError("Missing query parameter: run")
        files = listed if listed is not None else self._files()
        if run not in files:
            raise errors.NotFoundError(f"No mpprof run named {run!r}")
        with self._run_locks[run]:
            # The run's own files, stat'ed now: a view reloaded while the fit
            # writes shows the new data at once, not after the listing's reuse.
            signature = self._signature(run)
            with self._lock:
                cached = self._runs.get(run)
            if cached is None or cached.signature != signature:
                files = cached.files if cached is not None else reader.FileReads()
                try:
                    read = reader.read_run(*self._source.locate(run), files)
                    read.name = run  # TensorBoard's name, where it names runs itself
                    cached = CachedRun(read, signature, files)
                except reader.NoMpprofDataError as e:
                    raise _unreadable(run, e) from e
                except OSError as e:
                    raise _unreadable(run, e) from e
            self._keep(run, cached)
            return cached

    def _signature(self, run: str) -> tuple:
        """Path, size and mtime of each of the run's mpprof event files, from
        one listing of its directory (not a request per file)."""
        try:
            return tuple(reader.run_file_states(*self._source.locate(run)))
        except (reader.NoMpprofDataError, OSError) as e:
            raise _unreadable(run, e) from e

    def _keep(self, run: str, cached: CachedRun) -> None:
        """Puts `cached` first; drops the least recent full reads over budget."""
        with self._lock:
            previous = self._runs.pop(run, None)
            if previous is not None:
                self._bytes -= previous.bytes
            self._runs[run] = cached
            self._bytes += cached.bytes
            while self._bytes > self._budget and len(self._runs) > 1:
                _, dropped = self._runs.popitem(last=False)
                self._bytes -= dropped.bytes

    @property
    def cached_bytes(self) -> int:
        """The estimated memory of the full reads kept now."""
        return self._bytes


class _Progress:
    """Progress of a first read of many runs, in TensorBoard's log."""

    def __init__(self, total: int):
        self._total = total
        self._start = self._last = time.monotonic()
        logger.warning("mpprof: reading %d runs (the first read; later ones read only "
                       "what changed)", total)

    def step(self, index: int) -> None:
        now = time.monotonic()
        if now - self._last >= _PROGRESS_EVERY_S:
            self._last = now
            logger.warning("mpprof: read %d of %d runs (%.0f s)", index, self._total,
                           now - self._start)

    def done(self) -> None:
        logger.warning("mpprof: read %d runs in %.1f s", self._total,
                       time.monotonic() - self._start)


def _unreadable(run: str, error: Exception) -> errors.NotFoundError:
    """A run that was listed but cannot be read now (permissions changed, or
    it was removed): a 404 saying why, and a line in TensorBoard's log."""
    logger.warning("mpprof: run %r cannot be read: %s", run, printable(error))
    reason = error.strerror if isinstance(error, OSError) and error.strerror else error
    return errors.NotFoundError(f"mpprof run {run!r} cannot be read ({reason})")
