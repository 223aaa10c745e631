"""The profile window of `profile_steps` on PyTorch: `torch.profiler`.

The window's states are every backend's (`mpprof.backends.profile_window`).
`torch.profiler.profile` traces the CPU, and CUDA where a GPU is visible;
each traced step (each call, where a call runs several) is a
`ProfilerStep#<step>` range, named by mpprof's step axis. The trace is a
Chrome trace, written as
`RUN_DIR/plugins/profile/<session>/<host>_<pid>.pt.trace.json` beside the
other backends' XProf sessions: Perfetto, chrome://tracing and PyTorch's
TensorBoard profiler open it.

Each layer call of the window's steps is a range of the trace
(`layer_calls.LAYER_RANGE` + the layer's path; the window switches the layer
wrappers' `ranges` on for its steps only). An op belongs to the innermost
layer range around it on its thread; an op of the backward pass to the
layer of the forward op its autograd node derives from (the trace's
"fwdbwd" flow links the two, `op_layers`).

The Tensor Core share is XProf's over the trace's CUDA kernels
(`xprof_kernels.kernel_stats_of_launches`: XProf's kernel-name heuristic
decides, as on TensorFlow and JAX), each kernel attributed to the aten op
that launched it, named after its layer as XProf names a TensorFlow op
after its scopes ("sequential/dense/aten::mm": `op_names` reads the layer
back). XProf knows no aten op's Tensor Core eligibility: PyTorch's table
decides it (`op_names.TENSOR_CORE_OPS`: the GEMM and convolution ops,
`xprof_kernels.tensor_core_eligible`), beside XProf's own rule that an op
whose kernel used Tensor Cores was eligible, so the record holds the
eligible time and the eligible ops that missed Tensor Cores (`top_ops`,
with their layers) as on TensorFlow and JAX. A trace
without CUDA kernels (a CPU-only run) records "no GPU kernels", never 0%.

Under `jit_compile=True` (torch.compile) the layer calls are no ranges: a
range switched on inside the step would make dynamo recompile it in the
window and could change inductor's fusion, so the traced kernels would not
be those of the steps outside it. The window traces as without layers; its
ops carry none (the run context's reason says so).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable

import torch

from mpprof.backends import profile_window, xprof_kernels
from mpprof.backends.torch.layer_calls import LAYER_RANGE
from mpprof.records import filesystem


class ProfileWindow(profile_window.ProfileWindow):
    """Traces train steps `start`..`stop` with `torch.profiler` (see
    `mpprof.backends.profile_window.ProfileWindow` for the arguments)."""

    framework = "PyTorch"

    def __init__(self, start: int, stop: int, run_dir: str):
        super().__init__(start, stop, run_dir)
        self._profile: torch.profiler.profile | None = None
        self._step_range: torch.profiler.record_function | None = None
        self._events: list[dict] = []
        self._session = ""
        # This fit's layer wrappers (`layer_calls.LayerCallPatch`), whose
        # `ranges` mark each layer call while the window traces (None when
        # they may not: `_layers_off` says why).
        self._layer_patch = None
        self._layers_off: str | None = None

    def _bind(self, backend) -> None:
        patch = getattr(backend, "layer_patch", None)
        self._layers_off = patch.ranges_off if patch is not None else None
        self._layer_patch = None if self._layers_off else patch

    def context(self) -> dict:
        entry = super().context()
        if self._layers_off and self.result is not None:
            entry["reason"] += f"; {self._layers_off}"
        return entry

    def after_steps(self, step: int) -> dict | None:
        self._close_step_range()
        result = super().after_steps(step)
        if self.state == "tracing":
            self._step_range = torch.profiler.record_function(f"ProfilerStep#{step}")
            self._step_range.__enter__()
            self._mark_layers(True)
        return result

    def _wait_for_device(self) -> None:
        # Kernels run asynchronously: the trace holds the window's steps whole.
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def _start_profiler(self, run_dir: str) -> None:
        if torch.autograd._profiler_enabled():
            raise RuntimeError("a torch.profiler or torch.autograd.profiler is running")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile = torch.profiler.profile(activities=activities)
        profile.start()
        self._profile = profile

    def _stop_profiler(self) -> None:
        # A range still open here is that of a step the fit ended before
        # (`after_steps` closes the ranges of the steps that ran): it holds
        # the fit's end, no step, and leaves the trace.
        unrun = self._step_range.name if self._step_range is not None else None
        self._mark_layers(False)
        self._close_step_range()
        profile, self._profile = self._profile, None
        if profile is None:
            return
        profile.stop()
        with tempfile.TemporaryDirectory(prefix="mpprof-trace-") as scratch:
            local = os.path.join(scratch, "trace.json")
            profile.export_chrome_trace(local)
            with open(local, "rb") as f:
                trace = json.load(f)
        trace["traceEvents"] = self._events = [
            event for event in trace.get("traceEvents", [])
            if not (event.get("cat") == "user_annotation" and event.get("name") == unrun)]
        data = json.dumps(trace).encode()
        session = filesystem.join(self.run_dir, "plugins", "profile",
                                  time.strftime("%Y_%m_%d_%H_%M_%S"))
        filesystem.makedirs(session)
        filesystem.write_bytes(filesystem.join(
            session, f"{socket.gethostname()}_{os.getpid()}.pt.trace.json"), data)
        self._session = session

    def _share(self, trace_dir: str) -> dict:
        return tensor_core_share(self._events, source=self._session)

    def _mark_layers(self, on: bool) -> None:
        if self._layer_patch is not None:
            self._layer_patch.ranges = on

    def _close_step_range(self) -> None:
        if self._step_range is not None:
            step_range, self._step_range = self._step_range, None
            step_range.__exit__(None, None, None)


def kernel_launches(trace_events: Iterable[dict]) -> list[tuple[str, str, float]]:
    """The CUDA kernels of a `torch.profiler` Chrome trace.

    Args:
        trace_events: the trace's `traceEvents`.

    Returns:
        `(kernel name, op that launched it, duration in us)` per kernel; a
        kernel is tied to its op by their shared "External id", and the op
        is named after its layer ("sequential/dense/aten::mm", `op_layers`;
        "aten::mm" when it ran in no layer).
    """
    events = list(trace_events)
    layers = op_layers(events)
    ops = {}
    for event in events:
        external_id = event.get("args", {}).get("External id")
        if event.get("cat") == "cpu_op" and external_id is not None:
            layer = layers.get(external_id)
            ops[external_id] = f"{layer}/{event['name']}" if layer else event["name"]
    return [(event["name"], ops.get(event.get("args", {}).get("External id"), "(unknown op)"),
             float(event.get("dur", 0.0)))
            for event in events if event.get("cat") == "kernel"]


def op_layers(trace_events: Iterable[dict]) -> dict[int, str]:
    """The layer of each op of a `torch.profiler` Chrome trace.

    An op runs in the innermost layer range (`layer_calls.LAYER_RANGE`)
    around it on its thread. A backward op runs in no layer's range (the
    autograd engine runs it, after the forward pass, on its own thread on a
    GPU): its autograd node (MmBackward0, ...) is linked to the forward op
    it derives from by a "fwdbwd" flow (from the forward op's start to the
    node's start, paired by "id"), and the node's ops get that forward op's
    layer.

    Args:
        trace_events: the trace's `traceEvents`.

    Returns:
        {op's "External id": layer path}, for the ops that ran in a layer.
    """
    events = list(trace_events)
    # Each flow's ends, as (pid, tid, ts): its start is the forward op's.
    starts: dict[object, tuple] = {}
    ends: dict[object, tuple] = {}
    for event in events:
        if event.get("cat") == "fwdbwd" and event.get("ph") in ("s", "f"):
            point = (event.get("pid"), event.get("tid"), event.get("ts"))
            (starts if event["ph"] == "s" else ends)[event.get("id")] = point
    forward_of = {ends[flow]: starts[flow] for flow in ends.keys() & starts.keys()}
    # An owner is ("layer", path) or ("forward", the forward op's point).
    owners: dict[int, tuple[str, object] | None] = {}  # by op, its External id
    at_point: dict[tuple, tuple[str, object] | None] = {}  # by op start
    threads: dict[tuple, list[dict]] = defaultdict(list)
    for event in events:
        if event.get("ph") == "X" and (event.get("cat") == "cpu_op" or (
                event.get("cat") == "user_annotation"
                and event.get("name", "").startswith(LAYER_RANGE))):
            threads[event.get("pid"), event.get("tid")].append(event)
    for (pid, tid), thread in threads.items():
        # Parents before their children: by start, the longer first.
        thread.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))))
        open_ranges: list[tuple[float, tuple[str, object] | None]] = []
        for event in thread:
            ts = float(event["ts"])
            while open_ranges and open_ranges[-1][0] <= ts:
                open_ranges.pop()
            point = (pid, tid, event["ts"])
            if event["cat"] == "user_annotation":
                owner: tuple[str, object] | None = ("layer", event["name"][len(LAYER_RANGE):])
            elif point in forward_of:
                owner = ("forward", forward_of[point])
            else:
                owner = open_ranges[-1][1] if open_ranges else None
            open_ranges.append((ts + float(event.get("dur", 0.0)), owner))
            if event["cat"] == "cpu_op":
                at_point.setdefault(point, owner)
                if "External id" in event.get("args", {}):
                    owners[event["args"]["External id"]] = owner

    def layer(owner, hops: int = 0) -> str | None:
        # (A forward op may itself be of a backward pass: double backward.)
        while owner is not None and owner[0] == "forward" and hops < 8:
            owner, hops = at_point.get(owner[1]), hops + 1
        return owner[1] if owner is not None and owner[0] == "layer" else None

    found = {op: layer(owner) for op, owner in owners.items()}
    return {op: path for op, path in found.items() if path is not None}


def tensor_core_share(trace_events: Iterable[dict], *, source: str) -> dict:
    """The `kernels/tensor_core_share` record of a `torch.profiler` trace
    (`mpprof.backends.xprof_kernels.tensor_core_share` has its fields).

    Args:
        trace_events: the Chrome trace's `traceEvents`.
        source: the session directory the trace was written to.

    Raises:
        KernelStatsError: there are CUDA kernels and XProf cannot classify them.
    """
    launches = kernel_launches(trace_events)
    rows = xprof_kernels.kernel_stats_of_launches(launches) if launches else []
    # The aten ops' eligibility: PyTorch's op table (`op_names`, registered
    # in `REGISTRY`), which `summarize_kernel_stats` asks.
    return xprof_kernels.summarize_kernel_stats(rows, source=source)
