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
import torch

from mpprof.backends import xprof_kernels
from mpprof.backends.torch import kernels, op_names
from mpprof.backends.torch.layer_calls import LAYER_RANGE
from mpprof.records import schema, validation


def paths(model) -> tuple[str, str, str]:
    """The paths of the model and its two Dense layers, in call order."""
    return model.path, f"{model.path}/hidden", f"{model.path}/logits"


def weights(model) -> list[np.ndarray]:
    return [keras.ops.convert_to_numpy(w.value) for w in model.weights]


class OwnTrace(keras.callbacks.Callback):
    """A `torch.profiler` of this callback's own over `steps` (outside the
    window: one profiler at a time), keeping each step's trace events."""

    def __init__(self, steps, scratch):
        super().__init__()
        self.steps, self.scratch, self.events = steps, scratch, {}
        self._profile = None

    def on_train_batch_begin(self, batch, logs=None):
        if batch in self.steps:
            self._profile = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU])
            self._profile.start()

    def on_train_batch_end(self, batch, logs=None):
        if self._profile is not None:
            self._profile.stop()
            path = os.path.join(self.scratch, f"{batch}.json")
            self._profile.export_chrome_trace(path)
            with open(path) as f:
                self.events[batch] = json.load(f)["traceEvents"]
            self._profile = None


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """A fit of 8 steps traced over steps 2-4 (and by a profiler of its own
    over steps 0 and 6), and its unprofiled twin."""
    x, y = jax_runs.classes()
    twin = jax_runs.classifier("mixed_float16")
    twin.fit(x, y, batch_size=8, verbose=0, shuffle=False)
    model = jax_runs.classifier("mixed_float16")
    log_dir = tmp_path_factory.mktemp("traced")
    outside = OwnTrace((0, 6), str(tmp_path_factory.mktemp("outside")))
    run = jax_runs.fit(log_dir, model, x, y, profile_steps=(2, 4), callbacks=[outside])
    return run, model, weights(twin), outside.events


def trace_events(run) -> list[dict]:
    [trace] = glob.glob(os.path.join(run.context["collectors"]["kernels"]["source"],
                                     "*.pt.trace.json"))
    with open(trace) as f:
        return json.load(f)["traceEvents"]


def ranges(events, prefix) -> list[dict]:
    return sorted((e for e in events if e.get("cat") == "user_annotation"
                   and e["name"].startswith(prefix)), key=lambda e: e["ts"])


def inside(event, outer) -> bool:
    return outer["ts"] <= event["ts"] <= outer["ts"] + outer["dur"]


def test_the_window_traces_its_steps_into_a_chrome_trace(traced):
    run, *_ = traced
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
    run, *_ = traced
    record = run.records[schema.KERNEL_STATS][-1].value
    assert record["no_gpu_kernels"] is True and record["tensor_core_share"] is None
    assert "no GPU kernels" in record["reason"]
    assert run.gpu.kernels == record


def test_training_under_the_window_is_the_twins_to_the_bit(traced):
    _, model, twin, _ = traced
    for a, b in zip(twin, weights(model), strict=True):
        np.testing.assert_array_equal(a, b)


def test_each_layer_call_of_the_traced_steps_is_a_range(traced):
    run, model, *_ = traced
    events = trace_events(run)
    steps = ranges(events, "ProfilerStep#")
    layers = ranges(events, LAYER_RANGE)
    # One range per layer call (the model's own call too), in call order,
    # each inside its step: nothing of the steps before or after the window.
    assert [e["name"][len(LAYER_RANGE):] for e in layers] == list(paths(model)) * 3
    for step, calls in zip(steps, np.split(np.array(layers), 3), strict=True):
        assert all(inside(call, step) for call in calls)


def test_steps_outside_the_window_run_no_layer_range(traced):
    _, _, _, outside = traced
    # A profiler of the user's own traces steps 0 (the first call, whose hooks
    # fill the inventory) and 6 (after the window): their ops, no mpprof range.
    assert sorted(outside) == [0, 6]
    for events in outside.values():
        assert sum(e["name"] == "aten::mm" for e in events if e.get("cat") == "cpu_op") >= 4
        assert ranges(events, LAYER_RANGE) == []


def matmuls(events) -> list[dict]:
    return [e for e in events if e.get("cat") == "cpu_op" and e["name"] == "aten::mm"]


def test_forward_and_backward_ops_get_their_dense_layer(traced):
    run, model, *_ = traced
    _, hidden, logits = paths(model)
    events = trace_events(run)
    layers = kernels.op_layers(events)
    step = ranges(events, "ProfilerStep#")[1]
    found = [(layers.get(e["args"]["External id"]), "Sequence number" in e["args"])
             for e in sorted(matmuls(events), key=lambda e: e["ts"]) if inside(e, step)]
    # Forward (an autograd sequence number) in each Dense's range; backward
    # (under MmBackward0) by the flow to its forward op: logits' gradients of
    # its input and kernel, then hidden's of its kernel (its input needs none).
    assert found == [(hidden, True), (logits, True), (logits, False), (logits, False),
                     (hidden, False)]


