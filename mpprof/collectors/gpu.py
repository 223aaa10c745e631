"""NVML sampler: Tensor Core utilization (GPM), SM use, memory, power, clocks.

A background thread reads NVML every `interval_s` seconds for every GPU the
process can see and keeps the rows in a fixed-size ring buffer; the training
thread drains it and writes the rows (TensorBoard writers belong to one
thread). Three modes, chosen at `start()` and never raising:

- `gpm`: every visible GPU supports NVML's GPM API (Hopper and newer), which
  measures Tensor Core activity (any/HMMA/IMMA/DFMA), SM utilization and
  occupancy, DRAM bandwidth and FP16/FP32 pipe use. Each reading is the
  difference of two GPM samples, so the sampler keeps the previous one.
- `basic`: NVML without GPM (older GPUs, old drivers): only "a kernel was
  running" utilization, memory, power, SM clock, temperature and clock-event
  reasons. The Tensor Core columns stay NaN: NVML cannot see them there.
- `unavailable`: no nvidia-ml-py, no NVML library, no driver, no GPU, or
  CUDA_VISIBLE_DEVICES hides every GPU. The reason is recorded.

This module imports no TensorFlow, so `benchmarks/gpu_check.py` can use it on
a machine that has only PyTorch or CuPy.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Mapping

import numpy as np

from mpprof import arguments, dtypes, schema

MODE_GPM = "gpm"
MODE_BASIC = "basic"
MODE_UNAVAILABLE = "unavailable"

DEFAULT_INTERVAL_S = 0.5
# NVML's utilization windows are 1/6 s to 1 s: sampling faster shows nothing new.
MIN_INTERVAL_S = 0.1
# Rows kept between two drains: 4096 rows x 20 float64 = 640 KiB, whatever
# the run length. At 0.5 s and one GPU that is 34 minutes between drains.
DEFAULT_CAPACITY_ROWS = 4096

COLUMNS = schema.GPU_SAMPLE_COLUMNS
_COLUMN_INDEX = {name: i for i, name in enumerate(COLUMNS)}

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
# By compute capability major, for when NVML cannot name the architecture.
_ARCHITECTURES_BY_CC = {
    3: "Kepler",
    5: "Maxwell",
    6: "Pascal",
    7: "Volta",
    8: "Ampere",
    9: "Hopper",
    10: "Blackwell",
    12: "Blackwell",
}


def architecture_name(
    nvml_architecture: int | None, compute_capability=None
) -> str | None:
    if nvml_architecture in _ARCHITECTURES:
        return _ARCHITECTURES[nvml_architecture]
    if compute_capability:
        if tuple(compute_capability) == (7, 5):
            return "Turing"
        if tuple(compute_capability) == (8, 9):
            return "Ada"
        return _ARCHITECTURES_BY_CC.get(compute_capability[0])
    return None


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
class _Device:
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


class _RowRing:
    """A fixed-size, thread-safe ring of sample rows; the oldest are overwritten."""

    def __init__(self, capacity: int, columns: int):
        self._rows = np.full((capacity, columns), np.nan)
        self._lock = threading.Lock()
        self._start = 0
        self._count = 0
        self.dropped = 0

    def __len__(self) -> int:
        return self._count

    @property
    def capacity(self) -> int:
        return len(self._rows)

    def append(self, row) -> None:
        with self._lock:
            capacity = len(self._rows)
            if self._count == capacity:
                self._start = (self._start + 1) % capacity
                self._count -= 1
                self.dropped += 1
            self._rows[(self._start + self._count) % capacity] = row
            self._count += 1

    def drain(self) -> np.ndarray:
        with self._lock:
            order = (self._start + np.arange(self._count)) % len(self._rows)
            rows = self._rows[order].copy()
            self._start = 0
            self._count = 0
        return rows


class GpuSampler:
    """Samples NVML on a background thread; the training thread drains rows.

    Never raises out of `start`, `drain` or `stop`: whatever NVML does, the
    mode and reason say what was measured.

    Args:
        interval_s: seconds between sampling rounds (>= 0.1).
        capacity_rows: rows kept between two `drain` calls; older ones are
            overwritten (and counted in `dropped_rows`) if nobody drains.
        environ: environment to read CUDA_VISIBLE_DEVICES from (default
            `os.environ`).
        clock: wall-clock function for the "wall_time" column.

    Attributes:
        step: the train step in progress; the training thread sets it, every
            row carries it.
        mode: "gpm", "basic" or "unavailable" (after `start`).
        reason: why that mode, in words.
    """

    def __init__(
        self,
        interval_s: float = DEFAULT_INTERVAL_S,
        *,
        capacity_rows: int = DEFAULT_CAPACITY_ROWS,
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.interval_s = validate_interval(interval_s)
        self.step = 0
        self.mode = MODE_UNAVAILABLE
        self.reason = "not started"
        self.warnings: list[str] = []
        self._environ = os.environ if environ is None else environ
        self._clock = clock
        self._ring = _RowRing(int(capacity_rows), len(COLUMNS))
        self._nvml = None
        self._devices: list[_Device] = []
        self._device_facts: list[dict] = []
        self._system_facts: dict = {}
        self._metric_failures: dict[str, str] = {}
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._rounds = 0

    # ----------------------------------------------------------------- public

    def start(self) -> None:
        """Initializes NVML, picks the mode and starts the sampling thread."""
        try:
            self._open()
        except Exception as e:  # noqa: BLE001 - the sampler must never break training
            self._close()
            self._set_unavailable(f"the GPU sampler failed to start: {_describe(e)}")
        if self.mode == MODE_UNAVAILABLE:
            return
        self._thread = threading.Thread(
            target=self._run, name="mpprof-gpu-sampler", daemon=True
        )
        self._thread.start()

    def probe(self) -> None:
        """Reads mode and hardware facts once, then closes NVML (no sampling)."""
        try:
            self._open()
        except Exception as e:  # noqa: BLE001 - the sampler must never break training
            self._set_unavailable(f"the GPU probe failed: {_describe(e)}")
        self._close()

    def stop(self) -> None:
        """Stops the thread, frees GPM samples and shuts NVML down."""
        self._stop_event.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=max(5.0, 4 * self.interval_s))
            if thread.is_alive():
                # NVML is stuck in a call: leave the library to the daemon thread.
                self.warnings.append(
                    "the sampling thread did not stop within its timeout"
                )
                return
        self._close()

    def drain(self) -> np.ndarray:
        """The rows sampled since the last drain: float64 [n, len(COLUMNS)]."""
        return self._ring.drain()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def pending_rows(self) -> int:
        return len(self._ring)

    @property
    def capacity_rows(self) -> int:
        return self._ring.capacity

    @property
    def dropped_rows(self) -> int:
        return self._ring.dropped

    def sample_round(self) -> None:
        """Samples every live device once (the thread calls this each interval)."""
        wall_time, step = self._time_and_step()
        for device in self._devices:
            if device.lost:
                continue
            row = np.full(len(COLUMNS), np.nan)
            row[0], row[1], row[2] = wall_time, step, device.index
            try:
                if device.gpm:
                    self._read_gpm(device, row)
                self._read_basic(device, row)
            except _DeviceLost as e:
                device.lost = True
                self.warnings.append(
                    f"GPU {device.index} ({device.name}) vanished at step {step}: {e}; "
                    "no more samples from it"
                )
                continue
            self._ring.append(row)
        self._rounds += 1

    def _time_and_step(self) -> tuple[float, int]:
        """A wall time and the step in progress AT that time.

        The training thread moves `step` on at any moment: reading it before
        and after the clock, and retrying if it moved, pins the pair.
        """
        while True:
            step = self.step
            wall_time = self._clock()
            if self.step == step:
                return wall_time, step

    def context(self) -> dict:
        """The run context's collectors["gpu"] entry."""
        entry = {
            "state": "unavailable" if self.mode == MODE_UNAVAILABLE else "ok",
            "mode": self.mode,
            "reason": self.reason,
            "interval_s": self.interval_s,
            "columns": list(COLUMNS),
            "devices": [
                {
                    **facts,
                    "mode": MODE_GPM if d.gpm else MODE_BASIC,
                    "gpm_reason": d.gpm_reason,
                    "lost": d.lost,
                }
                for d, facts in zip(self._devices, self._device_facts, strict=True)
            ],
            "capacity_rows": self.capacity_rows,
            "dropped_rows": self.dropped_rows,
            "rounds": self._rounds,
        }
        if self._metric_failures:
            entry["metric_failures"] = dict(self._metric_failures)
        if self.warnings:
            entry["warnings"] = list(self.warnings)
        return entry

    def hardware(self) -> dict:
        """GPU facts from NVML: {"gpus": [...], "driver_version", ...}."""
        return {"gpus": [dict(f) for f in self._device_facts], **self._system_facts}

    # ---------------------------------------------------------------- opening

    def _open(self) -> None:
        selectors = visible_device_selectors(self._environ)
        if selectors is not None and not selectors:
            value = self._environ.get("CUDA_VISIBLE_DEVICES")
            self._set_unavailable(f"CUDA_VISIBLE_DEVICES={value!r} hides every GPU")
            return
        try:
            import pynvml
        except ImportError as e:
            self._set_unavailable(
                f"nvidia-ml-py (module pynvml) is not installed ({e})"
            )
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            self._set_unavailable(_init_failure(pynvml, e))
            return
        self._nvml = pynvml
        try:
            self._open_devices(selectors)
        except pynvml.NVMLError as e:
            self._close()
            self._set_unavailable(f"NVML could not list the GPUs: {_describe(e)}")
            return
        if not self._devices:
            self._close()
            if selectors:
                value = self._environ.get("CUDA_VISIBLE_DEVICES")
                why = f"CUDA_VISIBLE_DEVICES={value!r} names no GPU that NVML knows"
            else:
                why = "NVML sees no GPU on this machine"
            self._set_unavailable(why)
            return
        self._system_facts = self._read_system_facts()
        without_gpm = [d for d in self._devices if not d.gpm]
        if not without_gpm:
            self.mode = MODE_GPM
            self.reason = (
                "GPM is supported on every visible GPU: Tensor Core utilization "
                "is measured"
            )
        else:
            self.mode = MODE_BASIC
            self.reason = "; ".join(
                f"GPU {d.index} ({d.name}): {d.gpm_reason}" for d in without_gpm
            ) + (
                ". Only 'a kernel was running' utilization is available, not "
                "Tensor Core activity"
            )

    def _open_devices(self, selectors: list[str] | None) -> None:
        nvml = self._nvml
        count = nvml.nvmlDeviceGetCount()
        for index, nvml_index in enumerate(
            self._visible_nvml_indices(selectors, count)
        ):
            handle = nvml.nvmlDeviceGetHandleByIndex(nvml_index)
            device = _Device(index=index, nvml_index=nvml_index, handle=handle)
            facts = self._read_device_facts(device)
            device.name = facts["name"]
            self._open_gpm(device)
            self._devices.append(device)
            self._device_facts.append(facts)

    def _visible_nvml_indices(
        self, selectors: list[str] | None, count: int
    ) -> list[int]:
        """NVML indices of the GPUs CUDA shows, in CUDA's order.

        Assumes CUDA and NVML order devices alike, which holds with
        CUDA_DEVICE_ORDER=PCI_BUS_ID and on machines with one GPU model.
        """
        if selectors is None:
            return list(range(count))
        uuids = None
        chosen: list[int] = []
        for selector in selectors:
            if selector.isdigit():
                found = int(selector) if int(selector) < count else None
            elif selector.upper().startswith("MIG-"):
                self.warnings.append(
                    f"CUDA_VISIBLE_DEVICES entry {selector!r} is a MIG instance: "
                    "not sampled (NVML samples MIG instances through their parent GPU)"
                )
                found = None
            else:
                if uuids is None:
                    uuids = [self._uuid(i) for i in range(count)]
                matches = [
                    i for i, u in enumerate(uuids) if u and u.startswith(selector)
                ]
                found = matches[0] if len(matches) == 1 else None
            if found is None or found in chosen:
                break  # CUDA ignores this entry and every one after it
            chosen.append(found)
        return chosen

    def _uuid(self, nvml_index: int) -> str | None:
        try:
            handle = self._nvml.nvmlDeviceGetHandleByIndex(nvml_index)
            return self._nvml.nvmlDeviceGetUUID(handle)
        except self._nvml.NVMLError:
            return None

    def _read_device_facts(self, device: _Device) -> dict:
        nvml, handle = self._nvml, device.handle
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

    def _read_system_facts(self) -> dict:
        nvml = self._nvml
        cuda = _optional(nvml, nvml.nvmlSystemGetCudaDriverVersion)
        return {
            "driver_version": _optional(nvml, nvml.nvmlSystemGetDriverVersion),
            # NVML encodes CUDA 12.4 as 12040.
            "cuda_driver_version": f"{cuda // 1000}.{cuda % 1000 // 10}"
            if cuda
            else None,
        }

    def _open_gpm(self, device: _Device) -> None:
        nvml = self._nvml
        try:
            support = nvml.nvmlGpmQueryDeviceSupport(device.handle)
        except nvml.NVMLError as e:
            device.gpm_reason = f"GPM support cannot be queried ({_describe(e)})"
            return
        if not support.isSupportedDevice:
            device.gpm_reason = "GPM is not supported (it needs Hopper or newer)"
            return
        try:
            device.gpm_samples = [nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()]
            # The first reading needs a sample from before it.
            nvml.nvmlGpmSampleGet(device.handle, device.gpm_samples[0])
        except nvml.NVMLError as e:
            self._free_gpm_samples(device)
            device.gpm_reason = f"GPM sampling failed ({_describe(e)})"
            return
        device.gpm = True
        device.gpm_reason = "GPM supported"

    # --------------------------------------------------------------- sampling

    def _run(self) -> None:
        try:
            while not self._stop_event.wait(self.interval_s):
                self.sample_round()
                if all(d.lost for d in self._devices):
                    return
        except Exception as e:  # noqa: BLE001 - a sampler bug must not reach training
            self.warnings.append(f"the GPU sampler stopped: {_describe(e)}")

    def _read_gpm(self, device: _Device, row: np.ndarray) -> None:
        nvml = self._nvml
        previous, current = device.gpm_samples
        try:
            nvml.nvmlGpmSampleGet(device.handle, current)
        except nvml.NVMLError as e:
            self._failed(device, "gpm", e)
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
            self._failed(device, "gpm", e)
            return
        for i, (column, _) in enumerate(_GPM_METRICS):
            metric = request.metrics[i]
            if metric.nvmlReturn == nvml.NVML_SUCCESS:
                row[_COLUMN_INDEX[column]] = metric.value
            else:
                self._note_failure(column, _describe(nvml.NVMLError(metric.nvmlReturn)))

    def _read_basic(self, device: _Device, row: np.ndarray) -> None:
        nvml, handle = self._nvml, device.handle
        for query, columns, read in _BASIC_QUERIES:
            if query in device.unsupported:
                continue
            try:
                values = read(nvml, handle)
            except nvml.NVMLError as e:
                self._failed(device, query, e)
                continue
            for column, value in zip(columns, values, strict=True):
                row[_COLUMN_INDEX[column]] = value

    def _failed(self, device: _Device, query: str, error) -> None:
        nvml = self._nvml
        if any(
            error.value == getattr(nvml, name, None) for name in _LOST_DEVICE_ERRORS
        ):
            raise _DeviceLost(_describe(error))
        if any(
            error.value == getattr(nvml, name, None) for name in _UNSUPPORTED_ERRORS
        ):
            device.unsupported.add(query)
        self._note_failure(query, _describe(error))

    def _note_failure(self, metric: str, description: str) -> None:
        # First error per metric only: the context stays small on long runs.
        self._metric_failures.setdefault(metric, description)

    # ---------------------------------------------------------------- closing

    def _close(self) -> None:
        nvml, self._nvml = self._nvml, None
        if nvml is None:
            return
        for device in self._devices:
            self._free_gpm_samples(device, nvml)
        try:
            nvml.nvmlShutdown()
        except Exception as e:  # noqa: BLE001 - shutting down must not raise
            self.warnings.append(f"nvmlShutdown failed: {_describe(e)}")

    def _free_gpm_samples(self, device: _Device, nvml=None) -> None:
        nvml = nvml or self._nvml
        for sample in device.gpm_samples:
            try:
                nvml.nvmlGpmSampleFree(sample)
            except Exception:  # noqa: BLE001 - freeing is best effort
                pass
        device.gpm_samples = []

    def _set_unavailable(self, reason: str) -> None:
        self.mode = MODE_UNAVAILABLE
        self.reason = reason
        self._devices = []
        self._device_facts = []


class _DeviceLost(Exception):
    pass


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


def validate_interval(interval_s) -> float:
    """`interval_s` as a float; ValueError unless it is a number >= 0.1."""
    return arguments.seconds(
        "gpu_interval", interval_s, at_least=MIN_INTERVAL_S,
        what=" (NVML updates its utilization no faster), or None to disable the GPU sampler",
    )


def _optional(nvml, query, *args):
    """`query(*args)`, or None when NVML cannot answer it."""
    try:
        return query(*args)
    except nvml.NVMLError:
        return None


def _init_failure(nvml, error) -> str:
    if isinstance(error, nvml.NVMLError_LibraryNotFound):
        return (
            "the NVML library (libnvidia-ml.so.1) was not found: no NVIDIA driver "
            "is installed, so no GPU can be sampled"
        )
    if isinstance(error, nvml.NVMLError_DriverNotLoaded):
        return "the NVIDIA driver is not loaded (nvmlInit: Driver Not Loaded)"
    return f"nvmlInit failed: {_describe(error)}"


def _describe(error: BaseException) -> str:
    try:
        text = str(error)
    except Exception:  # noqa: BLE001 - NVMLError.__str__ may call into NVML
        text = ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
