"""Whether a train-function call had trouble, on PyTorch: a skipped step.

The step's counters are on the host (`mpprof.backends.torch.step_state`), so
the alarm is no value in the logs: it is the count of skipped steps, read
from them after each call without touching the device. It arms forensic
samples only (the step dates every overflow and the first non-finite loss
itself); a non-finite loss is not part of it, since telling one costs a wait
for the step on a GPU (the loss is checked at the next read instead).
"""

from __future__ import annotations

from collections.abc import Callable

from mpprof.backends.patching import Patches


class CallAlarm:
    """The step state's count of skipped steps, compared after each call.

    Args:
        counters: unused on PyTorch (the step state counts).
        host_reads_needed: unused (reading costs nothing).
        skipped: returns the skipped steps so far (None before the fit's
            step state exists).
    """

    def __init__(self, counters: Callable[[], list], host_reads_needed: Callable[[], bool],
                 skipped: Callable[[], int | None]):
        self._skipped = skipped
        self._seen: int | None = None
        self._since: int | None = None

    def install(self, model, patches: Patches, in_logs: bool) -> None:
        self._seen = self._skipped()

    def _rang(self) -> bool:
        now = self._skipped()
        if self._seen is None:
            self._seen = now
        rang = now is not None and now != self._seen
        self._seen = now
        return rang

    def unchanged(self, value) -> bool:
        """For a quiet call: False when a step was skipped since the last look
        (the next `hold` reports it)."""
        now = self._skipped()
        return now is None or now == self._seen

    def hold(self, value, first_step: int, last_step: int, *,
             wait: bool) -> list[tuple[int, int]]:
        if self._since is None:
            self._since = first_step
        if not self._rang():
            return []
        since, self._since = self._since, last_step + 1
        return [(since, last_step)]

    def drain(self) -> tuple[int, int] | None:
        if not self._rang():
            return None
        since = self._since if self._since is not None else 0
        self._since = None
        return since, since
