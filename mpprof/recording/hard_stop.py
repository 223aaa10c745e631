"""Keeping the records of a run that is stopped from outside.

The loss-scale events wait in an in-graph ring until the host reads them. A
process that is killed loses what was not read yet, which is exactly the
evidence wanted after a crash, so the host reads and writes it at least
every `flush_every_seconds` (`FlushSchedule`) and when SIGTERM arrives
(`SigtermFlush`, which then hands the signal on: to the handler that was
there before, or to the default action, which ends the process).
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any


class FlushSchedule:
    """Says when records are due on disk: after `every_steps` train steps
    or `every_seconds` seconds since the last flush, whichever comes first.

    Args:
        every_steps: train steps between flushes.
        every_seconds: seconds between flushes; None: by steps only.
    """

    def __init__(self, every_steps: int, every_seconds: float | None):
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.steps = 0  # train steps since the last flush
        self.reset()

    def reset(self) -> None:
        """A flush was made."""
        self.steps = 0
        self._last = time.monotonic()

    def due(self) -> bool:
        return self.steps >= self.every_steps or time.monotonic() >= self.deadline()

    def deadline(self) -> float:
        """The `time.monotonic()` at which a flush falls due by time (inf: never)."""
        return math.inf if self.every_seconds is None else self._last + self.every_seconds

    def steps_free(self) -> int:
        """Steps that may still run before the next one makes a flush due."""
        return self.every_steps - self.steps - 1


class SigtermFlush:
    """Runs `flush` on SIGTERM, then lets the signal do what it did before.

    Installed only from the main thread (Python delivers signals there);
    elsewhere `install` does nothing and says so in `state`.

    Args:
        flush: what to save; its errors are swallowed so that the signal is
            always passed on.
    """

    def __init__(self, flush: Callable[[], None]):
        self._flush = flush
        self._previous: Any = None
        self._installed = False
        self.state = "not installed"

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            self.state = "not installed: fit runs outside the main thread"
            return
        try:
            self._previous = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._handle)
        except (ValueError, OSError) as e:
            self.state = f"not installed: {e}"
            return
        self._installed = True
        self.state = "installed"

    def remove(self) -> None:
        if not self._installed:
            return
        self._installed = False
        # Someone installed their own handler after ours: leave theirs.
        if signal.getsignal(signal.SIGTERM) == self._handle:
            signal.signal(signal.SIGTERM, self._previous)

    def _handle(self, signum, frame) -> None:
        try:
            self._flush()
        except Exception:  # noqa: BLE001 - the signal must go on regardless
            pass
        previous = self._previous
        self.remove()
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_IGN:
            return
        else:  # SIG_DFL (or unknown): the default action ends the process
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
