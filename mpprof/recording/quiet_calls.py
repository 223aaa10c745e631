"""Quiet calls: the train-function calls with nothing due but their count.

Per-call Python runs on caches the step has just flushed (tens of us where
a tight loop would take a few), so on most calls the profiled fit touches
as little as it can: the plain function, the alarm's quick check and a
count. Their bookkeeping waits for the next call that has something to do.
"""

from __future__ import annotations

import time

from mpprof.recording.fit_state import FitState
from mpprof.recording.hard_stop import FlushSchedule
from mpprof.recording.sampling import SampleSchedule


class QuietCalls:
    """How many of the next calls may run quiet, and the ones that did.

    Args:
        steps_per_call: train steps of every call, when fixed for the whole
            fit; None (tf-keras' tuner may change them): no call is quiet.
    """

    def __init__(self, steps_per_call: int | None):
        self.steps_per_call = steps_per_call
        # How many of the next calls may run quiet; the dispatcher counts
        # them off itself (`ProfiledFit._run_train_function`: the hot path).
        self.ahead = 0
        self._made = 0  # quiet calls since the last bookkeeping
        self._until = 0.0  # the `time.monotonic()` they must end by

    def went_quietly(self, fit: FitState) -> bool:
        """After a quiet call whose alarm did not ring: whether it may stay
        quiet (no deadline passed); it is then counted, and the step kept
        current (the GPU sampler's thread reads it)."""
        if time.monotonic() >= self._until:
            return False
        fit.step += self.steps_per_call
        self._made += 1
        return True

    def settle(self, fit: FitState, flushes: FlushSchedule, schedule: SampleSchedule) -> None:
        """Counts the quiet calls made since the last bookkeeping (before
        anything reads the calls, the steps since the last flush or the
        sampling schedule)."""
        made, self._made = self._made, 0
        if made:
            steps = made * self.steps_per_call
            fit.calls += made
            flushes.steps += steps
            schedule.after_call(steps)

    def plan(self, waits: list[float], flushes: FlushSchedule,
             steps_before_sample: float) -> None:
        """Says how many of the next calls may run quiet: none has a sample
        or a flush due before it, and each collector with work after calls
        can wait (`waits`: until when each can, with the flush deadline)."""
        self.ahead = 0
        steps = self.steps_per_call
        if not steps:
            return
        until = min([flushes.deadline(), *waits])
        if until <= time.monotonic():
            return
        self._until = until
        steps_free = min(flushes.steps_free(), steps_before_sample)
        self.ahead = max(0, int(steps_free) // steps)

    def stop(self) -> None:
        """No more quiet calls until the next plan (an alarm rang, a
        forensic sample may be due)."""
        self.ahead = 0
