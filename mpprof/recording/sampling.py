"""When a train step is sampled for per-layer numerics.

Regular samples come every `every` steps. A step that overflowed arms a
forensic sample of the next step, within a budget per fit and no sooner than
`forensic_spacing` steps after the previous forensic sample: a run that
overflows on many early steps (the loss scale probing down from 2**15) would
otherwise run mostly instrumented steps at first.
"""

from __future__ import annotations

import math


class SampleSchedule:
    """Decides, before each train-function call, whether to instrument it.

    Args:
        every: steps between regular samples; None: no sampling at all.
        forensic_budget: forensic samples a fit may take.
        forensic_spacing: least steps between two forensic samples.
    """

    def __init__(self, every: int | None, forensic_budget: int, forensic_spacing: int):
        self.every = every
        self.forensic_budget = forensic_budget
        self.forensic_spacing = forensic_spacing
        self.start_fit()

    def start_fit(self) -> None:
        self.forensic_used = 0
        self._steps_since_sample = 0
        self._steps_since_forensic: int | None = None
        self._forensic_due = False

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
        return self.every - self._steps_since_sample

    def sampled(self) -> bool:
        """Takes the sample that `due` announced; returns whether it is forensic."""
        forensic = self._forensic_due
        if forensic:
            self._forensic_due = False
            self.forensic_used += 1
            self._steps_since_forensic = 0
        else:
            self._steps_since_sample = 0
        return forensic

    def after_call(self, steps: int) -> None:
        self._steps_since_sample += steps
        if self._steps_since_forensic is not None:
            self._steps_since_forensic += steps

    def overflowed(self) -> None:
        """A step overflowed: sample the next one if budget and spacing allow."""
        spaced = (self._steps_since_forensic is None
                  or self._steps_since_forensic >= self.forensic_spacing)
        if self.watching_overflows and spaced:
            self._forensic_due = True
