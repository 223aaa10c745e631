"""The NVML sampler: the real "no NVML" path, and every mode against a fake C library.

`fake_nvml` replaces only `pynvml.nvmlLib`, so pynvml's wrappers, structs and
error classes run as they would against libnvidia-ml.so.
"""

import math
import os
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pynvml
import pytest
from conftest import BatchTimes, mnist_like, seed_model
from fake_nvml import FakeGpu, FakeNvmlLibrary, ampere_gpu, installed
from real_nvml import nvml_on_this_machine

import mpprof
from mpprof.backends.tensorflow.hardware import hardware_facts
from mpprof.recording.collectors.gpu_host import HostRecorder
from mpprof.recording.nvml import sampler as gpu
from mpprof.records import reader, schema

REPO = Path(__file__).resolve().parents[1]
COLUMN = {name: i for i, name in enumerate(schema.GPU_SAMPLE_COLUMNS)}
GPM_COLUMNS = {
    "tensor_util": pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
    "hmma_tensor_util": pynvml.NVML_GPM_METRIC_HMMA_TENSOR_UTIL,
    "imma_tensor_util": pynvml.NVML_GPM_METRIC_IMMA_TENSOR_UTIL,
    "dfma_tensor_util": pynvml.NVML_GPM_METRIC_DFMA_TENSOR_UTIL,
    "sm_util": pynvml.NVML_GPM_METRIC_SM_UTIL,
    "sm_occupancy": pynvml.NVML_GPM_METRIC_SM_OCCUPANCY,
    "dram_bw_util": pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL,
    "fp16_util": pynvml.NVML_GPM_METRIC_FP16_UTIL,
    "fp32_util": pynvml.NVML_GPM_METRIC_FP32_UTIL,
}


def sampler_threads():
    return [t for t in threading.enumerate() if t.name == "mpprof-gpu-sampler"]


def expected_basic(fake: FakeGpu) -> dict:
    """What the basic columns must read for `fake`, in the columns' units."""
    return {
        "gpu_util": fake.gpu_util,
        "mem_util": fake.mem_util,
        "mem_used_bytes": fake.memory_used,
        "mem_total_bytes": fake.memory_total,
        "power_w": fake.power_mw / 1000.0,
        "sm_clock_mhz": fake.sm_clock_mhz,
        "temperature_c": fake.temperature_c,
        "clock_event_reasons": fake.clock_event_reasons,
    }


def started(library, environ=None, **kwargs) -> gpu.GpuSampler:
    """A sampler opened on `library` whose thread never samples by itself."""
    sampler = gpu.GpuSampler(600, environ=environ or {}, **kwargs)
    sampler.start()
    return sampler


def fit_with(profiler, steps: int = 4, before=(), after=()):
    model = seed_model(last_dtype="float32")
    x, y = mnist_like(samples=32 * steps)
    return model.fit(x, y, batch_size=32, epochs=1, verbose=0,
                     callbacks=[*before, profiler, *after])


# ---------------------------------------------------------------- real path


def test_the_real_nvml_path_records_what_this_machine_has(tmp_path):
    """No fake: the profiler opens the machine's own NVML. Without the library
    (no NVIDIA driver, as on a CPU runner) it records the sampler unavailable
    and training completes; with it, it samples every GPU NVML lists, in the
    mode NVML's own GPM query implies. Which of the two ran is in the test's
    output; neither is ever skipped."""
    machine = nvml_on_this_machine()
    print("NVML on this machine:", "no library" if machine is None else machine)
    steps = 4
    times = BatchTimes(sleep_s=0.3)  # >= 1.2 s of training: rounds every 0.1 s
    history = fit_with(
        mpprof.MixedPrecisionProfiler(str(tmp_path), gpu_interval=0.1), steps, after=[times]
    )

    assert len(history.history["loss"]) == 1
    assert not sampler_threads()
    run = reader.read_run(tmp_path, schema.TRAIN_RUN)
    hardware = run.context["hardware"]
    if machine is None:
        assert run.gpu.mode == gpu.MODE_UNAVAILABLE
        assert "libnvidia-ml.so.1" in run.gpu.reason
        assert run.context["collectors"]["gpu"]["state"] == "unavailable"
        assert len(run.gpu.samples) == 0 and run.gpu.devices == []
        assert hardware["cpu_only"] is True and hardware["source"] == "none"
        assert "mixed_float16" in hardware["reason"]
        return
    # CUDA_VISIBLE_DEVICES may leave some out, never add one.
    recorded = {d["uuid"]: d for d in run.gpu.devices}
    assert recorded and set(recorded) <= set(machine)
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        assert set(recorded) == set(machine)
    every_gpm = all(machine[uuid][1] for uuid in recorded)
    assert run.gpu.mode == (gpu.MODE_GPM if every_gpm else gpu.MODE_BASIC), run.gpu.reason
    assert hardware["source"] == "nvml"
    assert_rows_line_up_with_steps(run, times, steps)
    for device in recorded.values():
        total = run.gpu.column("mem_total_bytes", device=device["index"])
        assert len(total) >= 2 and (total == machine[device["uuid"]][0]).all()
        assert device["memory_total_bytes"] == machine[device["uuid"]][0]


