"""Where a logdir lives: local paths through `os`, remote ones through fsspec.

Reading and writing both go through here, and nothing here imports a
framework: local paths (anything without a `scheme://`) use the standard
library; any URL (`s3://`, `gs://`, `az://`, `memory://`, ...) goes through
fsspec, with the file system of its scheme (`s3fs`, `gcsfs`: the extras
`mpprof[s3]`, `mpprof[gcs]`). Credentials and endpoints are the file system's
own business, found as botocore/s3fs find them (`AWS_ENDPOINT_URL`,
`AWS_PROFILE`, the instance role, ...); mpprof never reads, passes or logs a
secret. A URL that carries a password (`ftp://user:secret@host/`) is shown
with the password masked (`shown`).

Object stores cannot append, so a remote writer never appends: it writes one
new object per flush (`mpprof.records.writer`), and listings give each
object's size and modification time, so a reader re-fetches only what
changed. Every failure surfaces as an `OSError`, so callers handle one kind
of error whatever the file system.

Every remote call has a deadline (`remote_deadline_s`, plus time for the
bytes it sends): a store that accepts connections but never answers raises
`NoAnswerError` then instead of waiting for ever (fsspec's own calls have no
deadline). S3 requests also get botocore's connect and read timeouts and a
bounded number of retries, where the user's fsspec configuration sets none.

TensorFlow's file systems (`tf.io.gfile`) are not used, not even as a
fallback: the records import no framework, and fsspec serves every scheme
gfile did (hdfs:// through pyarrow); a scheme no installed fsspec file
system serves is one line saying so.
"""

from __future__ import annotations

import copy
import datetime
import enum
import errno
import io
import os
import posixpath
import re
import stat
import threading
import time
from collections.abc import Callable, Iterator
from typing import BinaryIO, NamedTuple


class Kind(enum.Enum):
    DIRECTORY = "directory"
    FILE = "regular file"
    # Anything else a directory can hold: a FIFO, socket or device (opening
    # one may block forever), a dangling symlink.
    OTHER = "neither a regular file nor a directory"


class Entry(NamedTuple):  # a tuple: a listing of thousands of runs builds many
    name: str
    kind: Kind
    is_symlink: bool = False
    # From the listing itself (a local listing's stat, an object store's
    # listing): the file's size and modification time, None where unknown.
    size: int | None = None
    mtime_ns: int | None = None


def is_remote(path: str) -> bool:
    """Whether `path` names a remote file system (has a `scheme://`)."""
    return "://" in path


_PASSWORD = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://[^/@:]*):[^/@]*@")


def shown(path: str) -> str:
    """`path` as it may be shown or logged: a password in a URL masked."""
    return _PASSWORD.sub(r"\1:***@", path)


def error_text(error: OSError) -> str:
    """What went wrong, in words, without the path the caller already shows."""
    return shown(error.strerror or str(error))


def join(directory: str, *names: str) -> str:
    return posixpath.join(directory, *names) if is_remote(directory) else os.path.join(
        directory, *names
    )


def dirname(path: str) -> str:
    return posixpath.dirname(path) if is_remote(path) else os.path.dirname(path)


def relative(path: str, root: str) -> str:
    """`path` relative to `root`, with "/" separators ("." for root itself)."""
    if path == root:
        return "."
    prefix = root.rstrip("/" if is_remote(root) else os.sep)
    separator = "/" if is_remote(root) else os.sep
    if path.startswith(prefix + separator):  # a walk's directories: no normalising
        return path[len(prefix) + 1:].replace(os.sep, "/")
    if is_remote(root):
        return posixpath.relpath(path, root)
    return os.path.relpath(path, root).replace(os.sep, "/")


def isdir(path: str) -> bool:
    if is_remote(path):
        fs, inner = _remote(path)
        _call(fs.invalidate_cache, inner)
        return bool(_call(fs.isdir, inner))
    return os.path.isdir(path)


def scan(directory: str) -> list[Entry]:
    """The entries of `directory`, symlinks followed to say what they are,
    each with its size and modification time from the same listing.

    Raises:
        OSError: the directory cannot be listed.
    """
    if is_remote(directory):
        return _remote_scan(directory)
    with os.scandir(directory) as entries:
        return [_local_entry(entry) for entry in entries]


def _local_entry(entry: os.DirEntry) -> Entry:
    symlink = _is_symlink(entry)
    if not symlink and entry.is_dir(follow_symlinks=False):  # from the listing: no stat
        return Entry(entry.name, Kind.DIRECTORY)
    try:
        found = entry.stat()  # follows symlinks; cached by the DirEntry
    except OSError:  # a dangling symlink, or a target we may not stat
        return Entry(entry.name, Kind.OTHER, symlink)
    mode = found.st_mode
    if stat.S_ISDIR(mode):
        return Entry(entry.name, Kind.DIRECTORY, symlink)
    if stat.S_ISREG(mode):
        return Entry(entry.name, Kind.FILE, symlink, found.st_size, found.st_mtime_ns)
    return Entry(entry.name, Kind.OTHER, symlink)


