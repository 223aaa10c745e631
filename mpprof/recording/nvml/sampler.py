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

import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from mpprof.recording import arguments
from mpprof.recording.nvml import devices as gpu_devices
from mpprof.records import schema

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
        step_source: returns the train step in progress (every row carries
            it); the sampling thread asks it at each round, so the training
            thread need not tell the sampler each step.
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
        self.step_source: Callable[[], int] = lambda: 0
        self.mode = MODE_UNAVAILABLE
        self.reason = "not started"
        self.warnings: list[str] = []
        self._environ = os.environ if environ is None else environ
        self._clock = clock
        self._ring = _RowRing(int(capacity_rows), len(COLUMNS))
        self._nvml: Any = None
        self._devices: list[gpu_devices.Device] = []
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
            self._set_unavailable(f"the GPU sampler failed to start: {gpu_devices.describe(e)}")
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
            self._set_unavailable(f"the GPU probe failed: {gpu_devices.describe(e)}")
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

    def seconds_before_half_full(self) -> float:
        """How long the ring can go undrained before it is half full, at one
        row per live device each `interval_s` (a drain by then loses no row,
        with the other half to spare)."""
        live = sum(not d.lost for d in self._devices) or 1
        rounds_left = (self.capacity_rows // 2 - self.pending_rows) // live
        return max(0, rounds_left) * self.interval_s

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
                    gpu_devices.read_gpm(self._nvml, device, row, self._note_failure)
                gpu_devices.read_basic(self._nvml, device, row, self._note_failure)
            except gpu_devices.DeviceLost as e:
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

        The training thread moves the step on at any moment: reading it
        before and after the clock, and retrying if it moved, pins the pair.
        """
        while True:
            step = self.step_source()
            wall_time = self._clock()
            if self.step_source() == step:
                return wall_time, step

    def context(self) -> dict:
        """The run context's collectors["gpu"] entry."""
        entry: dict[str, Any] = {
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
        selectors = gpu_devices.visible_device_selectors(self._environ)
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
            self._set_unavailable(gpu_devices.init_failure(pynvml, e))
            return
        self._nvml = pynvml
        try:
            self._open_devices(selectors)
        except pynvml.NVMLError as e:
            self._close()
            self._set_unavailable(f"NVML could not list the GPUs: {gpu_devices.describe(e)}")
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
        self._system_facts = gpu_devices.system_facts(self._nvml)
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
        visible = gpu_devices.visible_nvml_indices(
            nvml, selectors, nvml.nvmlDeviceGetCount(), self.warnings
        )
        for index, nvml_index in enumerate(visible):
            handle = nvml.nvmlDeviceGetHandleByIndex(nvml_index)
            device = gpu_devices.Device(index=index, nvml_index=nvml_index, handle=handle)
            facts = gpu_devices.device_facts(nvml, device)
            device.name = facts["name"]
            gpu_devices.open_gpm(nvml, device)
            self._devices.append(device)
            self._device_facts.append(facts)

    # --------------------------------------------------------------- sampling

    def _run(self) -> None:
        try:
            while not self._stop_event.wait(self.interval_s):
                self.sample_round()
                if all(d.lost for d in self._devices):
                    return
        except Exception as e:  # noqa: BLE001 - a sampler bug must not reach training
            self.warnings.append(f"the GPU sampler stopped: {gpu_devices.describe(e)}")

    def _note_failure(self, metric: str, description: str) -> None:
        # First error per metric only: the context stays small on long runs.
        self._metric_failures.setdefault(metric, description)

    # ---------------------------------------------------------------- closing

    def _close(self) -> None:
        nvml, self._nvml = self._nvml, None
        if nvml is None:
            return
        for device in self._devices:
            gpu_devices.free_gpm_samples(nvml, device)
        try:
            nvml.nvmlShutdown()
        except Exception as e:  # noqa: BLE001 - shutting down must not raise
            self.warnings.append(f"nvmlShutdown failed: {gpu_devices.describe(e)}")

    def _set_unavailable(self, reason: str) -> None:
        self.mode = MODE_UNAVAILABLE
        self.reason = reason
        self._devices = []
        self._device_facts = []


def validate_interval(interval_s) -> float:
    """`interval_s` as a float; ValueError unless it is a number >= 0.1."""
    return arguments.seconds(
        "gpu_interval", interval_s, at_least=MIN_INTERVAL_S,
        what=" (NVML updates its utilization no faster), or None to disable the GPU sampler",
    )