def test_without_the_nvml_library_the_sampler_is_unavailable_on_every_machine(monkeypatch):
    """The "no library" path also where a driver is installed: pynvml's own
    loader runs and finds no libnvidia-ml.so.1 (only the dynamic loader's
    answer is replaced), then its error mapping and mpprof's reason."""
    def no_library(name, *args, **kwargs):
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(pynvml, "nvmlLib", None)
    monkeypatch.setattr(pynvml, "CDLL", no_library)
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    monkeypatch.setattr(pynvml, "_nvmlLib_refcount", 0)
    sampler = gpu.GpuSampler(600, environ={})
    sampler.start()
    sampler.stop()
    assert sampler.mode == gpu.MODE_UNAVAILABLE and not sampler.running
    assert "libnvidia-ml.so.1" in sampler.reason and "no NVIDIA driver" in sampler.reason
    assert pynvml.nvmlLib is None  # the library was looked for, and not found
    assert not sampler_threads()


def test_gpu_interval_none_turns_the_sampler_off(tmp_path):
    fit_with(mpprof.MixedPrecisionProfiler(str(tmp_path), gpu_interval=None))
    context = reader.read_run(tmp_path, schema.TRAIN_RUN).context
    assert context["collectors"]["gpu"]["state"] == "unavailable"
    assert "gpu_interval=None" in context["collectors"]["gpu"]["reason"]
    assert context["hardware"]["cpu_only"] is True


@pytest.mark.parametrize("bad", [0.05, 0, -1, float("nan"), "0.5", True])
def test_gpu_interval_is_validated(tmp_path, bad):
    with pytest.raises(ValueError, match="gpu_interval"):
        mpprof.MixedPrecisionProfiler(str(tmp_path), gpu_interval=bad)


def test_the_sampler_module_imports_no_tensorflow():
    """benchmarks/gpu_check.py runs where only PyTorch/CuPy is installed."""
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--dry-run"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    assert "tensorflow imported: False" in result.stdout
    assert "mode: unavailable" in result.stdout


# ---------------------------------------------------------- fake C library


def test_gpm_mode_reads_every_metric_through_pynvml():
    fake = FakeGpu()
    library = FakeNvmlLibrary([fake])
    with installed(library):
        sampler = started(library)
        sampler.step_source = lambda: 7
        sampler.sample_round()
        sampler.sample_round()
        rows = sampler.drain()
        sampler.stop()

    assert sampler.mode == gpu.MODE_GPM and "GPM is supported" in sampler.reason
    assert rows.shape == (2, len(schema.GPU_SAMPLE_COLUMNS))
    for row in rows:
        assert row[COLUMN["step"]] == 7 and row[COLUMN["device"]] == 0
        for column, metric in GPM_COLUMNS.items():
            assert row[COLUMN[column]] == fake.gpm_values[metric], column
        for column, value in expected_basic(fake).items():
            assert row[COLUMN[column]] == value, column
    # Each GPM reading pairs the previous sample with a new one.
    assert library.calls["nvmlGpmSampleGet"] == 3
    assert library.calls["nvmlGpmMetricsGet"] == 2
    [device] = sampler.context()["devices"]
    assert device["architecture"] == "Hopper" and device["compute_capability"] == [9, 0]
    assert device["fp16_tensor_cores"] and device["bf16"] and device["mode"] == "gpm"
    assert sampler.hardware()["driver_version"] == library.driver_version
    assert sampler.hardware()["cuda_driver_version"] == "12.4"


