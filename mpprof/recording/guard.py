"""The seam that keeps mpprof's own failures out of the user's training.

Whatever a collector raises while recording is caught here: the collector
is switched off for the rest of the fit, the run context names it and the
reason, one warning line says so, and training goes on. Writing records is
guarded the same way (a full disk stops the recording, not the training).
Errors of the user's own model, loss or data are never caught here: they
reach `fit`'s caller unchanged.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

from mpprof.backends.traced_guard import describe_error

logger = logging.getLogger(__name__)


class Guard:
    """Which collectors failed during this fit, and why."""

    def __init__(self):
        self.failures: dict[str, str] = {}
        # Set while a fit that raised is being finished: a part failing then
        # is recorded in the run context, but no warning says "training goes
        # on" beside the user's own error.
        self.fit_raised = False

    def ok(self, collector: str) -> bool:
        return collector not in self.failures

    def run(self, collector: str, function: Callable[..., Any], *args, **kwargs) -> Any:
        """`function(*args, **kwargs)`, or None once `collector` has failed."""
        if collector in self.failures:
            return None
        try:
            return function(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a collector must not stop training
            self.fail(collector, e)
            return None

    def fail(self, collector: str, error: BaseException | str) -> None:
        """Switches `collector` off for the rest of the fit, with one warning."""
        if collector in self.failures:
            return
        reason = error if isinstance(error, str) else describe_error(error)
        self.failures[collector] = reason
        if self.fit_raised:
            return
        what = ("stopped writing its records" if collector == GuardedWriter.COLLECTOR
                else f"stopped recording {collector}")
        warnings.warn(f"mpprof: {what} ({reason}); training goes on.", RuntimeWarning,
                      stacklevel=3)

    def context(self, collector: str, state: dict) -> dict:
        """`state`, or the "failed" state when `collector` failed."""
        if collector in self.failures:
            return {**state, "state": "failed", "reason": self.failures[collector]}
        return state


class GuardedHook:
    """A layer-call hook whose failure switches its collector off.

    Args:
        collector: the collector's name in the run context.
        hook: an object with `on_call(layer, args, kwargs, outputs)`.
        guard: the profiler's `Guard`.
    """

    def __init__(self, collector: str, hook, guard: Guard):
        self.collector = collector
        self.hook = hook
        self._guard = guard

    def on_call(self, layer, args, kwargs, outputs):
        if not self._guard.ok(self.collector):
            return outputs
        try:
            return self.hook.on_call(layer, args, kwargs, outputs)
        except Exception as e:  # noqa: BLE001 - the layer's own outputs go on
            self._guard.fail(self.collector, e)
            return outputs


class GuardedWriter:
    """A record writer whose first failure stops the recording, not the fit.

    Args:
        writer: a `mpprof.records.writer.RecordWriter` (or `DiscardingWriter`).
        guard: where the failure is reported, as the collector "recording".
    """

    COLLECTOR = "recording"

    def __init__(self, writer, guard: Guard):
        self._writer = writer
        self._guard = guard

    def write_json(self, record: str, value, step: int) -> None:
        self._guard.run(self.COLLECTOR, self._writer.write_json, record, value, step)

    def write_array(self, record: str, value, step: int, series: str | None = None) -> None:
        if series is None:
            self._guard.run(self.COLLECTOR, self._writer.write_array, record, value, step)
        else:
            self._guard.run(
                self.COLLECTOR, self._writer.write_array, record, value, step, series=series
            )

    @property
    def writer_id(self) -> str | None:
        """The writer's id (`RecordWriter.writer_id`); None for one that
        writes nothing."""
        return getattr(self._writer, "writer_id", None)

    def write_file(self, relative_path: str, data: bytes) -> bool:
        """Writes a file into the run directory; returns whether it was written
        (False once the recording stopped)."""
        written = self._guard.run(
            self.COLLECTOR, lambda: self._writer.write_file(relative_path, data) or True
        )
        return bool(written)

    def flush(self) -> None:
        self._guard.run(self.COLLECTOR, self._writer.flush)

    def close(self) -> None:
        try:
            self._writer.close()
        except Exception as e:  # noqa: BLE001 - closing must not raise into fit
            self._guard.fail(self.COLLECTOR, e)

    def mark_fit_end(self, fit_state: str, step: int) -> None:
        """Says how the fit ended, also after a failed write stopped the
        records (the writer's reserved fit-end file; see `RecordWriter`)."""
        mark = getattr(self._writer, "mark_fit_end", None)
        if mark is None:
            return
        try:
            mark(fit_state, step, self._guard.failures.get(self.COLLECTOR))
        except Exception:  # noqa: BLE001 - nothing left to write with
            pass

    def write_digest(self) -> None:
        """Writes the run's digest (`mpprof.display.run_digest`: the run
        list's row, so that the first read of a sweep reads no records),
        once the records are closed; nothing where the recording stopped
        (a full disk, a store that did not answer is not asked again)."""
        run_dir = getattr(self._writer, "run_dir", None)
        if run_dir is None or self.COLLECTOR in self._guard.failures:
            return
        try:
            from mpprof.display import run_digest  # the diagnosis: at the fit's end only

            run_digest.write(run_dir)
        except Exception as e:  # noqa: BLE001 - the digest only saves a reader time
            logger.debug("mpprof: no digest written for %s (%s)", run_dir, e)


# How much of a failed fit's error message the run context keeps.
MAX_FIT_ERROR_MESSAGE = 4000


def describe_fit_error(error: BaseException | None, step: int) -> dict | None:
    """What `model.fit` raised at `step`, for the run context's "fit_error"."""
    if error is None:
        return None
    message = getattr(error, "message", None) or str(error)
    return {
        "type": type(error).__name__,
        "module": type(error).__module__,
        "message": message[:MAX_FIT_ERROR_MESSAGE],
        "step": int(step),
    }
