"""Tensor Core share of GPU kernel time, from an XProf (tf.profiler) trace.

XProf's kernel_stats tool lists, per (kernel, op), the kernel's total time,
whether the op could use Tensor Cores (MatMul, Conv, Einsum, ... in fp16 or
bf16) and whether the kernel did. "Did" is a kernel-NAME heuristic inside
XProf (h884, hmma, s1688, xmma_gemm, ...): it misses some kernels, e.g.
`cutlass3x_sm90_tensorop_*`, so a low share is a hint to check, not proof.

Two ways in:
- `tensor_core_share(trace_dir)`: any directory holding a trace (a logdir,
  its `plugins/profile`, or one session), e.g. one written by
  `keras.callbacks.TensorBoard(profile_batch=...)`.
- `ProfileWindow`: the callback's opt-in `profile_steps=(start, stop)`
  window, which captures a trace into the run directory and converts it
  right after the window.
"""

from __future__ import annotations

import json
import os
import posixpath
import time

import tensorflow as tf

# Eligible-but-not-using ops listed in the record, largest first.
TOP_OPS = 10

_XPLANE_SUFFIX = ".xplane.pb"


class KernelStatsError(RuntimeError):
    """The trace cannot be found or converted."""


def tensor_core_share(trace_dir: str | os.PathLike, *, top_ops: int = TOP_OPS) -> dict:
    """Tensor Core share of GPU kernel time in the newest trace under `trace_dir`.

    Args:
        trace_dir: a directory holding `*.xplane.pb` files, or any directory
            above one (a TensorBoard logdir, its `train/`, `plugins/profile`):
            the newest profiling session found below it is read.
        top_ops: how many Tensor-Core-eligible ops that did NOT use Tensor
            Cores to list.

    Returns:
        A JSON-ready dict (the `kernels/tensor_core_share` record):
        `{"source", "tensor_core_share", "total_gpu_kernel_us",
        "tensor_core_us", "eligible_us", "eligible_not_using_us", "top_ops":
        [{"op_name", "layer", "total_us", "occurrences", "kernels"}...]}`, or
        `{"source", "no_gpu_kernels": True, "reason"}` for a trace without GPU
        kernels (a CPU-only run): "no data", never 0%.

    Raises:
        KernelStatsError: no trace under `trace_dir`, or XProf cannot convert it.
    """
    session = newest_session(trace_dir)
    if session is None:
        raise KernelStatsError(
            f"No XProf trace (*{_XPLANE_SUFFIX}) under {os.fspath(trace_dir)!r}: "
            "record one with MixedPrecisionProfiler(profile_steps=(start, stop)) or "
            "keras.callbacks.TensorBoard(profile_batch=(start, stop))."
        )
    paths = sorted(
        posixpath.join(session, name)
        for name in tf.io.gfile.listdir(session)
        if name.endswith(_XPLANE_SUFFIX)
    )
    return summarize_kernel_stats(
        _kernel_stats_rows(paths), source=session, top_ops=top_ops
    )


def newest_session(trace_dir: str | os.PathLike) -> str | None:
    """The newest directory under `trace_dir` (itself included) with xplane files.

    Sessions are named by their start time (YYYY_MM_DD_HH_MM_SS), so the
    largest name is the newest; the path breaks ties.
    """
    trace_dir = os.fspath(trace_dir)
    if not tf.io.gfile.isdir(trace_dir):
        return None
    sessions = [
        directory
        for directory, _, files in tf.io.gfile.walk(trace_dir)
        if any(name.endswith(_XPLANE_SUFFIX) for name in files)
    ]
    if not sessions:
        return None
    return max(sessions, key=lambda d: (posixpath.basename(d.rstrip("/")), d))