def test_basic_mode_without_gpm_leaves_tensor_columns_nan():
    fake = ampere_gpu()
    library = FakeNvmlLibrary([fake])
    with installed(library):
        sampler = started(library)
        sampler.sample_round()
        rows = sampler.drain()
        sampler.stop()

    assert sampler.mode == gpu.MODE_BASIC
    assert "GPM is not supported" in sampler.reason and fake.name in sampler.reason
    for column in GPM_COLUMNS:
        assert math.isnan(rows[0, COLUMN[column]]), column
    for column, value in expected_basic(fake).items():
        assert rows[0, COLUMN[column]] == value, column
    assert library.calls["nvmlGpmSampleAlloc"] == 0
    assert sampler.context()["devices"][0]["architecture"] == "Ampere"


def test_driver_without_gpm_functions_falls_back_to_basic():
    library = FakeNvmlLibrary(
        [FakeGpu()],
        missing={"nvmlGpmQueryDeviceSupport", "nvmlDeviceGetCurrentClocksEventReasons"},
    )
    fake = library.gpus[0]
    with installed(library):
        sampler = started(library)
        sampler.sample_round()
        rows = sampler.drain()
        sampler.stop()

    assert sampler.mode == gpu.MODE_BASIC
    assert "GPM support cannot be queried" in sampler.reason
    # Drivers before 535 name the clock-event bits "throttle reasons".
    assert rows[0, COLUMN["clock_event_reasons"]] == fake.clock_event_reasons
    assert library.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 1


def test_per_metric_failures_give_nan_and_are_recorded():
    fake = FakeGpu(
        failures={
            "nvmlDeviceGetPowerUsage": pynvml.NVML_ERROR_NOT_SUPPORTED,
            "nvmlDeviceGetTemperature": pynvml.NVML_ERROR_UNKNOWN,
        },
        gpm_metric_failures={
            pynvml.NVML_GPM_METRIC_HMMA_TENSOR_UTIL: pynvml.NVML_ERROR_NOT_SUPPORTED,
        },
    )
    library = FakeNvmlLibrary([fake])
    with installed(library):
        sampler = started(library)
        for _ in range(3):
            sampler.sample_round()
        rows = sampler.drain()
        sampler.stop()

    assert sampler.mode == gpu.MODE_GPM and len(rows) == 3
    for column in ("power_w", "temperature_c", "hmma_tensor_util"):
        assert np.isnan(rows[:, COLUMN[column]]).all(), column
    tensor = fake.gpm_values[pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL]
    assert (rows[:, COLUMN["tensor_util"]] == tensor).all()
    assert (rows[:, COLUMN["gpu_util"]] == fake.gpu_util).all()
    failures = sampler.context()["metric_failures"]
    assert set(failures) == {"power", "temperature", "hmma_tensor_util"}
    assert "NotSupported" in failures["power"]
    # "Not supported" is not asked again; a transient error is.
    assert library.calls["nvmlDeviceGetPowerUsage"] == 1
    assert library.calls["nvmlDeviceGetTemperature"] == 3


def test_driver_not_loaded_is_unavailable_with_the_reason():
    library = FakeNvmlLibrary(
        [FakeGpu()], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    )
    with installed(library):
        sampler = started(library)
        sampler.stop()
    assert sampler.mode == gpu.MODE_UNAVAILABLE
    assert "driver is not loaded" in sampler.reason
    assert not sampler.running and library.calls["nvmlDeviceGetCount_v2"] == 0


def test_no_gpu_is_unavailable_and_nvml_is_shut_down():
    library = FakeNvmlLibrary([])
    with installed(library):
        sampler = started(library)
    assert sampler.mode == gpu.MODE_UNAVAILABLE and "sees no GPU" in sampler.reason
    assert library.shutdowns == library.initialized == 1


def test_a_device_vanishing_mid_run_stops_only_its_samples():
    library = FakeNvmlLibrary([FakeGpu(), ampere_gpu()])
    with installed(library):
        sampler = started(library)
        sampler.sample_round()
        library.gpus[1].lost = True
        sampler.step_source = lambda: 3
        sampler.sample_round()
        sampler.sample_round()
        rows = sampler.drain()
        sampler.stop()

    devices = rows[:, COLUMN["device"]]
    assert devices.tolist() == [0, 1, 0, 0]
    [warning] = sampler.warnings
    assert "GPU 1" in warning and "vanished at step 3" in warning
    assert [d["lost"] for d in sampler.context()["devices"]] == [False, True]
    assert library.shutdowns == 1 and not library.live_samples


