"""Tensor Core share of GPU kernel time from XProf traces, and the profile window."""

import os

import keras
import pytest
import tensorflow as tf
from conftest import mnist_like, seed_model
from tensorflow.tsl.profiler.protobuf import xplane_pb2

import mpprof
from mpprof.backends.tensorflow import kernels
from mpprof.records import reader, schema

# (kernel name, TF op "name:type", duration us, launches, uses Tensor Cores,
# op eligible), as XProf classifies them (FACTS.md): "uses" is a kernel-name
# heuristic that misses cutlass3x_sm90_tensorop kernels; an Einsum op counts
# as eligible only when its kernel uses Tensor Cores.
KERNELS = [
    ("volta_h884gemm_64x64_ldg8_nn", "model/dense/MatMul:MatMul", 120, 3, True, True),
    ("turing_fp16_s1688gemm_fp16_128x128_ldg8_f2f_tn",
     "model/dense_2/MatMul:MatMul", 30, 2, True, True),
    ("sgemm_128x64_nn", "model/dense_1/MatMul:MatMul", 70, 2, False, True),
    ("cutlass3x_sm90_tensorop_s64x128x16gemm_f16_f16_f32_f16_f16_128x128x64_tnn",
     "model/mha/query/BatchMatMulV2:BatchMatMulV2", 45, 1, False, True),
    ("sgemm_32x32_tn", "model/dense_1/MatMul:MatMul", 5, 4, False, True),
    ("elementwise_add_kernel", "model/dense/BiasAdd:BiasAdd", 9, 3, False, False),
    ("volta_h884gemm_128x64_nn", "model/mha/key/Einsum:Einsum", 11, 2, True, True),
    ("sgemm_64x64_nn", "model/mha/value/Einsum:Einsum", 13, 1, False, False),
]


def write_gpu_xspace(directory, kernel_specs=KERNELS, vendor="Nvidia"):
    """A synthetic XSpace with one GPU plane holding `kernel_specs`' launches."""
    space = xplane_pb2.XSpace()
    plane = space.planes.add(id=1, name="/device:GPU:0")
    stat_ids = {}

    def stat(name):
        if name not in stat_ids:
            stat_ids[name] = len(stat_ids) + 1
            plane.stat_metadata[stat_ids[name]].id = stat_ids[name]
            plane.stat_metadata[stat_ids[name]].name = name
        return stat_ids[name]

    if vendor:
        plane.stats.add(metadata_id=stat("device_vendor")).str_value = vendor
    line = plane.lines.add(id=1, name="Stream #1", timestamp_ns=1_000)
    offset_ps = 0
    for i, (kernel, op, duration_us, launches, _, _) in enumerate(kernel_specs, 1):
        plane.event_metadata[i].id = i
        plane.event_metadata[i].name = kernel
        for _ in range(launches):
            event = line.events.add(
                metadata_id=i, offset_ps=offset_ps, duration_ps=duration_us * 1_000_000
            )
            offset_ps += duration_us * 1_000_000 + 1_000
            event.stats.add(metadata_id=stat("kernel_details")).str_value = (
                "regs:32 static_shmem:0 dynamic_shmem:0 grid:1,1,1 block:128,1,1 "
                "occ_pct:50.0"
            )
            event.stats.add(metadata_id=stat("tf_op")).str_value = op
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "gpuhost.xplane.pb")
    with open(path, "wb") as f:
        f.write(space.SerializeToString())
    return path


def total_us(specs):
    return float(sum(duration * launches for _, _, duration, launches, _, _ in specs))


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


def test_profile_window_on_cpu_records_no_gpu_kernels_not_zero(tmp_path):
    history, run = fit(tmp_path, profile_steps=(2, 3))

    assert len(history.history["loss"]) == 1
    record = run.records[schema.KERNEL_STATS][-1]
    assert record.step == 4  # written right after step 3, the window's last
    assert record.value["no_gpu_kernels"] is True
    assert record.value["tensor_core_share"] is None
    entry = run.context["collectors"]["kernels"]
    assert entry["state"] == "ok" and entry["window"] == [2, 3]
    assert entry["reason"] == "traced steps 2-3"
    profile_dir = str(tmp_path / "train" / "plugins" / "profile")
    assert record.value["source"].startswith(profile_dir)
    assert run.gpu.kernels == record.value


def test_a_window_past_the_end_of_fit_is_cut_short(tmp_path):
    _, run = fit(tmp_path, steps=3, profile_steps=(1, 1000))
    entry = run.context["collectors"]["kernels"]
    assert entry["state"] == "ok" and "cut short" in entry["reason"]
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


def test_a_running_profiler_makes_the_window_step_aside(tmp_path):
    tf.profiler.experimental.start(str(tmp_path / "someone_else"))
    try:
        history, run = fit(tmp_path / "run", profile_steps=(1, 2))
    finally:
        tf.profiler.experimental.stop()

    assert len(history.history["loss"]) == 1
    entry = run.context["collectors"]["kernels"]
    assert entry["state"] == "unavailable" and entry["phase"] == "refused"
    assert "another profiler was running at step 1" in entry["reason"]
    assert schema.KERNEL_STATS not in run.records


@pytest.mark.parametrize("bad", [(3, 2), (-1, 2), (1,), "1,2", (1.0, 2), (True, 2)])
def test_profile_steps_is_validated(tmp_path, bad):
    with pytest.raises(ValueError, match="profile_steps"):
        mpprof.MixedPrecisionProfiler(str(tmp_path), profile_steps=bad)
