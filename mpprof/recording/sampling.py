"""When a train step is sampled for per-layer numerics.

Regular samples come every `every` steps. At the profiler's default
interval (`DEFAULT_NUMERICS_EVERY`, 500) each fit also samples its steps
`EARLY_SAMPLE_STEPS` that come before the first regular sample, so that a fit
shorter than the interval is not blind: three instrumented steps per fit, and
the instrumented step's one-time trace at step 1 rather than 500
(docs/performance.md). An interval the user passes is kept as given. A step that overflowed arms a
forensic sample of the next step, within a budget per fit and no sooner than
`forensic_spacing` steps after the previous forensic sample: a run that
overflows on many early steps (the loss scale probing down from 2**15) would
otherwise run mostly instrumented steps at first.
"""

from __future__ import annotations

import math

# Steps of each fit sampled before the regular interval starts (log-spaced:
# the first weights, then after some training), at the default interval.
EARLY_SAMPLE_STEPS = (1, 10, 100)


class DefaultInterval(int):
    """The default `numerics_every`: an int that says it was not chosen, so
    that the schedule adds the early samples (an interval the user passes,
    even 500, is kept as given)."""


DEFAULT_NUMERICS_EVERY = DefaultInterval(500)


class SampleSchedule:
    """Decides, before each train-function call, whether to instrument it.

    Args:
        every: steps between regular samples; None: no sampling at all.
        forensic_budget: forensic samples a fit may take.
        forensic_spacing: least steps between two forensic samples.
        early: sample each fit's `EARLY_SAMPLE_STEPS` too (the default interval).
    """

    def __init__(self, every: int | None, forensic_budget: int, forensic_spacing: int,
                 early: bool = False):
        self.every = every
        self.early = early
        self.forensic_budget = forensic_budget
        self.forensic_spacing = forensic_spacing
        self.start_fit()

    def start_fit(self) -> None:
        self.forensic_used = 0
        self._steps_in_fit = 0
        self._early = list(self.early_steps)
        self._steps_since_sample = 0
        self._steps_since_forensic: int | None = None
        self._forensic_due = False

    @property
    def early_steps(self) -> tuple[int, ...]:
        """The steps of each fit sampled before the regular interval."""
        if self.every is None or not self.early:
            return ()
        return tuple(step for step in EARLY_SAMPLE_STEPS if step < self.every)

    @property
    def watching_overflows(self) -> bool:
        """Whether a new overflow would still arm a forensic sample."""
        return self.every is not None and self.forensic_used < self.forensic_budget

    def due(self, calls: int) -> bool:
        """Whether the next call is sampled (`calls`: calls made so far; the
        first one builds the model and always runs plain)."""
        return calls > 0 and self.steps_before_due() <= 0

    def steps_before_due(self) -> float:
        """Steps that can run before `due` may say yes (inf: never, as long
        as no overflow arms a forensic sample)."""
        if self.every is None:
            return math.inf
        if self._forensic_due:
            return 0
        regular = self.every - self._steps_since_sample
        if self._early:
            return min(regular, self._early[0] - self._steps_in_fit)
        return regular

    def sampled(self) -> bool:
        """Takes the sample that `due` announced; returns whether it is forensic."""
        forensic = self._forensic_due
        if forensic:
            self._forensic_due = False
            self.forensic_used += 1
            self._steps_since_forensic = 0
        elif self._early and self._early[0] <= self._steps_in_fit < self.every:
            # An early sample leaves the regular ones at multiples of `every`.
            self._early = [step for step in self._early if step > self._steps_in_fit]
        else:
            self._early = [step for step in self._early if step > self._steps_in_fit]
            self._steps_since_sample = 0
        return forensic

    def after_call(self, steps: int) -> None:
        self._steps_in_fit += steps
        self._steps_since_sample += steps
        if self._steps_since_forensic is not None:
            self._steps_since_forensic += steps

    def overflowed(self) -> None:
        """A step overflowed: sample the next one if budget and spacing allow."""
        spaced = (self._steps_since_forensic is None
                  or self._steps_since_forensic >= self.forensic_spacing)
        if self.watching_overflows and spaced:
            self._forensic_due = True