def _is_symlink(entry: os.DirEntry) -> bool:
    try:
        return entry.is_symlink()
    except OSError:
        return False


class Listings:
    """Listings of local directories kept between walks (`walk`'s `listings`).

    A directory's entries change only with its mtime (an entry added, removed
    or renamed); a file's size does not. A kept listing is used again, for
    the cost of one stat, while its directory's mtime and ctime (which a
    chmod changes too) are unchanged, and only when the directory had not
    changed for `SETTLED_NS` before it was listed
    (a change within the same mtime tick as the listing could go unseen:
    git's "racily clean" rule). Its files are given without size or mtime,
    so the reader stats the event files it needs. Directories holding a
    symlink are always listed (the target may change under an unchanged
    parent). Remote listings are never kept: the store's listing is the check.
    """

    SETTLED_NS = 2_000_000_000

    def __init__(self):
        self._kept: dict[str, tuple[tuple[int, int], list[Entry]]] = {}
        self._visited: set[str] = set()
        self._lock = threading.Lock()  # walks of concurrent requests

    def scan(self, directory: str) -> list[Entry]:
        """`scan(directory)`, or its kept listing if still valid; raises OSError."""
        if is_remote(directory):
            return scan(directory)
        found = os.stat(directory)
        mtime = found.st_mtime_ns
        key = (mtime, found.st_ctime_ns)
        with self._lock:
            self._visited.add(directory)
            kept = self._kept.get(directory)
        if kept is not None and kept[0] == key:
            return kept[1]
        entries = scan(directory)
        settled = (time.time_ns() - mtime > self.SETTLED_NS
                   and not any(e.is_symlink for e in entries))
        with self._lock:
            if settled:
                self._kept[directory] = (key, [
                    e._replace(size=None, mtime_ns=None) if e.kind is Kind.FILE else e
                    for e in entries])
            else:
                self._kept.pop(directory, None)
        return entries

    def forget_unvisited(self) -> None:
        """Drops the listings of directories the last walk did not reach."""
        with self._lock:
            for directory in set(self._kept) - self._visited:
                del self._kept[directory]
            self._visited = set()


def walk(root: str, on_error: Callable[[str, OSError], None],
         listings: Listings | None = None) -> Iterator[tuple[str, list[Entry]]]:
    """Every directory under `root` (itself included) with its entries.

    Each directory is visited once: a directory symlink that points back into
    the walk (`self -> .`) is not followed, and a directory reached again by
    another symlink (its real path seen before) is skipped, so symlink loops
    neither hang nor list a run twice. Symlinks to directories outside the
    walk are followed. A directory that cannot be listed is passed to
    `on_error` and skipped; the walk goes on.

    Args:
        root: the directory to walk (local or remote).
        on_error: called with the directory and the error of each directory
            that cannot be listed.
        listings: listings kept from earlier walks (see `Listings`).
    """
    remote = is_remote(root)
    root_real = root if remote else os.path.realpath(root)
    seen = {root_real}
    # Each directory with its real path: a child that is no symlink is its
    # parent's real path joined with its name (no realpath per directory).
    pending = [(root, root_real)]
    while pending:
        directory, directory_real = pending.pop()
        try:
            entries = scan(directory) if listings is None else listings.scan(directory)
        except OSError as e:
            on_error(directory, e)
            continue
        yield directory, entries
        for entry in sorted(entries, key=lambda e: e.name, reverse=True):
            if entry.kind is not Kind.DIRECTORY:
                continue
            path = join(directory, entry.name)
            if remote or not entry.is_symlink:
                real = path if remote else os.path.join(directory_real, entry.name)
            else:
                real = os.path.realpath(path)
            inside = real == root_real or real.startswith(root_real.rstrip(os.sep) + os.sep)
            if real in seen or (entry.is_symlink and inside):
                continue
            seen.add(real)
            pending.append((path, real))


def size_and_mtime(path: str) -> tuple[int, int]:
    """(size in bytes, modification time in ns) of a file; raises OSError."""
    if is_remote(path):
        fs, inner = _remote(path)
        info = _call(fs.info, inner)
        return int(info.get("size") or 0), _mtime_ns(info)
    found = os.stat(path)
    return found.st_size, found.st_mtime_ns


