"""What every backend's loss-scale collector writes: one series per
LossScaleOptimizer the step used, the primary one under the plain tags,
every other under a series named after its attribute
(`schema.tag_for(record, series)`), and their settings in the run context.

A series here is a backend's `LossScaleSeries`: `read()` gives its new
events and progress row, `settings()` and `origin` describe it. What every
backend's `LossScales` collector of those series does alike is
`LossScalesBase`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mpprof.backends import step_origin
from mpprof.backends.collector import Collector
from mpprof.backends.step_origin import EarlierRecords
from mpprof.records import schema


def write_series(fit, active: dict[str, Any], primary, start: dict[str, Any]) -> None:
    """Writes each active series' new events and progress.

    Args:
        fit: the fit's `FitState` (its `writer`).
        active: the series of the optimizers the step used, by name.
        primary: the primary optimizer's series (written under the plain tags).
        start: each series' first progress row not written yet, by name
            (taken out as it is written).
    """
    for name, collector in active.items():
        series = None if collector is primary else name
        first = start.pop(name, None)
        if first is not None:
            fit.writer.write_array(schema.LOSS_SCALE_PROGRESS, first, int(first[0]),
                                   series=series)
        events, progress = collector.read()
        step = int(progress[schema.LOSS_SCALE_PROGRESS_COLUMN.steps_run])
        if len(events):
            fit.writer.write_array(schema.LOSS_SCALE_EVENTS, events, step, series=series)
        fit.writer.write_array(schema.LOSS_SCALE_PROGRESS, progress, step, series=series)


def series_context(active: dict[str, Any], primary, replicas: int) -> dict:
    """The run context's "loss_scale" state for active series: the primary
    one's settings at the top, and every series' under "series" when there
    are several.

    Args:
        active: the series of the optimizers the step used, by name (not empty).
        primary: the primary optimizer's series, or None.
        replicas: replicas in sync (who decides a skip).
    """
    context: dict[str, Any] = {"state": "ok"}
    series: dict[str, dict] = {}
    for name, collector in active.items():
        settings = collector.settings()
        settings.setdefault("skip_decided_by", keras_3_skip_decided_by(replicas))
        settings["step_axis_origin"] = collector.origin.describe()
        if collector is primary or primary is None and not series:
            context.update(settings, primary=name)
        series[name] = settings
    if len(series) > 1:
        context["series"] = series
    return context


def keras_3_skip_decided_by(num_replicas: int) -> str:
    """What decides a skipped step in Keras 3's LossScaleOptimizer, in words.

    Keras 3 checks the gradients for finiteness BEFORE they are all-reduced
    (the inner optimizer all-reduces them afterwards); under a strategy with
    several replicas it takes the first replica's verdict for all. Checked on
    Keras 3.15 with MirroredStrategy on two logical CPUs: an overflow on the
    second replica alone is applied, not skipped, and the weights become
    non-finite (tf-keras all-reduces first and skips such a step).
    """
    if num_replicas <= 1:
        return "Keras 3 LossScaleOptimizer: finiteness of the step's gradients"
    return (
        "Keras 3 LossScaleOptimizer: finiteness of the FIRST replica's gradients "
        "(each replica's own where the strategy runs without merge_call), before the "
        "all-reduce; an overflow on another replica alone is not skipped and turns "
        "the weights non-finite (see the health record, MP012)"
    )


def keras_3_settings(optimizer) -> dict:
    """A Keras 3 LossScaleOptimizer's settings in a series' `settings()`."""
    return {
        "initial_scale": float(optimizer.initial_scale),
        "dynamic_growth_steps": int(optimizer.dynamic_growth_steps),
        "inner_optimizer": type(optimizer.inner_optimizer).__name__,
    }


class LossScalesBase(Collector):
    """What every backend's `LossScales` (`mpprof.backends.protocol`) does
    alike: one series per LossScaleOptimizer the step may use, by optimizer
    name in `by_name` (an earlier fit's where it made one, else a new one
    whose step origin is looked up), the overflow watch, the absent entry.
    A subclass makes a new series (`_new_series`), may follow fewer
    optimizers (`_follows`) and take an earlier fit's series over
    (`_reused`), and says which series are `active()` (those of the
    optimizers the step used, all of them until it was traced).

    Args:
        keras_api: the fit's `Backend` (its `loss_scale_series` class).
        usage: the model's `OptimizerUsage`.
        strategy: the model's distribution strategy (or the backend's
            stand-in: one replica per process).
        capacity: events each series' ring holds between two reads.
        reuse: series of an earlier fit, by optimizer id: they keep counting
            skipped steps across fits.
        earlier: reads the run's records of earlier fits
            (`step_origin.read_earlier`), called at most once, and only when
            a new series' optimizer has run before.
    """

    name = "loss_scale"

    def __init__(self, keras_api, usage, strategy, capacity: int,
                 reuse: dict[int, Any], earlier: Callable[[], EarlierRecords | str]):
        self._usage = usage
        self._replicas = int(strategy.num_replicas_in_sync)
        # Each series' first progress row, until written (`write_series`).
        self._start: dict[str, Any] = {}
        self.by_name: dict[str, Any] = {}
        # Skipped steps at the last look (`note_overflows`; set at install).
        self._overflows_seen = 0
        for use in usage.uses:
            if not use.loss_scale or not self._follows(use):
                continue
            collector = reuse.get(id(use.optimizer))
            if collector is None:
                collector = self._new_series(keras_api, use, strategy, capacity)
                step_origin.start_new_series(collector, use.name, earlier)
            else:
                self._reused(collector)
            self.by_name[use.name] = collector

    def _follows(self, use) -> bool:
        return True

    def _new_series(self, keras_api, use, strategy, capacity: int):
        raise NotImplementedError

    def _reused(self, series) -> None:
        """An earlier fit's series, counting on in this fit."""

    def active(self) -> dict[str, Any]:
        raise NotImplementedError

    def __bool__(self) -> bool:
        return bool(self.active())

    def note_overflows(self, fit) -> None:
        """After a call whose alarm rang: arms a forensic sample when a step
        overflowed since the last look (a host read, while one can be armed)."""
        if not fit.schedule.watching_overflows:
            return
        skipped = self.skipped_steps()
        if skipped > self._overflows_seen:
            fit.schedule.overflowed()
        self._overflows_seen = skipped

    def skipped_steps(self) -> int:
        """Skipped steps of every used series so far (a host read)."""
        return sum(c.skipped_steps() for c in self.active().values())

    def _absent(self) -> dict:
        """The run context's entry when the step used no LossScaleOptimizer."""
        used = self._usage.used()
        names = ", ".join(f"{u.name} ({type(u.optimizer).__name__})" for u in used)
        return {
            "state": "absent",
            "reason": (
                f"no LossScaleOptimizer among the optimizers the step uses ({names}): "
                "no dynamic loss scale to record" if used
                else "the train step applied no optimizer: no loss scale to record"
            ),
        }