def summarize_kernel_stats(
    rows: list[dict], *, source: str, top_ops: int = TOP_OPS
) -> dict:
    """The share record from kernel_stats rows (dicts keyed by column id)."""
    total = sum(float(r["total_duration_us"]) for r in rows)
    if not rows or total <= 0:
        return {
            "source": source,
            "no_gpu_kernels": True,
            "tensor_core_share": None,
            "reason": (
                "the trace holds no GPU kernels (a CPU-only run, or the profiled "
                "steps ran nothing on a GPU): no Tensor Core share to compute"
            ),
        }
    using = sum(
        float(r["total_duration_us"]) for r in rows if r["is_kernel_using_tensor_core"]
    )
    eligible = [r for r in rows if r["is_op_tensor_core_eligible"]]
    missed = [r for r in eligible if not r["is_kernel_using_tensor_core"]]
    return {
        "source": source,
        "no_gpu_kernels": False,
        "tensor_core_share": using / total,
        "total_gpu_kernel_us": total,
        "tensor_core_us": using,
        "eligible_us": sum(float(r["total_duration_us"]) for r in eligible),
        "eligible_not_using_us": sum(float(r["total_duration_us"]) for r in missed),
        "kernel_rows": len(rows),
        "top_ops": _top_missed_ops(missed, top_ops),
        "heuristic": (
            "XProf decides 'uses Tensor Cores' from the kernel name; newer "
            "kernels (e.g. cutlass3x_sm90_tensorop_*) can be missed"
        ),
    }


def layer_of(op_name: str) -> str:
    """The layer of an op, from its name scope: "seq/dense/MatMul" -> "seq/dense"."""
    return op_name.rsplit("/", 1)[0] if "/" in op_name else op_name


def _top_missed_ops(missed: list[dict], top_ops: int) -> list[dict]:
    by_op: dict[str, dict] = {}
    for row in missed:
        op_name = row.get("op_name") or "(unknown op)"
        entry = by_op.setdefault(
            op_name,
            {
                "op_name": op_name,
                "layer": layer_of(op_name),
                "total_us": 0.0,
                "occurrences": 0,
                "kernels": [],
            },
        )
        entry["total_us"] += float(row["total_duration_us"])
        entry["occurrences"] += int(row.get("occurrences") or 0)
        if row.get("kernel_name") and row["kernel_name"] not in entry["kernels"]:
            entry["kernels"].append(row["kernel_name"])
    ranked = sorted(by_op.values(), key=lambda e: (-e["total_us"], e["op_name"]))
    return ranked[:top_ops]


def _kernel_stats_rows(xplane_paths: list[str]) -> list[dict]:
    try:
        from xprof.convert import raw_to_tool_data
    except ImportError as e:
        raise KernelStatsError(
            f"xprof is not installed ({e}): pip install tensorboard-plugin-profile"
        ) from e
    try:
        data, _ = raw_to_tool_data.xspace_to_tool_data(xplane_paths, "kernel_stats", {})
    except Exception as e:  # the converter raises anything
        raise KernelStatsError(f"XProf could not convert {xplane_paths}: {e}") from e
    if not data:
        raise KernelStatsError(f"XProf returned no kernel_stats for {xplane_paths}")
    table = json.loads(data)
    columns = [c["id"] for c in table.get("cols", [])]
    required = {
        "total_duration_us",
        "is_op_tensor_core_eligible",
        "is_kernel_using_tensor_core",
    }
    if table.get("rows") and not required <= set(columns):
        raise KernelStatsError(
            f"XProf's kernel_stats lacks columns {sorted(required - set(columns))}: "
            "this xprof version is not supported"
        )
    return [
        {
            column: cell.get("v") if cell else None
            for column, cell in zip(columns, row["c"], strict=False)
        }
        for row in table.get("rows", [])
    ]


