"""The `profile_steps` window on PyTorch: `torch.profiler` over a real fit on
CPU, its Chrome trace, and the Tensor Core share of CUDA kernels (XProf's
kernel-name heuristic, over hand-made kernel events: no GPU here)."""

from __future__ import annotations

import glob
import json
import os
import sys

import jax_runs
import keras
import numpy as np
import pytest

from mpprof.backends.torch import kernels
from mpprof.records import schema


def weights(model) -> list[np.ndarray]:
    return [keras.ops.convert_to_numpy(w.value) for w in model.weights]


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """A fit of 8 steps traced over steps 2-4, and its unprofiled twin."""
    x, y = jax_runs.classes()
    twin = jax_runs.classifier("mixed_float16")
    twin.fit(x, y, batch_size=8, verbose=0, shuffle=False)
    model = jax_runs.classifier("mixed_float16")
    log_dir = tmp_path_factory.mktemp("traced")
    run = jax_runs.fit(log_dir, model, x, y, profile_steps=(2, 4))
    return run, model, weights(twin)


def test_the_window_traces_its_steps_into_a_chrome_trace(traced):
    run, _, _ = traced
    entry = run.context["collectors"]["kernels"]
    record = run.records[schema.KERNEL_STATS][-1]
    [session] = glob.glob(os.path.join(run.path, "plugins", "profile", "*"))
    assert entry == {"state": "ok", "window": [2, 4], "phase": "done",
                     "reason": "traced steps 2-4", "source": session,
                     "traced_steps": [2, 4]}
    assert record.step == 5 and record.value["source"] == session
    [trace] = glob.glob(os.path.join(session, "*.pt.trace.json"))
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    steps = sorted((e for e in events if e["name"].startswith("ProfilerStep#")),
                   key=lambda e: e["ts"])
    assert [e["name"] for e in steps] == ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"]
    # Each step's own ops are in its range: both Dense layers' matmuls, forward
    # and backward.
    matmuls = [e["ts"] for e in events if e.get("cat") == "cpu_op" and e["name"] == "aten::mm"]
    for step in steps:
        assert sum(step["ts"] <= ts <= step["ts"] + step["dur"] for ts in matmuls) >= 4


def test_a_cpu_run_records_no_gpu_kernels_not_zero(traced):
    run, _, _ = traced
    record = run.records[schema.KERNEL_STATS][-1].value
    assert record["no_gpu_kernels"] is True and record["tensor_core_share"] is None
    assert "no GPU kernels" in record["reason"]
    assert run.gpu.kernels == record


def test_training_under_the_window_is_the_twins_to_the_bit(traced):
    _, model, twin = traced
    for a, b in zip(twin, weights(model), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_window_beyond_the_fit_never_opens(tmp_path):
    x, y = jax_runs.classes(16)
    run = jax_runs.fit(tmp_path, jax_runs.classifier("float32"), x, y, profile_steps=(5, 6))
    entry = run.context["collectors"]["kernels"]
    assert entry["state"] == "waiting" and "never opened" in entry["reason"]
    assert schema.KERNEL_STATS not in run.records
    assert not os.path.exists(os.path.join(run.path, "plugins"))


def test_a_window_cut_short_by_the_fit_closes_with_its_last_step(tmp_path):
    x, y = jax_runs.classes()  # 8 steps: 0-7
    run = jax_runs.fit(tmp_path, jax_runs.classifier("float32"), x, y, profile_steps=(6, 20))
    entry = run.context["collectors"]["kernels"]
    assert entry["state"] == "ok" and entry["traced_steps"] == [6, 7]
    assert "cut short" in entry["reason"]
    [trace] = glob.glob(os.path.join(entry["source"], "*.pt.trace.json"))
    with open(trace) as f:
        names = {e["name"] for e in json.load(f)["traceEvents"]}
    assert sorted(n for n in names if n.startswith("ProfilerStep#")) == [
        "ProfilerStep#6", "ProfilerStep#7"]


# --- The share over CUDA kernel events, as torch.profiler's Chrome trace holds them.

def op(name, external_id):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": 0, "dur": 1,
            "args": {"External id": external_id}}


def kernel(name, external_id, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": 0, "dur": dur,
            "args": {"External id": external_id, "correlation": 1000 + external_id}}


TRACE = [
    op("aten::mm", 1), op("aten::addmm", 2), op("aten::bmm", 3), op("aten::add_", 4),
    kernel("volta_h884gemm_64x64_ldg8_nn", 1, 120),                          # Tensor Cores
    kernel("turing_fp16_s1688gemm_fp16_128x128_ldg8_f2f_tn", 1, 30),          # Tensor Cores
    kernel("sgemm_128x64_nn", 2, 70),                                         # float32 SIMT
    # A Tensor Core kernel XProf's name heuristic misses (FACTS.md): counted as not.
    kernel("cutlass3x_sm90_tensorop_s64x128x16gemm_f16_f16_f32_f16_f16_128x128x64_tnn",
           3, 45),
    kernel("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add"
           "<c10::Half> >(int, at::native::CUDAFunctor_add<c10::Half>)", 4, 9),
    kernel("sgemm_32x32_tn", 99, 5),                                          # no op
    # Not kernels: a launch on the host, a copy.
    {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "dur": 4,
     "args": {"External id": 1}},
    {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "dur": 50,
     "args": {"External id": 2}},
]


def test_kernels_are_tied_to_the_ops_that_launched_them():
    launches = kernels.kernel_launches(TRACE)
    assert [(name[:16], launched_by, dur) for name, launched_by, dur in launches] == [
        ("volta_h884gemm_6", "aten::mm", 120.0),
        ("turing_fp16_s168", "aten::mm", 30.0),
        ("sgemm_128x64_nn", "aten::addmm", 70.0),
        ("cutlass3x_sm90_t", "aten::bmm", 45.0),
        ("void at::native:", "aten::add_", 9.0),
        ("sgemm_32x32_tn", "(unknown op)", 5.0),
    ]


def test_the_share_is_xprofs_over_the_kernel_time(monkeypatch):
    # XProf alone classifies them: a PyTorch install need not have TensorFlow.
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    share = kernels.tensor_core_share(TRACE, source="session")
    # By hand: 120 + 30 of 120 + 30 + 70 + 45 + 9 + 5 = 279 us use Tensor Cores.
    assert share["no_gpu_kernels"] is False and share["source"] == "session"
    assert share["total_gpu_kernel_us"] == 279.0 and share["tensor_core_us"] == 150.0
    assert share["tensor_core_share"] == pytest.approx(150 / 279)
    # Which aten ops could have used Tensor Cores XProf cannot say: unknown, not 0.
    assert share["eligible_us"] is None and share["eligible_not_using_us"] is None
    assert share["top_ops"] == [] and "aten" in share["eligibility"]


def test_a_trace_without_kernels_has_no_share():
    share = kernels.tensor_core_share(TRACE[:4], source="session")
    assert share["no_gpu_kernels"] is True and share["tensor_core_share"] is None