def test_backward_nodes_link_to_their_forward_ops_by_flows(traced):
    """What `op_layers` relies on, as torch 2.13 writes it: a "fwdbwd" flow
    runs from a forward op's start to its autograd node's, and both carry
    the same "Sequence number" (the node's "Fwd thread id" is autograd's own
    thread number, no trace tid: the flow is the link to follow)."""
    run, *_ = traced
    events = trace_events(run)
    ops = {(e["tid"], e["ts"]): e for e in events if e.get("cat") == "cpu_op"}
    flows = {}
    for e in events:
        if e.get("cat") == "fwdbwd":
            flows.setdefault(e["id"], {})[e["ph"]] = ops[e["tid"], e["ts"]]
    linked = {(ends["s"]["name"], ends["f"]["name"]) for ends in flows.values()}
    assert ("aten::mm", "MmBackward0") in linked
    for ends in flows.values():
        assert ends["s"]["args"]["Sequence number"] == ends["f"]["args"]["Sequence number"]
        assert ends["f"]["args"]["Fwd thread id"] != 0 == ends["s"]["args"]["Fwd thread id"]


def test_a_backward_pass_on_its_own_thread_gets_the_forward_layers(traced):
    """On a GPU the autograd engine runs the backward pass on a thread of
    its own: the real trace's backward ops (and their flows' ends) moved to
    another thread keep their layers."""
    run, *_ = traced
    events = trace_events(run)
    step = ranges(events, "ProfilerStep#")[0]
    # The first step's backward pass and update, past its first autograd node.
    start = min(e["ts"] for e in events if e.get("ph") == "f" and inside(e, step))
    moved = [dict(e, tid=-1) if e.get("cat") in ("cpu_op", "fwdbwd") and e.get("ph") != "s"
             and start <= e["ts"] <= step["ts"] + step["dur"] else e for e in events]
    assert sum(e["tid"] == -1 and e["name"] == "aten::mm" for e in moved) == 3
    assert kernels.op_layers(moved) == kernels.op_layers(events)


def test_kernels_launched_by_real_ops_are_named_after_their_layers(traced):
    """Hand-made CUDA kernels tied to the real trace's aten::mm ops (a CPU
    trace has none): XProf keeps each op's layer in its name, which the
    registered readers give back."""
    run, model, *_ = traced
    _, hidden, logits = paths(model)
    events = trace_events(run)
    step = ranges(events, "ProfilerStep#")[1]
    ops = [e for e in matmuls(events) if inside(e, step)]
    launched = events + [kernel("sgemm_128x64_nn", e["args"]["External id"], 10 + i)
                         for i, e in enumerate(ops)]
    launches = kernels.kernel_launches(launched)
    assert [op for _, op, _ in launches] == [
        f"{layer}/aten::mm" for layer in [hidden, logits, logits, logits, hidden]]
    rows = xprof_kernels.kernel_stats_of_launches(launches)
    assert {row["op_name"] for row in rows} == {op for _, op, _ in launches}
    assert {xprof_kernels.layer_of(row["op_name"]) for row in rows} == {hidden, logits}


def test_eligible_ops_of_real_layers_that_missed_tensor_cores_are_listed(traced):
    """Hand-made kernels tied to the real ops of a traced step: the hidden
    Dense's forward GEMM (float16 under mixed_float16) on a float32 SIMT
    kernel missed the Tensor Cores and is listed with its layer; its
    gradient GEMM on a Tensor Core kernel used them; its relu is no GEMM."""
    run, model, *_ = traced
    _, hidden, _ = paths(model)
    events = trace_events(run)
    step = ranges(events, "ProfilerStep#")[1]
    layers = kernels.op_layers(events)
    mine = sorted((e for e in events if e.get("cat") == "cpu_op" and inside(e, step)
                   and layers.get(e["args"].get("External id")) == hidden),
                  key=lambda e: e["ts"])
    forward, backward = (e["args"]["External id"] for e in mine if e["name"] == "aten::mm")
    [relu] = (e["args"]["External id"] for e in mine if e["name"] == "aten::relu")
    launched = events + [
        kernel("volta_sgemm_128x64_nn", forward, 40),
        kernel("sm80_xmma_gemm_f16f16_f16f32_f32_nn_n_tilesize128x128x32", backward, 25),
        kernel("void at::native::vectorized_elementwise_kernel<4, at::native::"
               "clamp_min_scalar_kernel_impl>", relu, 5)]
    share = kernels.tensor_core_share(launched, source="session")
    assert (share["total_gpu_kernel_us"], share["tensor_core_us"]) == (70.0, 25.0)
    assert (share["eligible_us"], share["eligible_not_using_us"]) == (65.0, 40.0)
    assert [(o["op_name"], o["layer"], o["total_us"], o["kernels"])
            for o in share["top_ops"]] == [
        (f"{hidden}/aten::mm", hidden, 40.0, ["volta_sgemm_128x64_nn"])]
    assert validation.problem(schema.KERNEL_STATS, share) is None


