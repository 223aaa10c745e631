"""Where a new loss-scale series' step axis starts when its optimizer ran before.

The step axis counts every train step: Keras 3's apply count
(`optimizers.applied_steps`), which leaves out the steps its loss scale
skipped, plus the skipped steps mpprof counted (`LossScaleSeries`). A
profiler carries its counts from one fit to the next (`AcrossFits`), but a
new profiler for a model that trained before has counted none: starting
from zero would date every later step too early by the earlier skips, and
in the same run directory its steps would overlap the earlier fit's.

So a new series looks where the run's last records of its optimizer left
off, and continues their count only when they describe this optimizer as it
is now: the same steps for the recorded skips (Keras 3: apply calls plus
skips; tf-keras: `iterations`), the same scale and the same loss-scale
settings. Anything else (another model, steps that ran without mpprof, a
new log_dir) leaves the skipped steps before the fit unknown: the axis
starts where the optimizer's own count puts it, and the run context says
why. A continuation that cannot be verified is never guessed.

Only the last fit's event file is read (each fit writes its own), once per
fit and only when a new series' optimizer has run; a logdir that cannot be
read makes the origin unknown, never a failed fit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from mpprof.backends.traced_guard import describe_error
from mpprof.records import filesystem, reader, schema
from mpprof.records.event_file import ReadWarnings, Record, read_event_file, series_key

_PROGRESS = schema.LOSS_SCALE_PROGRESS_COLUMN
# The loss-scale settings that must match for records to be this optimizer's.
_IDENTITY = ("inner_optimizer", "initial_scale", "dynamic_growth_steps")


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where a series' count of skipped steps starts.

    Attributes:
        skipped: steps skipped before the series' first fit; None: unknown.
        evidence: in words, what `skipped` rests on, or why it is unknown
            and what that means for the steps recorded.
    """

    skipped: int | None
    evidence: str

    def describe(self) -> dict:
        """The run context's `step_axis_origin` of a loss-scale series."""
        return {"skipped_before": self.skipped, "evidence": self.evidence}


FIRST_STEP = Origin(0, "no train step ran before the first profiled fit")
# What an unknown origin means on Keras 3, whose LossScaleOptimizer does not
# advance `iterations` on a skipped step (a series' `unknown_origin_means`).
KERAS_3_UNKNOWN_ORIGIN = (
    "the steps recorded start at the optimizer's apply calls, early by the "
    "steps skipped before this profiler's first fit (Keras 3 does not count them)"
)


@dataclasses.dataclass(frozen=True)
class EarlierRecords:
    """What the run directory's newest records say of each optimizer.

    Attributes:
        path: the event file they come from.
        progress: by optimizer name, its last loss-scale progress row.
        settings: by optimizer name, its loss-scale settings in the run
            context written with them.
    """

    path: str
    progress: dict[str, np.ndarray]
    settings: dict[str, dict]


def read_earlier(log_dir: str) -> EarlierRecords | str:
    """The loss-scale records of the last fit written into `log_dir`'s model
    run (the newest event file holding a run context), or why there are
    none. Never raises: a logdir that cannot be read has nothing to continue.
    """
    try:
        paths = reader.event_files(log_dir, schema.TRAIN_RUN)
        newest_first = sorted(paths, key=lambda p: (filesystem.size_and_mtime(p)[1], p),
                              reverse=True)
        for path in newest_first:
            records: dict[str, list[Record]] = {}
            read_event_file(path, records, ReadWarnings())
            if records.get(schema.RUN_CONTEXT):
                return _loss_scale_records(path, records)
    except Exception as e:  # noqa: BLE001 - reading must never fail the fit
        return f"no earlier mpprof records could be read in {log_dir!r} ({describe_error(e)})"
    return f"no earlier mpprof records in {log_dir!r}"


def _loss_scale_records(path: str, records: dict[str, list[Record]]) -> EarlierRecords | str:
    """The last progress row and settings of each loss-scale series in one
    fit's `records`, or why it has none."""
    loss_scale = (records[schema.RUN_CONTEXT][-1].value.get("collectors") or {}).get(
        "loss_scale") or {}
    primary = loss_scale.get("primary")
    series = loss_scale.get("series") or {primary: loss_scale}
    progress, settings = {}, {}
    for name, found in series.items():
        rows = records.get(series_key(schema.LOSS_SCALE_PROGRESS,
                                      None if name == primary else name))
        if isinstance(name, str) and isinstance(found, dict) and rows:
            progress[name] = rows[-1].value.reshape(-1, len(_PROGRESS))[-1]
            settings[name] = found
    if not progress:
        return f"the last fit recorded in {path!r} has no loss-scale records"
    return EarlierRecords(path, progress, settings)


def start_new_series(series, name: str, earlier: Callable[[], EarlierRecords | str]) -> None:
    """Where a new loss-scale series' step axis starts (every backend's
    `LossScales` asks, for each series it makes): step 0 when its optimizer
    never ran, else from the run's earlier records (`earlier()`, read only
    then)."""
    series.start_from(FIRST_STEP if series.nothing_ran() else origin(series, name, earlier()))


def origin(collector, name: str, earlier: EarlierRecords | str) -> Origin:
    """Where the skipped steps of optimizer `name`'s new series start.

    Args:
        collector: its new `LossScaleSeries`, before its first fit.
        name: the optimizer's name among the step's optimizers.
        earlier: `read_earlier`'s answer for the run directory.
    """
    unknown = collector.unknown_origin_means
    if isinstance(earlier, str):
        return Origin(None, f"unknown: {earlier}; {unknown}")
    row = earlier.progress.get(name)
    if row is None:
        return Origin(None, f"unknown: no loss-scale records of {name!r} in "
                            f"{earlier.path!r}; {unknown}")
    try:
        mismatch = _mismatch(collector, row, earlier.settings[name])
    except Exception as e:  # noqa: BLE001 - records it cannot compare continue nothing
        mismatch = f"they could not be compared ({describe_error(e)})"
    steps, skipped = int(row[_PROGRESS.steps_run]), int(row[_PROGRESS.skipped_steps])
    if mismatch is not None:
        return Origin(None, f"unknown: the last records of {name!r} in {earlier.path!r} "
                            f"are not this optimizer's as it is now ({mismatch}: another "
                            f"model, or steps that ran without mpprof); {unknown}")
    return Origin(skipped, f"continues the records of {name!r} in {earlier.path!r} "
                           f"up to step {steps}")


def _mismatch(collector, row: np.ndarray, recorded: dict) -> str | None:
    """How the optimizer differs from its recorded progress `row` and
    loss-scale settings, or None when they are its own."""
    steps, scale, skipped = (row[_PROGRESS.steps_run], row[_PROGRESS.scale],
                             row[_PROGRESS.skipped_steps])
    settings = collector.settings()
    now = {key: settings.get(key) for key in _IDENTITY}
    then = {key: recorded.get(key) for key in _IDENTITY}
    if now != then:
        return f"settings {now}, recorded {then}"
    if collector.scale() != scale:
        return f"scale {collector.scale()}, recorded {scale}"
    steps_now = collector.steps_given_skipped(int(skipped))
    if steps_now != steps:
        return (f"{steps_now} steps with the {int(skipped)} skipped ones recorded, "
                f"recorded {int(steps)}")
    return None
