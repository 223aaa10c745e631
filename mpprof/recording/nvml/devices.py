"""NVML's side of the GPU sampler: which GPUs CUDA shows, what they are, and
one reading of one GPU.

Every function takes the `pynvml` module it works with (tests give one whose
C library is fake). Like the sampler, this module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping

import numpy as np

from mpprof import dtypes
from mpprof.records import schema

_COLUMN_INDEX = {name: i for i, name in enumerate(schema.GPU_SAMPLE_COLUMNS)}

# GPM metric ids (pynvml's NVML_GPM_METRIC_* names) behind each GPM column.
_GPM_METRICS = (
    ("tensor_util", "NVML_GPM_METRIC_ANY_TENSOR_UTIL"),
    ("hmma_tensor_util", "NVML_GPM_METRIC_HMMA_TENSOR_UTIL"),
    ("imma_tensor_util", "NVML_GPM_METRIC_IMMA_TENSOR_UTIL"),
    ("dfma_tensor_util", "NVML_GPM_METRIC_DFMA_TENSOR_UTIL"),
    ("sm_util", "NVML_GPM_METRIC_SM_UTIL"),
    ("sm_occupancy", "NVML_GPM_METRIC_SM_OCCUPANCY"),
    ("dram_bw_util", "NVML_GPM_METRIC_DRAM_BW_UTIL"),
    ("fp16_util", "NVML_GPM_METRIC_FP16_UTIL"),
    ("fp32_util", "NVML_GPM_METRIC_FP32_UTIL"),
)

# NVML errors after which a device is gone for the rest of the run.
_LOST_DEVICE_ERRORS = (
    "NVML_ERROR_GPU_IS_LOST",
    "NVML_ERROR_GPU_NOT_FOUND",
    "NVML_ERROR_RESET_REQUIRED",
)
# NVML errors that say a query will never work on this device.
_UNSUPPORTED_ERRORS = (
    "NVML_ERROR_NOT_SUPPORTED",
    "NVML_ERROR_NO_PERMISSION",
    "NVML_ERROR_FUNCTION_NOT_FOUND",
)

_ARCHITECTURES = {
    2: "Kepler",
    3: "Maxwell",
    4: "Pascal",
    5: "Volta",
    6: "Turing",
    7: "Ampere",
    8: "Ada",
    9: "Hopper",
    10: "Blackwell",
    13: "Rubin",
}


def architecture_name(
    nvml_architecture: int | None, compute_capability=None
) -> str | None:
    if nvml_architecture in _ARCHITECTURES:
        return _ARCHITECTURES[nvml_architecture]
    # By compute capability, for when NVML cannot name the architecture.
    return dtypes.architecture_of(compute_capability)


def visible_device_selectors(
    environ: Mapping[str, str] | None = None,
) -> list[str] | None:
    """The entries of CUDA_VISIBLE_DEVICES, or None when it is not set.

    Like CUDA, the list ends at the first entry that cannot name a device
    ("-1" included), so "0,-1,1" makes only device 0 visible and "" or "-1"
    none.
    """
    environ = os.environ if environ is None else environ
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    selectors = []
    for entry in value.split(","):
        entry = entry.strip()
        if (
            not entry
            or entry.startswith("-")
            or (not entry.isdigit() and not entry.upper().startswith(("GPU-", "MIG-")))
        ):
            break
        selectors.append(entry)
    return selectors


@dataclasses.dataclass
class Device:
    """One GPU being sampled."""

    index: int  # as TensorFlow/CUDA number it, after CUDA_VISIBLE_DEVICES
    nvml_index: int
    handle: object
    name: str | None = None
    gpm: bool = False
    gpm_reason: str = ""
    gpm_samples: list = dataclasses.field(default_factory=list)
    lost: bool = False
    # Queries that said "not supported" once: never asked again.
    unsupported: set = dataclasses.field(default_factory=set)


class DeviceLost(Exception):
    """The GPU is gone (lost, reset, not found): no more samples from it."""


def visible_nvml_indices(
    nvml, selectors: list[str] | None, count: int, warnings: list[str]
) -> list[int]:
    """NVML indices of the GPUs CUDA shows, in CUDA's order.

    Assumes CUDA and NVML order devices alike, which holds with
    CUDA_DEVICE_ORDER=PCI_BUS_ID and on machines with one GPU model.

    Args:
        nvml: the pynvml module, initialised.
        selectors: `visible_device_selectors()`, None when all are visible.
        count: how many GPUs NVML sees.
        warnings: where to say which entries cannot be sampled.
    """
    if selectors is None:
        return list(range(count))
    uuids = None
    chosen: list[int] = []
    for selector in selectors:
        if selector.isdigit():
            found = int(selector) if int(selector) < count else None
        elif selector.upper().startswith("MIG-"):
            warnings.append(
                f"CUDA_VISIBLE_DEVICES entry {selector!r} is a MIG instance: "
                "not sampled (NVML samples MIG instances through their parent GPU)"
            )
            found = None
        else:
            if uuids is None:
                uuids = [_uuid(nvml, i) for i in range(count)]
            matches = [i for i, u in enumerate(uuids) if u and u.startswith(selector)]
            found = matches[0] if len(matches) == 1 else None
        if found is None or found in chosen:
            break  # CUDA ignores this entry and every one after it
        chosen.append(found)
    return chosen


def _uuid(nvml, nvml_index: int) -> str | None:
    try:
        return nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(nvml_index))
    except nvml.NVMLError:
        return None


def device_facts(nvml, device: Device) -> dict:
    """The run context's facts of one GPU (name, compute capability, ...)."""
    handle = device.handle
    name = _optional(nvml, nvml.nvmlDeviceGetName, handle)
    capability = _optional(nvml, nvml.nvmlDeviceGetCudaComputeCapability, handle)
    capability = list(capability) if capability else None
    memory = _optional(nvml, nvml.nvmlDeviceGetMemoryInfo, handle)
    return {
        "index": device.index,
        "nvml_index": device.nvml_index,
        "name": name,
        "uuid": _optional(nvml, nvml.nvmlDeviceGetUUID, handle),
        "architecture": architecture_name(
            _optional(nvml, nvml.nvmlDeviceGetArchitecture, handle), capability
        ),
        "compute_capability": capability,
        "fp16_tensor_cores": dtypes.has_fp16_tensor_cores(capability),
        "bf16": dtypes.has_native_bf16(capability),
        "memory_total_bytes": int(memory.total) if memory is not None else None,
    }


