"""Keeping the records of a run that is stopped from outside.

The loss-scale events wait in an in-graph ring until the host reads them. A
process that is killed loses what was not read yet, which is exactly the
evidence wanted after a crash, so the host reads and writes it at least
every `flush_every_seconds` (`FlushClock`) and when SIGTERM arrives
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


class FlushClock:
    """Says when `interval_s` seconds have passed since the last flush.

    Args:
        interval_s: seconds between flushes; None never asks for one.
    """

    def __init__(self, interval_s: float | None):
        self.interval_s = interval_s
        self.reset()

    def reset(self) -> None:
        self._last = time.monotonic()

    def due(self) -> bool:
        return time.monotonic() >= self.deadline()

    def deadline(self) -> float:
        """The `time.monotonic()` at which a flush falls due (inf: never)."""
        return math.inf if self.interval_s is None else self._last + self.interval_s


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
        self._previous = None
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
