"""Whether a train-function call had trouble, read without waiting on JAX.

The profiled step returns, beside its logs, the alarm: skipped steps plus
steps with a non-finite loss so far (`StepState`). The dispatcher hands it
to the core in the logs (under `ALARM_KEY`, taken out before Keras sees
them). Reading a value waits for its step, so the host reads only the alarms
whose steps are done (`jax.Array.is_ready`), oldest first, and the device
runs ahead as in Keras' own JAX fit; at a flush it reads them all. (Waiting
for the call before the last one cost the seed model a quarter of its step
time on a loaded 2-core CPU.) The alarm only arms forensic samples: the step
dates every overflow and the first non-finite loss itself, so the steps a
rung alarm reports are the calls since the last look, a range, not a date.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from mpprof.backends.jax.step_state import ALARM_KEY
from mpprof.recording.patching import Patches

LOGS_KEY = ALARM_KEY

# Alarms not read yet, at most: past it the oldest is waited for (a device
# far behind the host, or steps that never report ready).
MAX_PENDING = 64


class CallAlarm:
    """The step's alarm (same interface as the TensorFlow `CallAlarm`).

    Args:
        counters: unused on JAX (the step computes the alarm).
        host_reads_needed: unused on JAX (the alarm is always in the logs).
    """

    def __init__(self, counters: Callable[[], list], host_reads_needed: Callable[[], bool]):
        self._seen: int | None = None
        self._pending: collections.deque = collections.deque()
        self._rang = False
        self._since: int | None = None  # the first step not yet reported

    def install(self, model, patches: Patches, in_logs: bool) -> None:
        self._seen = None  # the first alarm read sets it

    def _read_done(self, *, wait: bool) -> None:
        """Reads the pending alarms whose steps are done (all with `wait`)."""
        pending = self._pending
        while pending and (wait or len(pending) > MAX_PENDING or pending[0].is_ready()):
            value = int(pending.popleft())
            if self._seen is not None and value != self._seen:
                self._rang = True
            self._seen = value

    def _keep(self, value) -> None:
        if value is not None:
            self._pending.append(value)

    def unchanged(self, value) -> bool:
        """For a quiet call: keeps its alarm; False when a done one rang."""
        self._keep(value)
        self._read_done(wait=False)
        return not self._rang

    def hold(self, value, first_step: int, last_step: int, *,
             wait: bool) -> list[tuple[int, int]]:
        """Keeps this call's alarm and reads those done; `wait` is not
        honoured (a JAX step dates its own trouble)."""
        if self._since is None:
            self._since = first_step
        self._keep(value)
        self._read_done(wait=False)
        if not self._rang:
            return []
        self._rang = False
        since, self._since = self._since, last_step + 1
        return [(since, last_step)]

    def drain(self) -> tuple[int, int] | None:
        """Reads every pending alarm now (at a flush)."""
        self._read_done(wait=True)
        if not self._rang:
            return None
        self._rang = False
        since = self._since if self._since is not None else 0
        self._since = None
        return since, since
