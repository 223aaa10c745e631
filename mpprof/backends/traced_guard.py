"""mpprof's own code inside a user's traced train step: its failure is
reported to the fit's `Guard` (`mpprof.recording.guard`), never raised into
the step; and the one-line description of an error every report uses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class TracedGuard:
    """Runs mpprof's own part of a traced function (a hook inside the user's
    train step) so that its failure is reported, never raised into the step.

    Args:
        on_error: called with the exception; by default it is raised (a
            collector used on its own); the profiler reports it to its
            `Guard` instead.
    """

    def __init__(self):
        self.on_error: Callable[[Exception], None] | None = None

    def __call__(self, record: Callable[[], Any]) -> Any:
        """`record()`, or None after reporting its failure."""
        try:
            return record()
        except Exception as e:
            if self.on_error is None:
                raise
            self.on_error(e)
            return None


def describe_error(error: BaseException) -> str:
    """`TypeName: first line of the message`, at most 300 characters."""
    message = getattr(error, "message", None) or str(error)
    first_line = message.strip().splitlines()[0] if message.strip() else ""
    return f"{type(error).__name__}: {first_line}"[:300]
