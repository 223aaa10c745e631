"""Tensor Core share of GPU kernel time from XProf traces, and the profile window."""

import os

import keras
import pytest
from conftest import mnist_like, seed_model
from xplanes import KERNELS, total_us, write_gpu_xspace

import mpprof
from mpprof.backends import xprof_kernels as kernels
from mpprof.records import reader, schema


def test_share_from_a_synthetic_gpu_trace_is_exact(tmp_path):
    session = tmp_path / "plugins" / "profile" / "2026_01_01_00_00_00"
    write_gpu_xspace(session)

    share = kernels.tensor_core_share(tmp_path)

    using = [k for k in KERNELS if k[4]]
    eligible = [k for k in KERNELS if k[5]]
    missed = [k for k in eligible if not k[4]]
    assert share["source"] == str(session)
    assert share["no_gpu_kernels"] is False
    assert share["total_gpu_kernel_us"] == pytest.approx(total_us(KERNELS), rel=1e-12)
    assert share["tensor_core_us"] == pytest.approx(total_us(using), rel=1e-12)
    assert share["eligible_us"] == pytest.approx(total_us(eligible), rel=1e-12)
    assert share["eligible_not_using_us"] == pytest.approx(total_us(missed), rel=1e-12)
    assert share["tensor_core_share"] == pytest.approx(
        total_us(using) / total_us(KERNELS), rel=1e-12
    )
    # Ops are summed over their kernels, largest first, with their layer.
    expected = {}
    for kernel, op, duration, launches, _, _ in missed:
        op_name = op.split(":")[0]
        entry = expected.setdefault(op_name, [0.0, 0, set()])
        entry[0] += duration * launches
        entry[1] += launches
        entry[2].add(kernel)
    ranked = sorted(expected, key=lambda name: -expected[name][0])
    assert [op["op_name"] for op in share["top_ops"]] == ranked
    for op in share["top_ops"]:
        total, launches, kernel_names = expected[op["op_name"]]
        assert op["total_us"] == pytest.approx(total, rel=1e-12)
        assert op["occurrences"] == launches
        assert set(op["kernels"]) == kernel_names
        assert op["layer"] == op["op_name"].rsplit("/", 1)[0]
    assert share["top_ops"][0]["layer"] == "model/dense_1"


def test_without_the_vendor_stat_no_kernel_reads_as_tensor_core(tmp_path):
    """FACTS.md: XProf needs device_vendor="Nvidia" to apply its heuristic."""
    write_gpu_xspace(tmp_path, vendor=None)
    share = kernels.tensor_core_share(tmp_path)
    assert share["tensor_core_us"] == 0.0 and share["tensor_core_share"] == 0.0


def test_the_newest_session_is_read(tmp_path):
    profile = tmp_path / "train" / "plugins" / "profile"
    write_gpu_xspace(profile / "2026_01_01_00_00_00", KERNELS[:1])
    write_gpu_xspace(profile / "2026_02_01_00_00_00", KERNELS[2:3])
    share = kernels.tensor_core_share(tmp_path)
    assert share["source"].endswith("2026_02_01_00_00_00")
    assert share["tensor_core_share"] == 0.0
    assert share["total_gpu_kernel_us"] == total_us(KERNELS[2:3])


def test_a_directory_without_a_trace_says_how_to_record_one(tmp_path):
    with pytest.raises(kernels.KernelStatsError, match="profile_steps"):
        kernels.tensor_core_share(tmp_path)


def fit(log_dir, steps=6, **profiler_kwargs):
    model = seed_model(last_dtype="float32")
    x, y = mnist_like(samples=32 * steps)
    extra = profiler_kwargs.pop("extra_callbacks", [])
    profiler = mpprof.MixedPrecisionProfiler(str(log_dir), gpu_interval=None,
                                             **profiler_kwargs)
    history = model.fit(x, y, batch_size=32, epochs=1, verbose=0,
                        callbacks=[*extra, profiler])
    return history, reader.read_run(log_dir, schema.TRAIN_RUN)


def test_a_window_past_the_end_of_fit_is_cut_short(tmp_path):
    _, run = fit(tmp_path, steps=3, profile_steps=(1, 1000))
    entry = run.context["collectors"]["kernels"]
    assert entry["state"] == "ok" and "cut short" in entry["reason"]
    assert entry["traced_steps"] == [1, 2]  # steps 0-2 ran: the trace holds 1 and 2
    assert run.latest(schema.KERNEL_STATS)["no_gpu_kernels"] is True


def test_tensorboard_profiling_in_the_same_fit_is_reused(tmp_path):
    tensorboard = keras.callbacks.TensorBoard(str(tmp_path), profile_batch=(2, 3))
    history, run = fit(tmp_path, profile_steps=(1, 2), extra_callbacks=[tensorboard])

    assert len(history.history["loss"]) == 1
    entry = run.context["collectors"]["kernels"]
    assert entry["phase"] == "reusing"
    assert "TensorBoard(profile_batch" in entry["reason"]
    assert entry["state"] == "ok"
    sessions = os.listdir(tmp_path / "train" / "plugins" / "profile")
    assert len(sessions) == 1  # TensorBoard's only: mpprof did not trace
    assert run.latest(schema.KERNEL_STATS)["source"].endswith(sessions[0])


@pytest.mark.parametrize("bad", [(3, 2), (-1, 2), (1,), "1,2", (1.0, 2), (True, 2)])
def test_profile_steps_is_validated(tmp_path, bad):
    with pytest.raises(ValueError, match="profile_steps"):
        mpprof.MixedPrecisionProfiler(str(tmp_path), profile_steps=bad)


# One op name in each registered backend's naming, and its layer.
OP_NAMES = {
    "tensorflow": ("model/dense_1/MatMul", "model/dense_1"),
    "jax": ("jit(step)/transpose(jvp(mha))/query/abc,cde->abde/dot_general", "mha/query"),
    "torch": ("sequential/dense/aten::mm", "sequential/dense"),
}


def test_each_backend_reads_its_own_op_names_and_no_other():
    from mpprof.backends import REGISTRY, load

    assert set(OP_NAMES) == {name for name, r in REGISTRY.items() if r.op_names}
    for backend, (op_name, layer) in OP_NAMES.items():
        claims = {name: load(REGISTRY[name].op_names).layer_of(op_name) for name in OP_NAMES}
        assert claims == {name: layer if name == backend else None for name in OP_NAMES}
        assert kernels.layer_of(op_name) == layer
    # A PyTorch layer whose name holds "(" is still no JAX name stack.
    assert kernels.layer_of("sequential/conv(3x3)/aten::convolution") == "sequential/conv(3x3)"
