"""A fake of NVML's C library (libnvidia-ml.so), for tests without a GPU.

Only the C boundary is replaced: `install()` sets `pynvml.nvmlLib` to a
`FakeNvmlLibrary` and clears pynvml's function-pointer cache, so pynvml's own
wrappers, ctypes structs, `byref` out-parameters and error mapping all run as
they would against the real library. Each fake function takes the same ctypes
arguments as the C function and returns an `nvmlReturn_t` code.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import threading

import pynvml

_HANDLE_BASE = 0x1000
_SAMPLE_BASE = 0x100000


@dataclasses.dataclass
class FakeGpu:
    """One fake GPU. Change its fields during a run to change what NVML says.

    Args:
        gpm: whether `nvmlGpmQueryDeviceSupport` says yes (Hopper+).
        gpm_values: GPM metric id -> value every GPM reading reports.
        failures: C function name -> NVML error code it returns for this GPU.
        gpm_metric_failures: GPM metric id -> error code in its `nvmlReturn`.
        lost: every call on this GPU returns NVML_ERROR_GPU_IS_LOST.
    """

    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-00000000-1111-2222-3333-444444444444"
    architecture: int = pynvml.NVML_DEVICE_ARCH_HOPPER
    compute_capability: tuple[int, int] = (9, 0)
    gpm: bool = True
    memory_total: int = 80 * 2**30
    memory_used: int = 3 * 2**30
    gpu_util: int = 87
    mem_util: int = 41
    power_mw: int = 350_500
    sm_clock_mhz: int = 1755
    temperature_c: int = 61
    clock_event_reasons: int = pynvml.nvmlClocksEventReasonSwPowerCap
    gpm_values: dict = dataclasses.field(
        default_factory=lambda: {
            pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 42.5,
            pynvml.NVML_GPM_METRIC_HMMA_TENSOR_UTIL: 40.25,
            pynvml.NVML_GPM_METRIC_IMMA_TENSOR_UTIL: 0.0,
            pynvml.NVML_GPM_METRIC_DFMA_TENSOR_UTIL: 0.0,
            pynvml.NVML_GPM_METRIC_SM_UTIL: 91.0,
            pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: 33.5,
            pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: 55.0,
            pynvml.NVML_GPM_METRIC_FP16_UTIL: 12.0,
            pynvml.NVML_GPM_METRIC_FP32_UTIL: 7.5,
        }
    )
    failures: dict = dataclasses.field(default_factory=dict)
    gpm_metric_failures: dict = dataclasses.field(default_factory=dict)
    lost: bool = False


def ampere_gpu(**overrides) -> FakeGpu:
    """An A100: fp16/bf16 Tensor Cores, but no GPM."""
    fields = dict(
        name="NVIDIA A100-SXM4-40GB",
        uuid="GPU-aaaaaaaa-0000-0000-0000-000000000001",
        architecture=pynvml.NVML_DEVICE_ARCH_AMPERE,
        compute_capability=(8, 0),
        gpm=False,
        memory_total=40 * 2**30,
    )
    fields.update(overrides)
    return FakeGpu(**fields)


def _set_pointer(ref, value: int) -> None:
    """Writes `value` into the pointer that `byref(pointer)` refers to."""
    pointer = ref._obj
    ctypes.memmove(
        ctypes.addressof(pointer),
        ctypes.byref(ctypes.c_void_p(value)),
        ctypes.sizeof(ctypes.c_void_p),
    )


def _pointer_value(pointer) -> int:
    return ctypes.cast(pointer, ctypes.c_void_p).value or 0


class FakeNvmlLibrary:
    """Stands in for the loaded libnvidia-ml.so.

    Args:
        gpus: the GPUs NVML reports, in NVML index order.
        init_error: NVML error code `nvmlInitWithFlags` returns, if any.
        missing: C function names the "library" lacks (an older driver).
    """

    def __init__(
        self,
        gpus=(),
        *,
        init_error: int | None = None,
        missing=(),
        driver_version: str = "550.54.15",
        cuda_version: int = 12040,
    ):
        self.gpus = list(gpus)
        self.init_error = init_error
        self.missing = set(missing)
        self.driver_version = driver_version
        self.cuda_version = cuda_version
        self.calls: collections.Counter = collections.Counter()
        self.initialized = 0
        self.shutdowns = 0
        self.live_samples: set[int] = set()
        self._sample_owner: dict[int, FakeGpu] = {}
        self._next_sample = _SAMPLE_BASE
        self._lock = threading.Lock()
        # pynvml sets `.restype` on this one: it must be a plain function.
        self.nvmlErrorString = lambda code: f"fake NVML error {code}".encode()

    def __getattribute__(self, name):
        function = object.__getattribute__(self, name)
        if not name.startswith("nvml"):
            return function
        if name in object.__getattribute__(self, "missing"):
            raise AttributeError(name)  # pynvml maps it to FunctionNotFound
        calls = object.__getattribute__(self, "calls")

        # pynvml caches what it looks up: count calls, not look-ups.
        def counted(*args):
            calls[name] += 1
            return function(*args)

        return counted

    # -- helpers

    def _gpu(self, handle, function: str):
        index = _pointer_value(handle) - _HANDLE_BASE
        if not 0 <= index < len(self.gpus):
            return None, pynvml.NVML_ERROR_INVALID_ARGUMENT
        gpu = self.gpus[index]
        if gpu.lost:
            return None, pynvml.NVML_ERROR_GPU_IS_LOST
        if function in gpu.failures:
            return None, gpu.failures[function]
        return gpu, pynvml.NVML_SUCCESS

    # -- init / system

    def nvmlInitWithFlags(self, flags):
        if self.init_error is not None:
            return self.init_error
        self.initialized += 1
        return pynvml.NVML_SUCCESS

    def nvmlShutdown(self):
        self.shutdowns += 1
        return pynvml.NVML_SUCCESS

    def nvmlSystemGetDriverVersion(self, buffer, size):
        buffer.value = self.driver_version.encode()
        return pynvml.NVML_SUCCESS

    def nvmlSystemGetCudaDriverVersion(self, ref):
        ref._obj.value = self.cuda_version
        return pynvml.NVML_SUCCESS

    def nvmlDeviceGetCount_v2(self, ref):
        ref._obj.value = len(self.gpus)
        return pynvml.NVML_SUCCESS

    def nvmlDeviceGetHandleByIndex_v2(self, index, ref):
        if not 0 <= index.value < len(self.gpus):
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        _set_pointer(ref, _HANDLE_BASE + index.value)
        return pynvml.NVML_SUCCESS

    # -- device facts

    def nvmlDeviceGetName(self, handle, buffer, size):
        gpu, code = self._gpu(handle, "nvmlDeviceGetName")
        if gpu:
            buffer.value = gpu.name.encode()
        return code

    def nvmlDeviceGetUUID(self, handle, buffer, size):
        gpu, code = self._gpu(handle, "nvmlDeviceGetUUID")
        if gpu:
            buffer.value = gpu.uuid.encode()
        return code

    def nvmlDeviceGetArchitecture(self, handle, ref):
        gpu, code = self._gpu(handle, "nvmlDeviceGetArchitecture")
        if gpu:
            ref._obj.value = gpu.architecture
        return code

    def nvmlDeviceGetCudaComputeCapability(self, handle, major, minor):
        gpu, code = self._gpu(handle, "nvmlDeviceGetCudaComputeCapability")
        if gpu:
            major._obj.value, minor._obj.value = gpu.compute_capability
        return code

    # -- basic metrics

    def nvmlDeviceGetMemoryInfo(self, handle, ref):
        gpu, code = self._gpu(handle, "nvmlDeviceGetMemoryInfo")
        if gpu:
            memory = ref._obj
            memory.total = gpu.memory_total
            memory.used = gpu.memory_used
            memory.free = gpu.memory_total - gpu.memory_used
        return code

    def nvmlDeviceGetUtilizationRates(self, handle, ref):
        gpu, code = self._gpu(handle, "nvmlDeviceGetUtilizationRates")
        if gpu:
            ref._obj.gpu, ref._obj.memory = gpu.gpu_util, gpu.mem_util
        return code

    def nvmlDeviceGetPowerUsage(self, handle, ref):
        gpu, code = self._gpu(handle, "nvmlDeviceGetPowerUsage")
        if gpu:
            ref._obj.value = gpu.power_mw
        return code

    def nvmlDeviceGetClockInfo(self, handle, clock_type, ref):
        gpu, code = self._gpu(handle, "nvmlDeviceGetClockInfo")
        if gpu:
            if clock_type.value != pynvml.NVML_CLOCK_SM:
                return pynvml.NVML_ERROR_INVALID_ARGUMENT
            ref._obj.value = gpu.sm_clock_mhz
        return code

    def nvmlDeviceGetTemperature(self, handle, sensor, ref):
        gpu, code = self._gpu(handle, "nvmlDeviceGetTemperature")
        if gpu:
            ref._obj.value = gpu.temperature_c
        return code

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle, ref):
        gpu, code = self._gpu(handle, "nvmlDeviceGetCurrentClocksEventReasons")
        if gpu:
            ref._obj.value = gpu.clock_event_reasons
        return code

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle, ref):
        gpu, code = self._gpu(handle, "nvmlDeviceGetCurrentClocksThrottleReasons")
        if gpu:
            ref._obj.value = gpu.clock_event_reasons
        return code

    # -- GPM

    def nvmlGpmQueryDeviceSupport(self, handle, ref):
        gpu, code = self._gpu(handle, "nvmlGpmQueryDeviceSupport")
        if gpu:
            if ref._obj.version != pynvml.NVML_GPM_SUPPORT_VERSION:
                return pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
            ref._obj.isSupportedDevice = int(gpu.gpm)
        return code

    def nvmlGpmSampleAlloc(self, ref):
        with self._lock:
            sample = self._next_sample
            self._next_sample += 1
            self.live_samples.add(sample)
        _set_pointer(ref, sample)
        return pynvml.NVML_SUCCESS

    def nvmlGpmSampleFree(self, sample):
        with self._lock:
            if _pointer_value(sample) not in self.live_samples:
                return pynvml.NVML_ERROR_INVALID_ARGUMENT
            self.live_samples.discard(_pointer_value(sample))
        return pynvml.NVML_SUCCESS

    def nvmlGpmSampleGet(self, handle, sample):
        gpu, code = self._gpu(handle, "nvmlGpmSampleGet")
        if gpu is None:
            return code
        if not gpu.gpm:
            return pynvml.NVML_ERROR_NOT_SUPPORTED
        if _pointer_value(sample) not in self.live_samples:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        self._sample_owner[_pointer_value(sample)] = gpu
        return pynvml.NVML_SUCCESS

    def nvmlGpmMetricsGet(self, ref):
        request = ref._obj
        if request.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
            return pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        samples = (_pointer_value(request.sample1), _pointer_value(request.sample2))
        if any(s not in self.live_samples for s in samples) or samples[0] == samples[1]:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        gpu = self._sample_owner.get(samples[1])
        if gpu is None or self._sample_owner.get(samples[0]) is not gpu:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        for i in range(request.numMetrics):
            metric = request.metrics[i]
            if metric.metricId in gpu.gpm_metric_failures:
                metric.nvmlReturn = gpu.gpm_metric_failures[metric.metricId]
            elif metric.metricId in gpu.gpm_values:
                metric.nvmlReturn = pynvml.NVML_SUCCESS
                metric.value = gpu.gpm_values[metric.metricId]
            else:
                metric.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return pynvml.NVML_SUCCESS


@contextlib.contextmanager
def installed(library: FakeNvmlLibrary):
    """Makes pynvml call `library` instead of libnvidia-ml.so, then restores it."""
    saved_lib = pynvml.nvmlLib
    saved_refcount = pynvml._nvmlLib_refcount
    pynvml.nvmlLib = library
    pynvml._nvmlGetFunctionPointer_cache.clear()
    try:
        yield library
    finally:
        pynvml.nvmlLib = saved_lib
        pynvml._nvmlLib_refcount = saved_refcount
        pynvml._nvmlGetFunctionPointer_cache.clear()
