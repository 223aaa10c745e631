"""What one profiler carries from each of its fits to the next."""

from __future__ import annotations

from dataclasses import dataclass, field

from mpprof.backends import protocol
from mpprof.recording.sampling import SampleSchedule


@dataclass
class AcrossFits:
    """What one profiler carries from each of its fits to the next.

    Attributes:
        schedule: the numerics sampling schedule (restarted at each fit).
        profile_window: the XProf window of `profile_steps` (made by the
            first fit's backend), or None.
        fit_count: fits begun so far.
        last_step: the train step the last fit ended at (None before one).
        loss_scales: the loss-scale series of the last fit, by
            `id(optimizer)`: their counters go on.
        health: the loss watches of the last fit, by `id(optimizer)`.
    """

    schedule: SampleSchedule
    profile_window: protocol.ProfileWindow | None = None
    fit_count: int = 0
    last_step: int | None = None
    loss_scales: dict[int, object] = field(default_factory=dict)
    health: dict[int, object] = field(default_factory=dict)
