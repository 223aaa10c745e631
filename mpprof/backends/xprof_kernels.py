"""Tensor Core share of GPU kernel time from an XProf trace, and the trace
window of `profile_steps`, for every backend (no framework imported here).

XProf's kernel_stats tool lists, per (kernel, op), the kernel's total time,
whether the op could use Tensor Cores (MatMul, Conv, Einsum, dot_general, ...
in fp16 or bf16; PyTorch's aten ops, which XProf does not know, by PyTorch's
own table: `tensor_core_eligible`) and whether the kernel did. "Did" is a
kernel-NAME heuristic
inside XProf (h884, hmma, s1688, xmma_gemm, ...): it misses some kernels, e.g.
`cutlass3x_sm90_tensorop_*`, so a low share is a hint to check, not proof.

Two ways in:
- `tensor_core_share(trace_dir)`: any directory holding a trace (a logdir,
  its `plugins/profile`, or one session), e.g. one written by
  `keras.callbacks.TensorBoard(profile_batch=...)` or a framework's profiler;
  the layers of its ops are read in each registered backend's naming
  (`layer_of`).
- `ProfileWindow`: the callback's opt-in `profile_steps=(start, stop)`
  window, which captures a trace into the run directory and converts it
  right after the window (`mpprof.backends.profile_window`). Each backend
  subclasses it with its profiler's start and stop (its `kernels.py`).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable

from mpprof.backends import REGISTRY, load
from mpprof.records import filesystem

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
    return summarize_kernel_stats(
        _kernel_stats_rows(xplane_paths(session)), source=session, top_ops=top_ops
    )


def xplane_paths(session: str) -> list[str]:
    """The `*.xplane.pb` files of one profiling session (one a host), sorted."""
    return sorted(
        filesystem.join(session, entry.name)
        for entry in filesystem.scan(session)
        if entry.name.endswith(_XPLANE_SUFFIX)
    )


def newest_session(trace_dir: str | os.PathLike) -> str | None:
    """The newest directory under `trace_dir` (itself included) with xplane files.

    Sessions are named by their start time (YYYY_MM_DD_HH_MM_SS), so the
    largest name is the newest; the path breaks ties.

    Args:
        trace_dir: the directory to search (local or a remote URL).
    """
    trace_dir = os.fspath(trace_dir)
    if not filesystem.isdir(trace_dir):
        return None
    sessions = [
        directory
        for directory, entries in filesystem.walk(trace_dir, on_error=lambda *_: None)
        if any(entry.name.endswith(_XPLANE_SUFFIX) for entry in entries)
    ]
    if not sessions:
        return None
    return max(sessions, key=lambda d: (os.path.basename(d.rstrip("/" + os.sep)), d))


def summarize_kernel_stats(
    rows: list[dict], *, source: str, top_ops: int = TOP_OPS
) -> dict:
    """The share record from kernel_stats rows (dicts keyed by column id).

    Args:
        rows: XProf's kernel_stats rows.
        source: the session they were read from.
        top_ops: how many eligible ops that did not use Tensor Cores to list.
    """
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
    eligible = [r for r in rows if r["is_op_tensor_core_eligible"]
                or tensor_core_eligible(r.get("op_name") or "")]
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


def kernel_stats_of_launches(launches: Iterable[tuple[str, str, float]]) -> list[dict]:
    """XProf's kernel_stats rows for GPU kernels another profiler recorded,
    so that XProf's kernel-name heuristic decides which use Tensor Cores
    for every backend (one classifier, XProf's).

    The launches become a synthetic XSpace (one NVIDIA GPU plane, a kernel
    event per launch carrying its op), converted in a scratch directory
    (XProf writes cache files next to a trace).

    Args:
        launches: `(kernel name, op name, duration in us)` per launch.

    Raises:
        KernelStatsError: xprof is missing, or cannot convert the launches.
    """
    with tempfile.TemporaryDirectory(prefix="mpprof-kernels-") as scratch:
        path = os.path.join(scratch, "launches" + _XPLANE_SUFFIX)
        with open(path, "wb") as f:
            f.write(_xspace(launches))
        return _kernel_stats_rows([path])


# The XSpace of `kernel_stats_of_launches`, in protobuf's wire format
# (tsl/profiler/protobuf/xplane.proto's field numbers): its proto ships with
# TensorFlow only, which a PyTorch or JAX install need not have.
_STAT_IDS = {"device_vendor": 1, "kernel_details": 2, "tf_op": 3}
# (XProf keys its rows by the launch shape too: one shape for all.)
_KERNEL_DETAILS = "regs:0 static_shmem:0 dynamic_shmem:0 grid:1,1,1 block:1,1,1"


def _xspace(launches: Iterable[tuple[str, str, float]]) -> bytes:
    def stat(name: str, text: str) -> bytes:  # XStat {metadata_id, str_value}
        return _field(1, _STAT_IDS[name]) + _field(5, text)

    kernel_ids: dict[str, int] = {}
    events = bytearray()
    offset_ps = 0
    for kernel, op, duration_us in launches:
        kernel_id = kernel_ids.setdefault(kernel, len(kernel_ids) + 1)
        duration_ps = round(duration_us * 1e6)
        # XEvent {metadata_id, offset_ps, duration_ps, stats}
        events += _field(4, _field(1, kernel_id) + _field(2, offset_ps)
                         + _field(3, duration_ps)
                         + _field(4, stat("kernel_details", _KERNEL_DETAILS))
                         + _field(4, stat("tf_op", op)))
        offset_ps += duration_ps
    # XPlane {id, name, lines, event_metadata, stat_metadata, stats}; a map
    # entry is {key, value}. XProf applies its Tensor Core heuristic to
    # NVIDIA planes only.
    plane = (_field(1, 1) + _field(2, "/device:GPU:0")
             + _field(3, _field(1, 1) + _field(2, "Stream #1") + bytes(events)))
    for number, ids in ((4, kernel_ids), (5, _STAT_IDS)):
        for name, metadata_id in ids.items():
            plane += _field(number, _field(1, metadata_id)
                            + _field(2, _field(1, metadata_id) + _field(2, name)))
    plane += _field(6, stat("device_vendor", "Nvidia"))
    return _field(1, plane)  # XSpace {planes}


def _field(number: int, value: int | str | bytes) -> bytes:
    """One protobuf field: a varint, or a length-delimited string or message."""
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    data = value.encode() if isinstance(value, str) else value
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def layer_of(op_name: str) -> str:
    """The layer of an op, from its name: each registered backend's
    `op_names.layer_of` reads its own framework's naming (TensorFlow's name
    scopes, JAX's name stacks, PyTorch's operators named after their layer)
    and gives None for the others', so the first that knows the name says.
    An op in no scope is its own layer.

    Args:
        op_name: the op's name, as XProf's kernel_stats gives it.
    """
    if "/" not in op_name:
        return op_name
    for registered in REGISTRY.values():
        if registered.op_names is not None:
            found = load(registered.op_names).layer_of(op_name)
            if found is not None:
                return found
    return op_name


def tensor_core_eligible(op_name: str) -> bool:
    """Whether a registered backend's own op table calls the op of
    `op_name` Tensor-Core eligible (its `op_names.tensor_core_eligible`,
    where XProf knows none of its ops: PyTorch's aten ops). XProf judges
    TensorFlow's and XLA's ops itself (the row's
    `is_op_tensor_core_eligible`), and an op whose kernel used Tensor Cores.

    Args:
        op_name: the op's name, as XProf's kernel_stats gives it.
    """
    for registered in REGISTRY.values():
        if registered.op_names is not None:
            judge = getattr(load(registered.op_names), "tensor_core_eligible", None)
            if judge is not None and judge(op_name):
                return True
    return False


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


def _kernel_stats_rows(paths: list[str]) -> list[dict]:
    try:
        from xprof.convert import raw_to_tool_data
    except ImportError as e:
        raise KernelStatsError(
            f'xprof is not installed ({e}): pip install "xprof>=2.20" (it comes with '
            "the mpprof[tensorflow], mpprof[jax] and mpprof[torch] extras)"
        ) from e
    try:
        data, _ = raw_to_tool_data.xspace_to_tool_data(paths, "kernel_stats", {})
    except Exception as e:  # the converter raises anything
        raise KernelStatsError(f"XProf could not convert {paths}: {e}") from e
    if not data:
        raise KernelStatsError(f"XProf returned no kernel_stats for {paths}")
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