class ProfileWindow:
    """Captures an XProf trace over train steps `start`..`stop` (inclusive).

    TensorFlow runs one profiler at a time, and keras.callbacks.TensorBoard
    (profile_batch=...) uses it too. If such a callback is in the same fit,
    the window is not traced: its trace is read instead when fit ends. If
    another profiler is running when the window opens, the window is skipped
    and the run context says why; training goes on.

    Args:
        start: first train step to trace (the step axis of every mpprof record).
        stop: last train step to trace.
        run_dir: the run directory; the trace lands in
            `run_dir/plugins/profile/<session>/`, where TensorBoard's profile
            tab finds it.
    """

    def __init__(self, start: int, stop: int, run_dir: str):
        self.start, self.stop = start, stop
        self.run_dir = run_dir
        self.state = "waiting"
        self.reason = f"steps {start}-{stop} not reached yet"
        self.result: dict | None = None
        self._tensorboard = None
        self._fit_started = 0.0
        self._traced_from = start

    def begin(self, step: int, callbacks=(), tensorboard_class: type | None = None) -> None:
        """At on_train_begin: notices a profiling TensorBoard callback (an
        instance of the model's Keras' `tensorboard_class`) among `callbacks`."""
        self._fit_started = time.time()
        tensorboard = _profiling_tensorboard(callbacks, tensorboard_class)
        if tensorboard is not None and self.state in ("waiting", "reusing"):
            self._tensorboard = tensorboard
            self.state = "reusing"
            self.reason = (
                "keras.callbacks.TensorBoard(profile_batch=...) profiles this fit and "
                "TensorFlow runs one profiler at a time: mpprof reads its trace "
                "instead of tracing steps "
                f"{self.start}-{self.stop}"
            )
            return
        self.after_steps(step)

    def after_steps(self, step: int) -> dict | None:
        """After train steps up to `step` - 1 ran; returns a result once done."""
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
        return entry

    def _start_trace(self, step: int) -> None:
        try:
            tf.profiler.experimental.start(self.run_dir)
        except Exception as e:  # noqa: BLE001 - never break training for a trace
            self.state = "refused"
            self.reason = (
                f"another profiler was running at step {step} ({_message(e)}), so "
                f"steps {self.start}-{self.stop} were not traced. If it was "
                "keras.callbacks.TensorBoard(profile_batch=...), compute the share "
                "from its trace: mpprof.backends.tensorflow.kernels.tensor_core_share(LOG_DIR)"
            )
            return
        self.state = "tracing"
        self.reason = f"tracing since step {step}"
        self._traced_from = step

    def _stop_and_convert(self, cut_short: bool = False) -> dict | None:
        try:
            tf.profiler.experimental.stop()
        except Exception as e:  # noqa: BLE001
            self.state = "failed"
            self.reason = f"the profiler failed to stop: {_message(e)}"
            return None
        self.state = "done"
        self.reason = f"traced steps {self._traced_from}-{self.stop}" + (
            " (cut short: fit ended inside the window)" if cut_short else ""
        )
        return self._convert(self.run_dir)

    def _read_tensorboard_trace(self) -> dict | None:
        tensorboard = self._tensorboard
        if getattr(tensorboard, "_is_tracing", False):
            self.reason += (
                "; its trace was still open when mpprof finished: compute the share "
                "afterwards with mpprof.backends.tensorflow.kernels.tensor_core_share(LOG_DIR)"
            )
            return None
        trace_dir = getattr(tensorboard, "_train_dir", None) or posixpath.join(
            tensorboard.log_dir, "train"
        )
        session = newest_session(trace_dir)
        if session is None or _modified_before(session, self._fit_started):
            self.reason += "; it wrote no trace during this fit"
            return None
        return self._convert(session)

    def _convert(self, trace_dir: str) -> dict | None:
        try:
            self.result = tensor_core_share(trace_dir)
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
        return tf.io.gfile.stat(directory).mtime_nsec / 1e9 < when - 1.0
    except (OSError, tf.errors.OpError):
        return False


def _message(error: BaseException) -> str:
    return getattr(error, "message", None) or str(error) or type(error).__name__
