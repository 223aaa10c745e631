"""One self-contained, offline HTML report of a logdir's mpprof runs.

`mpprof report LOGDIR -o report.html` writes it: a summary of every run
(most severe first, its worst findings linked), then per run its context,
findings and what could not be checked, the precision inventory, the
loss-scale timeline with overflow markers, per-layer numerics heatmaps
(layer x step, the dashboard's headroom measure and colours), GPU tracks
and replays of captured steps (`mpprof replay`) when recorded. It follows
the reader's light or dark colour scheme and prints cleanly.
plotly.js is embedded from the installed `plotly` package, so the file opens
without a network and can be attached to a bug report.

Everything a user controls (layer, variable and run names, file contents) is
escaped: HTML text through `html.escape`, plot labels as HTML entities
(plotly renders its labels as markup), and the embedded JSON with `</`
escaped so it cannot close its <script> element.

Large runs are downsampled to what a screen can show, so a million-step run
still makes a report of a few megabytes.

The package: `plots` prepares each run's plot data (downsampled, JSON-ready),
`sections` renders the tables and run sections, `page` assembles the file.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable

from mpprof import diagnosis
from mpprof.records import reader
from mpprof.replay import files as replay_files
from mpprof.report import page, plots, sections

Progress = Callable[[str], None]


def write_report(
    logdir: str | os.PathLike,
    output: str | os.PathLike,
    *,
    run: str | None = None,
    progress: Progress | None = None,
) -> str:
    """Writes the HTML report of `logdir` (or only its run `run`) to `output`.

    Args:
        logdir: the log_dir given to `mpprof.MixedPrecisionProfiler`.
        output: the HTML file to write (its directory is created).
        run: only this run, by name (as `mpprof summary` names it).
        progress: called with a line of text at each stage (large logdirs
            take a while).

    Returns:
        The path written.

    Raises:
        reader.LogdirNotFoundError, reader.NoMpprofDataError: as the reader.
    """
    return save_report(build_report(logdir, run=run, progress=progress), output)


def save_report(text: str, output: str | os.PathLike) -> str:
    """Writes a report's HTML to `output` (its directory is created); returns the path."""
    path = pathlib.Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return str(path)


def build_report(
    logdir: str | os.PathLike,
    *,
    run: str | None = None,
    progress: Progress | None = None,
) -> str:
    """The report of `logdir` as one HTML string (see `write_report`)."""
    say = progress or (lambda message: None)
    names = reader.select_runs(logdir, run)
    runs = []
    for index, name in enumerate(names):
        say(f"reading run {name} ({index + 1}/{len(names)})")
        runs.append(reader.read_run(logdir, name))
    return render_report(logdir, runs, progress=progress)


def render_report(
    logdir: str | os.PathLike,
    runs: list[reader.Run],
    *,
    progress: Progress | None = None,
) -> str:
    """The report of runs already read from `logdir` (see `write_report`)."""
    say = progress or (lambda message: None)
    diagnosed = []
    for read in runs:
        say(f"diagnosing run {read.name}")
        diagnosed.append((read, diagnosis.evaluate(read)))
    # Most severe first (the listing's order on a tie), as the dashboard.
    diagnosed.sort(key=lambda item: _severity_key(item[1]))
    run_sections, data = [], []
    for index, (read, result) in enumerate(diagnosed):
        say(f"drawing run {read.name}")
        run_data = plots.run_data(read)
        replays = replay_files.saved_results(logdir, read.name)
        run_sections.append(sections.run_section(index, read, result, run_data, replays))
        data.append(run_data)
    say("embedding plotly.js")
    return page.render_page(os.fspath(logdir), sections.summary_html(diagnosed), run_sections, data)


def _severity_key(result: diagnosis.Diagnosis) -> list[int]:
    """Sorts runs with more critical, then warning, then info findings first."""
    return [-sum(f.severity == s for f in result.findings) for s in diagnosis.SEVERITIES]
