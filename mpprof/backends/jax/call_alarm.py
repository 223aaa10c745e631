"""Whether a train-function call had trouble, read without waiting on JAX.

The profiled step returns, beside its logs, the alarm: skipped steps plus
steps with a non-finite loss so far (`StepState`). The dispatcher hands it
to the core in the logs (under `base.ALARM_LOGS_KEY`, taken out before Keras
sees them). Reading a value waits for its step, so the host reads only alarms
whose steps are done (`jax.Array.is_ready`), and the device runs ahead as in
Keras' own JAX fit; at a flush it reads them all. (Waiting for the call
before the last one cost the seed model a quarter of its step time on a
loaded 2-core CPU.) The alarm only arms forensic samples: the step dates
every overflow and the first non-finite loss itself, so the steps a rung
alarm reports are the calls since the last look, a range, not a date.

The alarm is a running count, so the newest done alarm says whether any
call since the last look rang: the host looks at most every
`LOOK_INTERVAL_S` (and reads that one alarm only; a read costs tens of us
on a CPU, a real share of a 1 ms step). On slow steps that is every call;
on fast ones a forensic sample comes a few calls later.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from mpprof.backends.patching import Patches

# Alarms not read yet, at most: past it one is waited for (a device far
# behind the host, or steps that never report ready).
MAX_PENDING = 64
# The least time between two looks at the pending alarms (one read each).
LOOK_INTERVAL_S = 0.005


class CallAlarm:
    """The step's alarm (same interface as the TensorFlow `CallAlarm`).

    Args:
        counters: unused on JAX (the step computes the alarm).
        host_reads_needed: unused on JAX (the alarm is always in the logs).
        start: the count the fit starts from (the step state's skipped and
            non-finite steps carried over), asked at the first read; None:
            the first alarm read sets it (an overflow in the first call is
            then missed).
    """

    def __init__(self, counters: Callable[[], list], host_reads_needed: Callable[[], bool],
                 start: Callable[[], int | None] | None = None):
        self._start = start
        self._seen: int | None = None
        self._pending: list = []
        self._rang = False
        self._since: int | None = None  # the first step not yet reported
        self._next_look = 0.0  # the `time.perf_counter()` of the next look

    def install(self, model, patches: Patches, in_logs: bool) -> None:
        self._seen = None  # `start` (or the first alarm read) sets it

    def _look(self, *, wait: bool) -> None:
        """Reads the newest pending alarm whose step is done (the newest of
        all with `wait`, or when too many are pending) and drops the older
        ones: each is a running count, the newest says it all."""
        pending = self._pending
        if not pending:
            return
        newest = len(pending) - 1
        if not wait and not pending[newest].is_ready():
            # Steps finish in order (each takes the state the last one
            # donated): the done ones are the oldest, found by bisection
            # (a device far behind leaves many pending).
            done, not_done = -1, newest
            while not_done - done > 1:
                middle = (done + not_done) // 2
                if pending[middle].is_ready():
                    done = middle
                else:
                    not_done = middle
            newest = done
            if newest < 0:
                if len(pending) <= MAX_PENDING:
                    return
                newest = len(pending) - MAX_PENDING - 1  # waited for
        # (np.asarray: a few us where int() of a jax.Array takes ten.)
        value = int(np.asarray(pending[newest]))
        del pending[:newest + 1]
        if self._seen is None and self._start is not None:
            self._seen = self._start()
        if self._seen is not None and value != self._seen:
            self._rang = True
        self._seen = value

    def unchanged(self, value) -> bool:
        """For a quiet call: keeps its alarm; False when a done one rang
        (looked at every `LOOK_INTERVAL_S`, or when too many are pending)."""
        pending = self._pending
        if value is not None:
            pending.append(value)
        now = time.perf_counter()
        if now < self._next_look and len(pending) <= MAX_PENDING:
            return not self._rang
        self._next_look = now + LOOK_INTERVAL_S
        self._look(wait=False)
        return not self._rang

    def hold(self, value, first_step: int, last_step: int, *,
             wait: bool) -> list[tuple[int, int]]:
        """Keeps this call's alarm and reads the newest done one; `wait` is
        not honoured (a JAX step dates its own trouble)."""
        if self._since is None:
            self._since = first_step
        if value is not None:
            self._pending.append(value)
        self._look(wait=False)
        if not self._rang:
            return []
        self._rang = False
        since, self._since = self._since, last_step + 1
        return [(since, last_step)]

    def drain(self) -> tuple[int, int] | None:
        """Reads every pending alarm now (at a flush)."""
        self._look(wait=True)
        if not self._rang:
            return None
        self._rang = False
        since = self._since if self._since is not None else 0
        self._since = None
        return since, since
