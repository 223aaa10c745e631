"""Where a logdir lives: local paths through `os`, remote ones through `tf.io.gfile`.

Reading and writing both go through here.

Reading a local logdir must not import TensorFlow (about 3 s): local paths
(anything without a `scheme://`) are read with the standard library, and
TensorFlow's file systems (gs://, s3://, hdfs://, ram://, ...) are imported
only for a remote path. Every failure surfaces as an `OSError`, so callers
handle one kind of error whatever the file system.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import posixpath
import stat
from collections.abc import Callable, Iterator
from typing import BinaryIO


class Kind(enum.Enum):
    DIRECTORY = "directory"
    FILE = "regular file"
    # Anything else a directory can hold: a FIFO, socket or device (opening
    # one may block forever), a dangling symlink.
    OTHER = "neither a regular file nor a directory"


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    kind: Kind
    is_symlink: bool = False
    # Where the listing itself says (an object store's listing does; a local
    # one is stat'ed on demand): the file's size and modification time (or
    # another token that changes with the content, e.g. from an ETag).
    size: int | None = None
    mtime_ns: int | None = None


def is_remote(path: str) -> bool:
    """Whether `path` names a remote file system (has a `scheme://`)."""
    return "://" in path


def error_text(error: OSError) -> str:
    """What went wrong, in words, without the path the caller already shows."""
    return error.strerror or str(error)


def join(directory: str, *names: str) -> str:
    return posixpath.join(directory, *names) if is_remote(directory) else os.path.join(
        directory, *names
    )


def dirname(path: str) -> str:
    return posixpath.dirname(path) if is_remote(path) else os.path.dirname(path)


def relative(path: str, root: str) -> str:
    """`path` relative to `root`, with "/" separators ("." for root itself)."""
    if is_remote(root):
        return posixpath.relpath(path, root)
    return os.path.relpath(path, root).replace(os.sep, "/")


def isdir(path: str) -> bool:
    if is_remote(path):
        return _gfile_call(_gfile().isdir, path)
    return os.path.isdir(path)


def scan(directory: str) -> list[Entry]:
    """The entries of `directory`, symlinks followed to say what they are.

    Raises:
        OSError: the directory cannot be listed.
    """
    if is_remote(directory):
        gfile = _gfile()
        return [
            Entry(name.rstrip("/"), Kind.DIRECTORY if _gfile_call(
                gfile.isdir, posixpath.join(directory, name)
            ) else Kind.FILE)
            for name in _gfile_call(gfile.listdir, directory)
        ]
    with os.scandir(directory) as entries:
        return [_local_entry(entry) for entry in entries]


def _local_entry(entry: os.DirEntry) -> Entry:
    try:
        mode = entry.stat().st_mode  # follows symlinks
        kind = (
            Kind.DIRECTORY if stat.S_ISDIR(mode)
            else Kind.FILE if stat.S_ISREG(mode)
            else Kind.OTHER
        )
    except OSError:  # a dangling symlink, or a target we may not stat
        kind = Kind.OTHER
    return Entry(entry.name, kind, entry.is_symlink())


def walk(root: str, on_error: Callable[[str, OSError], None]) -> Iterator[tuple[str, list[Entry]]]:
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
    """
    remote = is_remote(root)
    root_real = root if remote else os.path.realpath(root)
    seen = {root_real}
    pending = [root]
    while pending:
        directory = pending.pop()
        try:
            entries = scan(directory)
        except OSError as e:
            on_error(directory, e)
            continue
        yield directory, entries
        for entry in sorted(entries, key=lambda e: e.name, reverse=True):
            if entry.kind is not Kind.DIRECTORY:
                continue
            path = join(directory, entry.name)
            real = path if remote else os.path.realpath(path)
            inside = real == root_real or real.startswith(root_real.rstrip(os.sep) + os.sep)
            if real in seen or (entry.is_symlink and inside):
                continue
            seen.add(real)
            pending.append(path)


def size_and_mtime(path: str) -> tuple[int, int]:
    """(size in bytes, modification time in ns) of a file; raises OSError."""
    if is_remote(path):
        found = _gfile_call(_gfile().stat, path)
        return found.length, found.mtime_nsec
    found = os.stat(path)
    return found.st_size, found.st_mtime_ns


def open_file(path: str) -> BinaryIO:
    """Opens a regular file for reading; raises OSError for anything else.

    A local path is opened without blocking and checked on the open file, so
    a FIFO named like an event file is refused instead of waiting forever for
    a writer.
    """
    if is_remote(path):
        return _RemoteFile(_gfile_call(_gfile().GFile, path, "rb"))
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


def makedirs(path: str) -> None:
    """Creates the directory `path` and its parents; raises OSError."""
    if is_remote(path):
        _gfile_call(_gfile().makedirs, path)
    else:
        os.makedirs(path, exist_ok=True)


def open_append(path: str) -> BinaryIO:
    """Opens a file for writing at its end (created if missing); raises OSError."""
    if is_remote(path):
        return _RemoteFile(_gfile_call(_gfile().GFile, path, "ab"))
    return open(path, "ab")


def write_bytes(path: str, data: bytes) -> None:
    """Writes `data` as the whole file `path`; raises OSError."""
    if is_remote(path):
        with _RemoteFile(_gfile_call(_gfile().GFile, path, "wb")) as f:
            f.write(data)
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


class _RemoteFile:
    """A `tf.io.gfile.GFile` whose errors are OSErrors."""

    def __init__(self, gfile):
        self._file = gfile

    def read(self, size: int = -1) -> bytes:
        return _gfile_call(self._file.read, size)

    def write(self, data: bytes) -> None:
        _gfile_call(self._file.write, data)

    def flush(self) -> None:
        _gfile_call(self._file.flush)

    def close(self) -> None:
        _gfile_call(self._file.close)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


def _gfile():
    try:
        import tensorflow as tf
    except ImportError as e:
        raise OSError(
            f"Reading a remote logdir needs TensorFlow's file systems (tf.io.gfile): {e}"
        ) from e
    return tf.io.gfile


def _gfile_call(function, *args):
    """`function(*args)`, TensorFlow's errors turned into OSError."""
    import tensorflow as tf

    try:
        return function(*args)
    except tf.errors.OpError as e:
        raise OSError(e.message) from e