def test_cuda_visible_devices_maps_tensorflow_indices_to_nvml_devices():
    gpus = [FakeGpu(), ampere_gpu()]
    library = FakeNvmlLibrary(gpus)
    with installed(library):
        by_index = started(library, {"CUDA_VISIBLE_DEVICES": "1"})
        by_index.sample_round()
        rows = by_index.drain()
        by_index.stop()
        by_uuid = started(library, {"CUDA_VISIBLE_DEVICES": f"{gpus[1].uuid[:12]},0"})
        by_uuid.stop()
        cut = started(library, {"CUDA_VISIBLE_DEVICES": "0,-1,1"})
        cut.stop()

    [device] = by_index.context()["devices"]
    assert device["index"] == 0 and device["nvml_index"] == 1
    assert device["name"] == gpus[1].name
    assert rows[0, COLUMN["device"]] == 0
    assert rows[0, COLUMN["mem_total_bytes"]] == gpus[1].memory_total
    assert [(d["index"], d["nvml_index"]) for d in by_uuid.context()["devices"]] == [
        (0, 1), (1, 0)
    ]
    assert [d["nvml_index"] for d in cut.context()["devices"]] == [0]


@pytest.mark.parametrize("value", ["", "-1", "NoDevFiles"])
def test_cuda_visible_devices_hiding_every_gpu_does_not_touch_nvml(value):
    library = FakeNvmlLibrary([FakeGpu()])
    with installed(library):
        sampler = started(library, {"CUDA_VISIBLE_DEVICES": value})
    assert sampler.mode == gpu.MODE_UNAVAILABLE
    assert "hides every GPU" in sampler.reason
    assert library.calls["nvmlInitWithFlags"] == 0


def test_thread_samples_and_shuts_down_cleanly():
    library = FakeNvmlLibrary([FakeGpu()])
    with installed(library):
        sampler = gpu.GpuSampler(gpu.MIN_INTERVAL_S, environ={})
        sampler.start()
        assert sampler.running
        deadline = time.monotonic() + 30
        while sampler.pending_rows < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        sampler.stop()
        rows = sampler.drain()

    assert len(rows) >= 2
    assert not sampler.running and not sampler_threads()
    assert library.shutdowns == 1 and library.calls["nvmlShutdown"] == 1
    assert not library.live_samples  # both GPM samples freed
    sampler.stop()  # a second stop is harmless
    assert library.shutdowns == 1


def test_memory_stays_bounded_over_a_long_simulated_run():
    library = FakeNvmlLibrary([FakeGpu(), FakeGpu(uuid="GPU-second")])
    capacity = 256
    with installed(library):
        sampler = started(library, capacity_rows=capacity)
        sampler.sample_round()
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        rounds = 20_000
        for step in range(rounds):
            sampler.step_source = lambda: step  # noqa: B023 - asked in this round
            sampler.sample_round()
        after = tracemalloc.take_snapshot()
        growth = sum(s.size_diff for s in after.compare_to(before, "filename"))
        tracemalloc.stop()
        rows = sampler.drain()
        sampler.stop()

    assert sampler.pending_rows == 0 and len(rows) == capacity
    assert sampler.dropped_rows == 2 * (rounds + 1) - capacity
    # The newest rows are kept, in order.
    assert rows[-1, COLUMN["step"]] == rounds - 1
    assert (np.diff(rows[:, COLUMN["step"]]) >= 0).all()
    # 20,000 rounds of 2 rows, 320 KiB if kept: far less is allocated.
    assert growth < 64 * 1024, growth


def test_hardware_facts_from_nvml_while_tensorflow_sees_no_gpu():
    library = FakeNvmlLibrary([FakeGpu()])
    with installed(library):
        sampler = started(library)
        facts = hardware_facts(sampler)
        sampler.stop()
    assert facts["source"] == "nvml"
    [device] = facts["gpus"]
    assert device["name"] == library.gpus[0].name and device["fp16_tensor_cores"]
    # Training runs where TensorFlow runs it: on the CPU here.
    assert facts["cpu_only"] is True and facts["gpus_visible"] == 0


def assert_rows_line_up_with_steps(run, times: BatchTimes, steps: int) -> None:
    """Each row's step was in progress at its wall time: the train function
    moves the step on as its call returns, between a batch's begin and end."""
    wall_time, step = run.gpu.column("wall_time"), run.gpu.column("step").astype(int)
    assert len(set(step.tolist())) >= 2
    assert (np.diff(step) >= 0).all()  # in time order, steps never go back
    for t, s in zip(wall_time, step, strict=True):
        assert 0 <= s <= steps
        if s > 0:
            assert t > times.begins[s - 1]  # the call of step s-1 had begun...
        if s < steps:
            assert t < times.ends[s]  # ...and the call of step s had not returned