def open_file(path: str, large: bool = False) -> BinaryIO:
    """Opens a regular file for reading; raises OSError for anything else.

    A local path is opened without blocking and checked on the open file, so
    a FIFO named like an event file is refused instead of waiting forever for
    a writer. A remote file is fetched whole, in one request (event file
    parts are small; a file is read to its end anyway); a `large` one (a
    replay capture's weights) is asked its size first, so that its deadline
    allows for its bytes.
    """
    if is_remote(path):
        fs, inner = _remote(path)
        size = int(_call(fs.size, inner) or 0) if large else 0
        return io.BytesIO(_call(fs.cat_file, inner, sent=size))
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise OSError(f"{path} is {Kind.OTHER.value}")
        if hasattr(os, "set_blocking"):
            os.set_blocking(descriptor, True)
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


# Remote files fetched together, at most this many at once in memory.
_FETCH_BATCH = 128


def fetch_all(paths: list[str]) -> Iterator[tuple[str, bytes | OSError]]:
    """(path, its bytes or why it could not be read) of each remote file of
    `paths` (all on one file system, as a run's files are), in order,
    fetched concurrently where the file system can (s3fs and gcsfs fetch a
    batch at once: a run of thousands of parts is not thousands of round
    trips one after the other). Local paths are left out."""
    remote = [path for path in paths if is_remote(path)]
    for start in range(0, len(remote), _FETCH_BATCH):
        batch = remote[start:start + _FETCH_BATCH]
        try:
            fs, _ = _remote(batch[0])
            inner = [_remote(path)[1] for path in batch]
            found = _call(fs.cat, inner, False, "return")
        except OSError:
            found = {}
        for path, key in zip(batch, inner if found else batch, strict=True):
            value = found.get(key) if isinstance(found, dict) else None
            if isinstance(value, bytes):
                yield path, value
                continue
            try:  # not in the batch's answer (a name fsspec read as a glob): alone
                yield path, open_file(path).read()
            except OSError as e:
                yield path, e


def makedirs(path: str) -> None:
    """Creates the directory `path` and its parents; raises OSError.

    On an object store, where folders are only prefixes, this checks that
    the bucket exists and can be reached; it never creates one: a missing
    bucket is a typo far more often than a wish (FileNotFoundError)."""
    if not is_remote(path):
        os.makedirs(path, exist_ok=True)
        return
    fs, inner = _remote(path)
    split = getattr(fs, "split_path", None)  # s3fs, gcsfs, adlfs: bucket/key
    if split is None:
        _call(fs.makedirs, inner, True)
        return
    bucket = split(inner)[0]
    try:
        _call(fs.info, bucket)
    except FileNotFoundError as e:
        raise FileNotFoundError(
            errno.ENOENT, f"the bucket {bucket!r} does not exist (mpprof creates no "
            "buckets: create it, or check the name)") from e


def open_append(path: str) -> BinaryIO:
    """Opens a local file for writing at its end (created if missing);
    raises OSError. Remote files are never appended to: see the module
    docstring and `write_bytes`."""
    if is_remote(path):
        raise OSError(f"{shown(path)}: remote files are written whole, never appended to")
    return open(path, "ab")


def write_bytes(path: str, data: bytes) -> None:
    """Writes `data` as the whole file `path` (one object, one request on an
    object store); raises OSError."""
    if is_remote(path):
        fs, inner = _remote(path)
        _call(fs.pipe_file, inner, bytes(data), sent=len(data))
        return
    with open(path, "wb") as f:
        f.write(data)


def overwrite_bytes(path: str, data: bytes) -> None:
    """Writes `data` at the start of the file `path`, in place where the file
    exists (its blocks reused: no new space needed when `data` is no longer
    than the file), else as a new file; raises OSError."""
    if is_remote(path):
        write_bytes(path, data)
        return
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
    with os.fdopen(descriptor, "wb") as f:
        f.write(data)


# Remote file systems (fsspec) --------------------------------------------

# The extra that brings each scheme's file system, for the error message.
_EXTRAS = {"s3": "mpprof[s3]", "s3a": "mpprof[s3]", "gs": "mpprof[gcs]", "gcs": "mpprof[gcs]"}


def _remote(url: str):
    """(fsspec file system, its path) for `url`; OSError when no file system
    serves the scheme."""
    scheme = url.split("://", 1)[0]
    try:
        import fsspec.core
    except ImportError as e:  # a base dependency; only a broken install lacks it
        raise OSError(f"{scheme}:// paths need fsspec: pip install fsspec ({e})") from e
    try:
        return fsspec.core.url_to_fs(url, **_options(scheme))
    except ImportError as e:
        extra = _EXTRAS.get(scheme.lower())
        hint = f'pip install "{extra}"' if extra else "install the fsspec file system of it"
        raise OSError(f"{scheme}:// needs a package that is not installed: {hint} ({e})") \
            from e
    except ValueError as e:  # "Protocol not known"
        raise OSError(f"no file system serves {scheme}:// (fsspec: {e})") from e


