"""The XProf trace window of `profile_steps=(start, stop)`, for every backend.

The window opens before train step `start` runs, closes once step `stop` has
run, converts the trace (`xprof_kernels.tensor_core_share`) and says in the
run context's "kernels" entry what happened. A backend gives it its
profiler's start and stop and, where steps are dispatched asynchronously,
a wait for the device (`backends/tensorflow/kernels.py`,
`backends/jax/kernels.py`).

One profiler runs at a time, in TensorFlow and in JAX, and
keras.callbacks.TensorBoard(profile_batch=...) uses it too. If such a
callback profiles the same fit, the window is not traced: its trace is read
instead when fit ends. If another profiler is running when the window opens,
the window is skipped and the run context says why; training goes on.
"""

from __future__ import annotations

import time
from typing import Any

from mpprof.backends.xprof_kernels import KernelStatsError, newest_session, tensor_core_share
from mpprof.records import filesystem

_LATER = ("compute the share afterwards with "
          "mpprof.backends.xprof_kernels.tensor_core_share(LOG_DIR)")


class ProfileWindow:
    """Captures an XProf trace over train steps `start`..`stop` (inclusive).

    Args:
        start: first train step to trace (the step axis of every mpprof record).
        stop: last train step to trace.
        run_dir: the run directory; the trace lands in
            `run_dir/plugins/profile/<session>/`, where TensorBoard's profile
            tab finds it.
    """

    # The framework whose profiler the subclass runs, for the run context.
    framework = "the framework"

    def __init__(self, start: int, stop: int, run_dir: str):
        self.start, self.stop = start, stop
        self.run_dir = run_dir
        self.state = "waiting"
        self.reason = f"steps {start}-{stop} not reached yet"
        self.result: dict | None = None
        self._tensorboard: Any = None
        self._fit_started = 0.0
        self._traced_from = start
        # The last step the trace holds (known once mpprof's own trace stopped).
        self._traced_through: int | None = None
        self._last_step: int | None = None

    # What the backend's profiler does.

    def _start_profiler(self, run_dir: str) -> None:
        """Starts tracing into `run_dir`; raises if a profiler is running."""
        raise NotImplementedError

    def _stop_profiler(self) -> None:
        """Stops tracing and writes the trace."""
        raise NotImplementedError

    def _share(self, trace_dir: str) -> dict:
        """The Tensor Core share of the trace under `trace_dir` (a backend
        whose profiler writes no XProf trace reads its own)."""
        return tensor_core_share(trace_dir)

    def _wait_for_device(self) -> None:
        """Returns once the steps dispatched so far have run (a backend whose
        steps run asynchronously waits here, so the trace holds them whole)."""

    def _bind(self, backend) -> None:
        """Keeps what this fit's `backend` offers the waits (each fit has its own)."""

    # The recording core's calls (`mpprof.recording.collectors.gpu_host`).

    def begin(self, step: int, callbacks=(), backend=None) -> None:
        """At on_train_begin.

        Args:
            step: the step the fit starts at.
            callbacks: the fit's other callbacks: a profiling
                `backend.tensorboard_class` among them owns the profiler.
            backend: the fit's `mpprof.backends.base.Backend`.
        """
        self._fit_started = time.time()
        self._bind(backend)
        tensorboard = _profiling_tensorboard(
            callbacks, getattr(backend, "tensorboard_class", None))
        if tensorboard is not None and self.state in ("waiting", "reusing"):
            self._tensorboard = tensorboard
            self.state = "reusing"
            self.reason = (
                f"keras.callbacks.TensorBoard(profile_batch=...) profiles this fit and "
                f"{self.framework} runs one profiler at a time: mpprof reads its trace "
                f"instead of tracing steps {self.start}-{self.stop}"
            )
            return
        self.after_steps(step)

    def after_steps(self, step: int) -> dict | None:
        """After train steps up to `step` - 1 were dispatched; returns a
        result once the window is done."""
        self._last_step = step
        if self.state == "waiting" and self.start <= step <= self.stop:
            self._start_trace(step)
        elif self.state == "tracing" and step > self.stop:
            return self._stop_and_convert()
        return None

    def finish(self) -> dict | None:
        """At the end of fit (also on errors): closes an open window."""
        if self.state == "tracing":
            return self._stop_and_convert(cut_short=True)
        if self.state == "reusing" and self.result is None:
            return self._read_tensorboard_trace()
        if self.state == "waiting" and self._last_step is not None:
            self.reason = (
                f"never opened: the fit ended before step {self.start} (at step "
                f"{self._last_step}); a later fit continuing the steps may reach it"
            )
        return None

    def context(self) -> dict:
        entry = {
            "state": "ok"
            if self.result is not None
            else ("unavailable" if self.state in ("refused", "failed") else self.state),
            "window": [self.start, self.stop],
            "phase": self.state,
            "reason": self.reason,
        }
        if self.result is not None:
            entry["source"] = self.result.get("source")
            if self._traced_through is not None:
                # The steps its kernel times add up over (the advisor's
                # Amdahl divides by their count).
                entry["traced_steps"] = [self._traced_from, self._traced_through]
        return entry

    def _start_trace(self, step: int) -> None:
        # The trace holds the window's steps only, not the tail of earlier ones.
        self._wait_for_device()
        try:
            self._start_profiler(self.run_dir)
        except Exception as e:  # noqa: BLE001 - never break training for a trace
            self.state = "refused"
            self.reason = (
                f"another profiler was running at step {step} ({_message(e)}), so "
                f"steps {self.start}-{self.stop} were not traced. If it was "
                f"keras.callbacks.TensorBoard(profile_batch=...), {_LATER} on its "
                "log_dir"
            )
            return
        self.state = "tracing"
        self.reason = f"tracing since step {step}"
        self._traced_from = step

    def _stop_and_convert(self, cut_short: bool = False) -> dict | None:
        try:
            self._wait_for_device()
            device = ""
        except Exception as e:  # noqa: BLE001 - a failed step: the profiler must stop still
            device = f" (the device failed before the window's end: {_message(e)})"
        try:
            self._stop_profiler()
        except Exception as e:  # noqa: BLE001
            self.state = "failed"
            self.reason = f"the profiler failed to stop: {_message(e)}{device}"
            return None
        self.state = "done"
        # Cut short, the steps dispatched before the fit ended: up to
        # `_last_step` - 1 (`after_steps`).
        self._traced_through = (self._last_step - 1 if cut_short and self._last_step is not None
                                else self.stop)
        self.reason = f"traced steps {self._traced_from}-{self.stop}" + (
            " (cut short: fit ended inside the window)" if cut_short else ""
        ) + device
        return self._convert(self.run_dir)

    def _read_tensorboard_trace(self) -> dict | None:
        tensorboard = self._tensorboard
        if getattr(tensorboard, "_is_tracing", False):
            self.reason += f"; its trace was still open when mpprof finished: {_LATER}"
            return None
        trace_dir = getattr(tensorboard, "_train_dir", None) or filesystem.join(
            tensorboard.log_dir, "train"
        )
        session = newest_session(trace_dir)
        if session is None or _modified_before(session, self._fit_started):
            self.reason += "; it wrote no trace during this fit"
            return None
        return self._convert(session)

    def _convert(self, trace_dir: str) -> dict | None:
        try:
            self.result = self._share(trace_dir)
        except KernelStatsError as e:
            self.state = "failed"
            self.reason = f"{self.reason}; the trace could not be read: {e}"
            return None
        return self.result


def _profiling_tensorboard(callbacks, tensorboard_class: type | None):
    if tensorboard_class is None:
        return None
    for callback in callbacks:
        if isinstance(callback, tensorboard_class) and getattr(
            callback, "_should_trace", False
        ):
            return callback
    return None


def _modified_before(directory: str, when: float) -> bool:
    try:
        mtime_ns = filesystem.size_and_mtime(directory)[1]
    except OSError:
        return False
    # (0: an object store gave no time for a "directory": unknown, not old.)
    return 0 < mtime_ns / 1e9 < when - 1.0


def _message(error: BaseException) -> str:
    return getattr(error, "message", None) or str(error) or type(error).__name__