def test_fit_records_samples_that_line_up_with_steps(tmp_path):
    library = FakeNvmlLibrary([FakeGpu()])
    fake = library.gpus[0]
    steps = 4
    times = BatchTimes(sleep_s=0.3)
    with installed(library):
        profiler = mpprof.MixedPrecisionProfiler(str(tmp_path), gpu_interval=0.1)
        fit_with(profiler, steps=steps, after=[times])

    assert not sampler_threads() and library.shutdowns == 1
    run = reader.read_run(tmp_path, schema.TRAIN_RUN)
    assert run.gpu.mode == gpu.MODE_GPM and run.context["hardware"]["source"] == "nvml"
    tensor = fake.gpm_values[pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL]
    assert (run.gpu.column("tensor_util") == tensor).all()
    assert (run.gpu.column("tensor_util", device=0) == tensor).all()
    assert_rows_line_up_with_steps(run, times, steps)


def test_calls_stay_quiet_while_sampling_and_drain_the_buffer_in_time(tmp_path, monkeypatch):
    """While a GPU is sampled most calls still run quiet (no `after_call`):
    the sampler's thread reads the step itself, so each row carries the step
    in progress at its time, and calls stop being quiet to drain the buffer
    before it is half full, so no row is lost although the run samples far
    more rows than the buffer holds.

    The first call traces the step and drains nothing until it returns: a
    fit without the profiler warms TensorFlow up first, and the buffer holds
    1.2 s of rows, so that only the quiet calls' draining is under test."""
    x, y = mnist_like(samples=64)
    seed_model(last_dtype="float32").fit(x, y, batch_size=32, epochs=1, verbose=0)
    capacity = 12
    monkeypatch.setattr(gpu, "DEFAULT_CAPACITY_ROWS", capacity)
    after_calls = []
    after_call = HostRecorder.after_call

    def counted_after_call(self, fit):
        after_calls.append(fit.step)
        after_call(self, fit)

    monkeypatch.setattr(HostRecorder, "after_call", counted_after_call)
    library = FakeNvmlLibrary([FakeGpu()])
    steps = 90
    times = BatchTimes(sleep_s=0.03)
    with installed(library):
        profiler = mpprof.MixedPrecisionProfiler(
            str(tmp_path), gpu_interval=gpu.MIN_INTERVAL_S, numerics_every=None,
            flush_every_steps=10**5, flush_every_seconds=None,
        )
        fit_with(profiler, steps=steps, after=[times])

    run = reader.read_run(tmp_path, schema.TRAIN_RUN)
    sampler = run.context["collectors"]["gpu"]
    assert sampler["capacity_rows"] == capacity and sampler["dropped_rows"] == 0
    assert len(run.gpu.column("step")) > 2 * capacity  # more rows than it holds, twice
    assert len(after_calls) <= steps // 4, after_calls  # most calls were quiet
    assert_rows_line_up_with_steps(run, times, steps)


def test_an_unexpected_error_while_opening_leaves_nvml_shut_down():
    library = FakeNvmlLibrary([FakeGpu()])

    def crash(ref):
        raise OSError("segfault-like failure inside the library wrapper")

    library.nvmlDeviceGetCount_v2 = crash
    with installed(library):
        sampler = started(library)
    assert sampler.mode == gpu.MODE_UNAVAILABLE
    assert "failed to start" in sampler.reason and "OSError" in sampler.reason
    assert library.shutdowns == 1 and not sampler.running


def test_a_sampler_that_fails_to_say_how_long_calls_may_run_quiet_is_switched_off(
        tmp_path, monkeypatch):
    def failing(self):
        raise RuntimeError("injected into quiet_until")

    monkeypatch.setattr(HostRecorder, "quiet_until", failing)
    library = FakeNvmlLibrary([FakeGpu()])
    with installed(library), pytest.warns(RuntimeWarning, match="stopped recording gpu"):
        history = fit_with(mpprof.MixedPrecisionProfiler(str(tmp_path), gpu_interval=0.1),
                           steps=6)

    assert len(history.history["loss"]) == 1 and math.isfinite(history.history["loss"][0])
    run = reader.read_run(tmp_path, schema.TRAIN_RUN)
    state = run.context["collectors"]["gpu"]
    assert state["state"] == "failed" and "injected into quiet_until" in state["reason"]
    # Only the sampler's collector is off: the rest recorded every step.
    assert run.context["collectors"]["loss_scale"]["state"] == "ok"
    assert run.health["checked_step"] == 6
    assert not sampler_threads()