def _remote_scan(directory: str) -> list[Entry]:
    fs, inner = _remote(directory)
    _call(fs.invalidate_cache, inner)  # a listing is always the store's, now
    base = inner.rstrip("/")
    entries = []
    for info in _call(fs.ls, inner, True):
        full = str(info.get("name", "")).rstrip("/")
        name = full.rsplit("/", 1)[-1]
        if not name or full == base:  # the folder's own placeholder object
            continue
        kind = {"directory": Kind.DIRECTORY, "file": Kind.FILE}.get(info.get("type"), Kind.OTHER)
        if kind is Kind.FILE:
            entries.append(Entry(name, kind, False, int(info.get("size") or 0), _mtime_ns(info)))
        else:
            entries.append(Entry(name, kind))
    return entries


def _mtime_ns(info: dict) -> int:
    """A listed object's modification time in ns (0 when the store gives none)."""
    for key in ("LastModified", "mtime", "updated", "last_modified", "created", "modified"):
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, datetime.datetime):
            if value.tzinfo is None:
                value = value.replace(tzinfo=datetime.timezone.utc)
            return int(value.timestamp() * 1e9)
        if isinstance(value, (int, float)):
            return int(value * 1e9)
        try:
            parsed = datetime.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
        except ValueError:
            continue
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=datetime.timezone.utc)
        return int(parsed.timestamp() * 1e9)
    return 0


# How long a remote call may go unanswered, in seconds (the environment
# variable overrides it); a call that sends data gets `_SLOWEST_UPLOAD`'s
# time for its bytes on top.
DEADLINE_VARIABLE = "MPPROF_REMOTE_DEADLINE_S"
DEFAULT_DEADLINE_S = 20.0
_SLOWEST_UPLOAD = 1 << 20  # bytes per second

# botocore's settings for S3 requests where the user's fsspec configuration
# has none: botocore's defaults (60 s to read, 4 retries, times s3fs's own 5)
# let one hung request take many minutes in the background.
_S3_CONFIG = {"connect_timeout": 5, "read_timeout": 10,
              "retries": {"total_max_attempts": 3, "mode": "standard"}}


class NoAnswerError(TimeoutError):
    """A remote file system did not answer a call within its deadline."""


def remote_deadline_s() -> float:
    """How long a remote call may go unanswered (`MPPROF_REMOTE_DEADLINE_S`,
    default 20 s), before the time allowed for the bytes it sends."""
    try:
        value = float(os.environ.get(DEADLINE_VARIABLE, DEFAULT_DEADLINE_S))
    except ValueError:
        return DEFAULT_DEADLINE_S
    return value if value > 0 else DEFAULT_DEADLINE_S


def _options(scheme: str) -> dict:
    """The storage options mpprof adds for `scheme`: S3's timeouts, under
    whatever the user's fsspec configuration sets."""
    if scheme.lower() not in ("s3", "s3a"):
        return {}
    import fsspec.config

    configured = fsspec.config.conf.get(scheme.lower(), {}).get("config_kwargs") or {}
    # A copy each time: botocore rewrites the retries it is given.
    return {"config_kwargs": {**copy.deepcopy(_S3_CONFIG), **configured}}


def _call(function, *args, sent: int = 0):
    """`function(*args)` on a remote file system, every failure an OSError.

    The call runs on a daemon thread and is given up after its deadline
    (`remote_deadline_s()` plus `sent` bytes, sent or fetched, at
    `_SLOWEST_UPLOAD`): a hung
    store costs the caller that long, never for ever, and the abandoned call
    ends with botocore's own timeouts. File systems raise their client's own
    errors too (botocore's, aiohttp's connection errors); their text names
    the operation and the bucket, never the credentials."""
    deadline = remote_deadline_s() + sent / _SLOWEST_UPLOAD
    outcome: list = []

    def call() -> None:
        try:
            outcome.append((True, function(*args)))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            outcome.append((False, e))

    worker = threading.Thread(target=call, name="mpprof-remote-call", daemon=True)
    worker.start()
    worker.join(deadline)
    if not outcome:
        raise NoAnswerError(errno.ETIMEDOUT,
                            f"the store did not answer within {deadline:.0f} s")
    answered, value = outcome[0]
    if answered:
        return value
    if isinstance(value, OSError):
        raise value
    if isinstance(value, Exception):  # any client error: "cannot be read/written"
        raise OSError(f"{type(value).__name__}: {value}") from value
    raise value
