"""Whether a train-function call had trouble, read one call late on JAX.

The profiled step returns, beside its logs, the alarm: skipped steps plus
steps with a non-finite loss so far (`StepState`). The dispatcher hands it
to the core in the logs (under `ALARM_KEY`, taken out before Keras sees
them). Reading it waits for its step, so the host reads each call's alarm
only once the next call is queued: the device runs ahead, as in Keras' own
JAX fit. The alarm only arms forensic samples: the step dates every overflow
and the first non-finite loss itself, so the steps a rung alarm reports are
the calls since the last look, a range, not a date.
"""

from __future__ import annotations

from collections.abc import Callable

from mpprof.backends.jax.step_state import ALARM_KEY
from mpprof.recording.patching import Patches

LOGS_KEY = ALARM_KEY


class CallAlarm:
    """The step's alarm (same interface as the TensorFlow `CallAlarm`).

    Args:
        counters: unused on JAX (the step computes the alarm).
        host_reads_needed: unused on JAX (the alarm is always in the logs).
    """

    def __init__(self, counters: Callable[[], list], host_reads_needed: Callable[[], bool]):
        self._seen: int | None = None
        self._held = None  # the last call's alarm, not read yet
        self._rang = False
        self._since: int | None = None  # the first step not yet examined

    def install(self, model, patches: Patches, in_logs: bool) -> None:
        self._seen = None  # the first alarm read sets it

    def _read(self, held) -> bool:
        """Whether the alarm `held` (a device scalar) differs from the last seen."""
        if held is None:
            return False
        value = int(held)
        changed = self._seen is not None and value != self._seen
        self._seen = value
        return changed

    def unchanged(self, value) -> bool:
        """For a quiet call: keeps its alarm and reads the one before (done,
        or nearly: this call is queued behind it)."""
        held, self._held = self._held, value
        if self._read(held):
            self._rang = True
            return False
        return True

    def hold(self, value, first_step: int, last_step: int, *,
             wait: bool) -> list[tuple[int, int]]:
        """Keeps this call's alarm, reads the last one's; `wait` is not
        honoured (a JAX step dates its own trouble)."""
        if self._since is None:
            self._since = first_step
        held, self._held = self._held, value
        rang = self._read(held) or self._rang
        self._rang = False
        if not rang:
            return []
        since, self._since = self._since, last_step + 1
        return [(since, last_step)]

    def drain(self) -> tuple[int, int] | None:
        """Reads the last call's alarm now (at a flush)."""
        held, self._held = self._held, None
        if not (self._read(held) or self._rang):
            return None
        self._rang = False
        since = self._since if self._since is not None else 0
        self._since = None
        return since, since
