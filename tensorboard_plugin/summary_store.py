"""The run list's summaries kept on disk between TensorBoard's restarts.

The first `/runs` of a process reads and diagnoses every run that has no
digest written by its fit (`mpprof.display.run_digest`: runs of an older
mpprof, fits still running): about 4 s for a sweep of 1,000 small runs on 2
cores, paid again at every restart of TensorBoard on the same logdir. Each
run's summary is small (a few hundred bytes), so the summaries are kept in
one file per logdir in the user's cache folder, each with the signature of
the files it was computed from (path, size and mtime of each of the run's
mpprof event files, as `RunCache` keys its own). A summary is trusted only
while its run's files are unchanged and while the code that computed it is:
the file holds a fingerprint of mpprof's and the plugin's source files, so
an upgrade (or an edit) starts afresh.

Nothing is ever written into the logdir. `MPPROF_SUMMARY_CACHE` names the
folder (default `$XDG_CACHE_HOME/mpprof`, else `~/.cache/mpprof`); `off`
keeps nothing on disk. A store that cannot be read or written is ignored:
the run list is computed as without it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pathlib
import tempfile

from mpprof import terminal
from mpprof._version import __version__
from mpprof.terminal import printable

logger = logging.getLogger(__name__)

# Bumped when the file's layout changes.
_FORMAT = 1


def _folder() -> pathlib.Path | None:
    setting = os.environ.get("MPPROF_SUMMARY_CACHE", "")
    if setting.lower() == "off":
        return None
    if setting:
        return pathlib.Path(setting)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "mpprof"


def _code_fingerprint() -> str:
    """Path, size and mtime of every source file of mpprof and the plugin:
    whatever computes a summary (reading, diagnosis, payloads)."""
    digest = hashlib.sha256(__version__.encode())
    roots = (pathlib.Path(terminal.__file__).parent, pathlib.Path(__file__).parent)
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            stat = path.stat()
            digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


class SummaryStore:
    """Summaries of the runs of one logdir, on disk.

    Args:
        logdir: the logdir (local or a URL) the summaries are of.
    """

    def __init__(self, logdir: str):
        folder = _folder() if logdir else None
        name = hashlib.sha256(logdir.encode()).hexdigest()[:24]
        self.path = None if folder is None else folder / f"run-summaries-{name}.json"
        self._logdir = logdir
        self._fingerprint = _code_fingerprint() if self.path is not None else ""

    def load(self) -> dict[str, tuple[tuple, dict, str]]:
        """{run: (signature, summary, summary as JSON text)} as last saved,
        or {} (nothing saved, another mpprof, unreadable)."""
        if self.path is None:
            return {}
        try:
            saved = json.loads(self.path.read_text())
            if saved.get("format") != _FORMAT or saved.get("code") != self._fingerprint \
                    or saved.get("logdir") != self._logdir:
                return {}
            return {run: (tuple(tuple(state) for state in entry["signature"]),
                          json.loads(entry["text"]), entry["text"])
                    for run, entry in saved["runs"].items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            logger.warning("mpprof: ignoring the saved run summaries %s (%s)",
                           printable(self.path), printable(e))
            return {}

    def save(self, summaries: dict[str, tuple[tuple, dict, str]]) -> None:
        """Replaces the saved summaries with `summaries` (written whole, then
        renamed: a reader never sees half a file)."""
        if self.path is None:
            return
        document = {"format": _FORMAT, "code": self._fingerprint, "logdir": self._logdir,
                    "runs": {run: {"signature": [list(state) for state in signature],
                                   "text": text}
                             for run, (signature, _, text) in summaries.items()}}
        temporary = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False,
                                             prefix=self.path.name, suffix=".tmp") as out:
                temporary = out.name
                json.dump(document, out, separators=(",", ":"))
            os.replace(temporary, self.path)
        except OSError as e:
            logger.warning("mpprof: cannot save the run summaries to %s (%s)",
                           printable(self.path), printable(e))
            if temporary is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