# The aten ops that launch the GEMMs and convolutions of Keras' layers, as
# torch 2.13 names them on this CPU (a GPU runs aten::cudnn_convolution
# under aten::_convolution: in the table too, not seen here).
LAYER_GEMMS = {
    "conv": {"aten::conv2d", "aten::convolution", "aten::_convolution",
             "aten::convolution_backward"},
    "mha/query": {"aten::einsum", "aten::bmm"},
    "mha/key": {"aten::einsum", "aten::bmm"},
    "mha/value": {"aten::einsum", "aten::bmm"},
    "mha/attention_output": {"aten::einsum", "aten::bmm"},
    "ed": {"aten::einsum", "aten::bmm"},
    "logits": {"aten::matmul", "aten::mm"},
}


def test_the_gemms_of_conv_einsum_attention_and_dense_layers_are_eligible(tmp_path):
    """A real fit's trace: each layer's eligible ops are its GEMMs and
    convolutions (forward and backward), and nothing else it ran is."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 4, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", name="conv")(inputs)
    x = keras.layers.Reshape((16, 8))(x)
    x = keras.layers.MultiHeadAttention(2, 4, name="mha")(x, x)
    x = keras.layers.EinsumDense("abc,cd->abd", (16, 4), name="ed")(x)
    outputs = keras.layers.Dense(4, dtype="float32", name="logits")(keras.layers.Flatten()(x))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    keras.mixed_precision.set_dtype_policy("float32")
    rng = np.random.default_rng(0)
    run = jax_runs.fit(tmp_path, model, rng.random((16, 4, 4, 3), dtype=np.float32),
                       rng.integers(0, 4, 16), profile_steps=(1, 1))
    events = trace_events(run)
    layers = kernels.op_layers(events)
    found: dict[str, set[str]] = {}
    ran: dict[str, set[str]] = {}
    for e in events:
        layer = layers.get(e.get("args", {}).get("External id"))
        if e.get("cat") == "cpu_op" and layer is not None:
            ran.setdefault(layer.removeprefix(f"{model.path}/"), set()).add(e["name"])
            if op_names.tensor_core_eligible(f"{layer}/{e['name']}"):
                found.setdefault(layer.removeprefix(f"{model.path}/"), set()).add(e["name"])
    assert found == LAYER_GEMMS
    # The layers ran more than their GEMMs (casts, bias adds, attention's
    # fused product, in no list: XProf knows none of its kernels).
    assert {"aten::add", "aten::_to_copy"} <= ran["logits"]
    assert "aten::scaled_dot_product_attention" in ran["mha"]


@pytest.mark.parametrize("jit_compile", [True, False])
def test_a_compiled_step_runs_no_layer_ranges(tmp_path, jit_compile):
    """Under jit_compile=True (torch.compile) the window traces without
    layer ranges (switched on inside it they would recompile the step), and
    the run context says its ops carry no layer; an eager step gets them.
    (The decision alone: torch.compile takes ~40 s to compile a fit here.)"""
    from mpprof.backends.torch.backend import TorchBackend

    model = jax_runs.classifier("float32", jit_compile=jit_compile)
    assert model.jit_compile is jit_compile
    backend = TorchBackend(model)
    patch = backend.LayerCallPatch(model, [])
    window = kernels.ProfileWindow(1, 1, str(tmp_path))
    window.begin(0, backend=backend)
    window.after_steps(1)  # step 1 begins: the window traces it
    assert window.state == "tracing" and patch.ranges is not jit_compile
    window.after_steps(2)
    assert window.state == "done" and patch.ranges is False
    assert ("jit_compile=True: the ops carry no layer" in window.context()["reason"]) \
        is jit_compile


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
    # PyTorch's op table: the GEMMs are eligible (120 + 30 + 70 + 45 us), the
    # add and the kernel of no op are not; two missed the Tensor Cores by
    # XProf's heuristic (the cutlass3x kernel that did is one it misses).
    assert share["eligible_us"] == 265.0 and share["eligible_not_using_us"] == 115.0
    assert [(o["op_name"], o["layer"], o["total_us"]) for o in share["top_ops"]] == [
        ("aten::addmm", "aten::addmm", 70.0), ("aten::bmm", "aten::bmm", 45.0)]


def test_a_trace_without_kernels_has_no_share():
    share = kernels.tensor_core_share(TRACE[:4], source="session")
    assert share["no_gpu_kernels"] is True and share["tensor_core_share"] is None
