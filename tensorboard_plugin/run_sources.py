"""Where the tab's runs are, named as TensorBoard names them in Scalars.

`tensorboard --logdir DIR` serves one logdir: the tab's runs are
`mpprof.records`' runs of DIR, whose names are TensorBoard's (the directory
relative to DIR, "." for DIR itself). The plugin lists and reads them itself,
which also serves remote logdirs TensorBoard cannot read (see
`MpprofPlugin.is_active`). `tensorboard --logdir_spec a:DIR1,b:DIR2` has no
one logdir: TensorBoard's multiplexer names each run ("a/train", "b/.") and
knows its directory, and the tab takes both from it.
"""

from __future__ import annotations

from collections.abc import Callable

from mpprof.records import filesystem, reader


class LogdirRuns:
    """The runs of one logdir (local or a URL), as `mpprof.records` names them."""

    def __init__(self, logdir: str):
        self.logdir = logdir

    def runs(self, on_warning: Callable[[str], None],
             listings: filesystem.Listings | None = None) -> dict[str, tuple]:
        """Each run's name and file states (`reader.run_files`)."""
        if not self.logdir:
            return {}
        try:
            return reader.run_files(self.logdir, on_warning, listings)
        except reader.LogdirNotFoundError:
            return {}

    def locate(self, run: str) -> tuple[str, str]:
        """(logdir, run name there) for `reader.read_run` and its kin."""
        return self.logdir, run


class MultiplexerRuns:
    """The runs TensorBoard's multiplexer names, each read in its directory.

    A directory's runs are the fits that wrote there: TensorBoard's name for
    it, and `<name>@<host>-<pid>` for a fit that wrote there at the same time
    as another (as `mpprof.records` keeps them apart)."""

    logdir = ""  # no one logdir: nothing remote for the plugin to find itself

    def __init__(self, multiplexer):
        self._multiplexer = multiplexer
        self._where: dict[str, tuple[str, str]] = {}

    def runs(self, on_warning: Callable[[str], None],
             listings: filesystem.Listings | None = None) -> dict[str, tuple]:
        found: dict[str, tuple] = {}
        where: dict[str, tuple[str, str]] = {}
        for name, directory in sorted(self._multiplexer.RunPaths().items()):
            try:
                runs = reader.directory_runs(directory)
            except OSError as e:
                on_warning(f"{filesystem.shown(directory)}: cannot be listed "
                           f"({filesystem.error_text(e)}); skipped")
                continue
            for run, states in runs.items():
                shown = name + run[1:]  # "." is the directory's own run
                found[shown] = states
                where[shown] = (directory, run)
        self._where = where  # replaced whole: routes read it from other threads
        return dict(sorted(found.items()))

    def locate(self, run: str) -> tuple[str, str]:
        try:
            return self._where[run]
        except KeyError:
            raise reader.NoMpprofDataError(f"No mpprof run named {run!r}") from None


def run_source(logdir: str | None, multiplexer=None) -> LogdirRuns | MultiplexerRuns:
    """The runs of TensorBoard's `--logdir`, or else its multiplexer's
    (`--logdir_spec`); `multiplexer` is `TBContext.multiplexer`."""
    if logdir or multiplexer is None or not hasattr(multiplexer, "RunPaths"):
        return LogdirRuns(logdir or "")
    return MultiplexerRuns(multiplexer)