def system_facts(nvml) -> dict:
    """The driver's version and the CUDA version it supports."""
    cuda = _optional(nvml, nvml.nvmlSystemGetCudaDriverVersion)
    return {
        "driver_version": _optional(nvml, nvml.nvmlSystemGetDriverVersion),
        # NVML encodes CUDA 12.4 as 12040.
        "cuda_driver_version": f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else None,
    }


def open_gpm(nvml, device: Device) -> None:
    """Sets `device.gpm` (and its reason) and takes the first GPM sample."""
    try:
        support = nvml.nvmlGpmQueryDeviceSupport(device.handle)
    except nvml.NVMLError as e:
        device.gpm_reason = f"GPM support cannot be queried ({describe(e)})"
        return
    if not support.isSupportedDevice:
        device.gpm_reason = "GPM is not supported (it needs Hopper or newer)"
        return
    try:
        device.gpm_samples = [nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()]
        # The first reading needs a sample from before it.
        nvml.nvmlGpmSampleGet(device.handle, device.gpm_samples[0])
    except nvml.NVMLError as e:
        free_gpm_samples(nvml, device)
        device.gpm_reason = f"GPM sampling failed ({describe(e)})"
        return
    device.gpm = True
    device.gpm_reason = "GPM supported"


def free_gpm_samples(nvml, device: Device) -> None:
    for sample in device.gpm_samples:
        try:
            nvml.nvmlGpmSampleFree(sample)
        except Exception:  # noqa: BLE001 - freeing is best effort
            pass
    device.gpm_samples = []


# Called with (query or column, error text) for each failed query.
OnFailure = Callable[[str, str], None]


