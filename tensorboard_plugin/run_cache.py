"""Runs read through `mpprof.records.reader`, cached until their event files change.

Reading a large run takes seconds; a dashboard asks for it on every route. A
run is read again only when one of its mpprof event files changed size or
mtime, so reloading while training runs shows new data and costs nothing
otherwise. Payloads derived from a run (findings, downsampled matrices) are
cached with it and dropped with it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Hashable

from tensorboard import errors

from mpprof.records import filesystem, reader
from mpprof.display.terminal import printable

logger = logging.getLogger(__name__)

# Listing runs walks the whole logdir; every route validates its run name
# against the listing, so it is reused for this long.
_RUN_LIST_TTL_S = 2.0


class CachedRun:
    """One read of a run and what was derived from it (the latest few)."""

    # Derived payloads kept per run: a handful of views and screen sizes.
    MAX_DERIVED = 64

    def __init__(self, run: reader.Run, signature: tuple):
        self.run = run
        self.signature = signature
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
    """Reads runs of `logdir` on demand; keeps the `max_runs` most recent."""

    def __init__(self, logdir: str, max_runs: int = 16):
        self.logdir = logdir
        self._max_runs = max_runs
        self._runs: collections.OrderedDict[str, CachedRun] = collections.OrderedDict()
        self._run_locks: dict[str, threading.Lock] = collections.defaultdict(threading.Lock)
        self._lock = threading.Lock()
        self._listing: tuple[float, list[str]] = (float("-inf"), [])
        self._warned: set[str] = set()

    def list_runs(self) -> list[str]:
        listed_at, runs = self._listing
        if time.monotonic() - listed_at > _RUN_LIST_TTL_S:
            try:
                runs = reader.list_runs(self.logdir, self._warn_once) if self.logdir else []
            except reader.LogdirNotFoundError:
                runs = []
            self._listing = (time.monotonic(), runs)
        return runs

    def _warn_once(self, warning: str) -> None:
        """Logs a listing warning (an unreadable directory) once, not at
        every listing."""
        if warning not in self._warned:
            self._warned.add(warning)
            logger.warning("mpprof: %s", printable(warning))

    def get(self, run: str | None) -> CachedRun:
        """The run named `run`; NotFoundError unless the logdir lists it.

        Only names from the listing reach the file system, so a run name
        cannot point outside the logdir.
        """
        if not run:
            raise errors.InvalidArgumentError("Missing query parameter: run")
        if run not in self.list_runs():
            raise errors.NotFoundError(f"No mpprof run named {run!r}")
        with self._run_locks[run]:
            signature = self._signature(run)
            with self._lock:
                cached = self._runs.get(run)
            if cached is None or cached.signature != signature:
                try:
                    cached = CachedRun(reader.read_run(self.logdir, run), signature)
                except reader.NoMpprofDataError as e:
                    raise errors.NotFoundError(str(e)) from e
                except OSError as e:
                    raise _unreadable(run, e) from e
            with self._lock:
                self._runs[run] = cached
                self._runs.move_to_end(run)
                while len(self._runs) > self._max_runs:
                    self._runs.popitem(last=False)
            return cached

    def _signature(self, run: str) -> tuple:
        """Name, size and mtime of each of the run's mpprof event files."""
        try:
            paths = reader.event_files(self.logdir, run)
            return tuple((path, *filesystem.size_and_mtime(path)) for path in paths)
        except reader.NoMpprofDataError as e:
            raise errors.NotFoundError(str(e)) from e
        except OSError as e:
            raise _unreadable(run, e) from e


def _unreadable(run: str, error: OSError) -> errors.NotFoundError:
    """A run that was listed but cannot be read now (permissions changed, or
    it was removed): a 404 saying why, and a line in TensorBoard's log."""
    logger.warning("mpprof: run %r cannot be read: %s", run, printable(error))
    return errors.NotFoundError(f"mpprof run {run!r} cannot be read ({error.strerror or error})")