def read_gpm(nvml, device: Device, row: np.ndarray, on_failure: OnFailure) -> None:
    """Fills `row`'s GPM columns from this and the previous GPM sample.

    Raises:
        DeviceLost: the GPU is gone.
    """
    previous, current = device.gpm_samples
    try:
        nvml.nvmlGpmSampleGet(device.handle, current)
    except nvml.NVMLError as e:
        _failed(nvml, device, "gpm", e, on_failure)
        return
    request = nvml.c_nvmlGpmMetricsGet_t()
    request.version = nvml.NVML_GPM_METRICS_GET_VERSION
    request.numMetrics = len(_GPM_METRICS)
    request.sample1 = previous
    request.sample2 = current
    for i, (_, metric) in enumerate(_GPM_METRICS):
        request.metrics[i].metricId = getattr(nvml, metric)
    # The next reading starts where this one ends.
    device.gpm_samples = [current, previous]
    try:
        nvml.nvmlGpmMetricsGet(request)
    except nvml.NVMLError as e:
        _failed(nvml, device, "gpm", e, on_failure)
        return
    for i, (column, _) in enumerate(_GPM_METRICS):
        metric = request.metrics[i]
        if metric.nvmlReturn == nvml.NVML_SUCCESS:
            row[_COLUMN_INDEX[column]] = metric.value
        else:
            on_failure(column, describe(nvml.NVMLError(metric.nvmlReturn)))


def read_basic(nvml, device: Device, row: np.ndarray, on_failure: OnFailure) -> None:
    """Fills `row`'s basic NVML columns (utilization, memory, power, ...).

    Raises:
        DeviceLost: the GPU is gone.
    """
    for query, columns, read in _BASIC_QUERIES:
        if query in device.unsupported:
            continue
        try:
            values = read(nvml, device.handle)
        except nvml.NVMLError as e:
            _failed(nvml, device, query, e, on_failure)
            continue
        for column, value in zip(columns, values, strict=True):
            row[_COLUMN_INDEX[column]] = value


def _failed(nvml, device: Device, query: str, error, on_failure: OnFailure) -> None:
    if any(error.value == getattr(nvml, name, None) for name in _LOST_DEVICE_ERRORS):
        raise DeviceLost(describe(error))
    if any(error.value == getattr(nvml, name, None) for name in _UNSUPPORTED_ERRORS):
        device.unsupported.add(query)
    on_failure(query, describe(error))


def _read_utilization(nvml, handle):
    rates = nvml.nvmlDeviceGetUtilizationRates(handle)
    return rates.gpu, rates.memory


def _read_memory(nvml, handle):
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    return memory.used, memory.total


def _read_clock_event_reasons(nvml, handle):
    try:
        return (nvml.nvmlDeviceGetCurrentClocksEventReasons(handle),)
    except nvml.NVMLError_FunctionNotFound:
        # Drivers before 535 know the same bits as "throttle reasons".
        return (nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle),)


# (query name, columns it fills, reader). A reader returns one value per column.
_BASIC_QUERIES = (
    ("utilization", ("gpu_util", "mem_util"), _read_utilization),
    ("memory", ("mem_used_bytes", "mem_total_bytes"), _read_memory),
    (
        "power",
        ("power_w",),
        lambda nvml, h: (nvml.nvmlDeviceGetPowerUsage(h) / 1000.0,),
    ),  # mW -> W
    (
        "sm_clock",
        ("sm_clock_mhz",),
        lambda nvml, h: (nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM),),
    ),
    (
        "temperature",
        ("temperature_c",),
        lambda nvml, h: (nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU),),
    ),
    ("clock_event_reasons", ("clock_event_reasons",), _read_clock_event_reasons),
)


def _optional(nvml, query, *args):
    """`query(*args)`, or None when NVML cannot answer it."""
    try:
        return query(*args)
    except nvml.NVMLError:
        return None


def init_failure(nvml, error) -> str:
    if isinstance(error, nvml.NVMLError_LibraryNotFound):
        return (
            "the NVML library (libnvidia-ml.so.1) was not found: no NVIDIA driver "
            "is installed, so no GPU can be sampled"
        )
    if isinstance(error, nvml.NVMLError_DriverNotLoaded):
        return "the NVIDIA driver is not loaded (nvmlInit: Driver Not Loaded)"
    return f"nvmlInit failed: {describe(error)}"


def describe(error: BaseException) -> str:
    try:
        text = str(error)
    except Exception:  # noqa: BLE001 - NVMLError.__str__ may call into NVML
        text = ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
