"""This host's records: NVML samples of its GPUs and the XProf window's
Tensor Core kernel share (`mpprof.recording.nvml.sampler`, `.kernels`).

The sampler thread only queues rows; the training thread writes them, into
this host's run (`fit.host_writer`: the worker's own run under
MultiWorkerMirroredStrategy, else the model run).
"""

from __future__ import annotations

import math
import time

from mpprof.backends.collector import Collector
from mpprof.backends.patching import Patches
from mpprof.recording.nvml import sampler as gpu_collector
from mpprof.recording.siblings import sibling_callbacks
from mpprof.records import schema


class HostRecorder(Collector):
    """Starts the GPU sampler and the XProf window, writes what they saw.

    Args:
        interval_s: seconds between NVML samples, or None for no sampler.
        profile_window: the backend's `ProfileWindow` of `profile_steps`
            (`mpprof.backends.profile_window`), or None.
        profiler: the profiling callback (its siblings may own the profiler).
        backend: the model's `mpprof.backends.base.Backend`.
    """

    name = "gpu"

    def __init__(self, interval_s: float | None, profile_window, profiler, backend):
        self._interval_s = interval_s
        self._window = profile_window
        self._profiler = profiler
        self._api = backend
        self._sampler: gpu_collector.GpuSampler | None = None
        self.hardware: dict | None = None

    def install(self, fit, patches: Patches) -> None:
        if self._interval_s is not None:
            self._sampler = gpu_collector.GpuSampler(
                self._interval_s, capacity_rows=gpu_collector.DEFAULT_CAPACITY_ROWS
            )
            # Read by the sampling thread; the profiler keeps `fit.step`
            # current on every call, quiet ones included.
            self._sampler.step_source = lambda: fit.step
            self._sampler.start()
        sampler = self._sampler
        if sampler is None:  # not sampling: NVML probed once, for the facts
            sampler = gpu_collector.GpuSampler()
            sampler.probe()
        self.hardware = self._api.hardware_facts(sampler)
        if self._window is not None:
            siblings = sibling_callbacks(self._profiler, self._api.callback_list_class)
            self._window.begin(fit.step, siblings, self._api)

    @property
    def after_each_call(self) -> bool:
        """A sampler that samples must be drained in time, an XProf window
        opened and closed on its steps; a sampler that found no GPU (a
        CPU-only machine) and a window that is over have nothing to do."""
        return self._sampling() or self._window_pending()

    def quiet_until(self) -> float:
        """Calls may skip `after_call` until the sampler's ring is half full
        (they keep the step it reads current); none may while an XProf
        window waits for its first step or traces."""
        if self._window_pending():
            return -math.inf
        if not self._sampling():
            return math.inf
        return time.monotonic() + self._sampler.seconds_before_half_full()

    def after_call(self, fit) -> None:
        # Write before the ring buffer would overwrite unwritten rows.
        if self._sampling() and self._sampler.seconds_before_half_full() <= 0:
            self._write_samples(fit)
        if self._window is not None:
            self._write_kernel_stats(fit, self._window.after_steps(fit.step))

    def _sampling(self) -> bool:
        return (self._sampler is not None
                and self._sampler.mode != gpu_collector.MODE_UNAVAILABLE)

    def _window_pending(self) -> bool:
        return self._window is not None and self._window.state in ("waiting", "tracing")

    def flush(self, fit) -> None:
        self._write_samples(fit)

    def end(self, fit) -> None:
        if self._sampler is not None:
            self._sampler.stop()
        if self._window is not None:
            self._write_kernel_stats(fit, self._window.finish())

    def release(self) -> None:
        """Stops the sampler thread whatever happened (idempotent)."""
        if self._sampler is not None:
            self._sampler.stop()

    def _write_samples(self, fit) -> None:
        if self._sampler is None:
            return
        rows = self._sampler.drain()
        if len(rows):
            step = int(rows[-1, schema.GPU_SAMPLE_COLUMN.step])
            fit.host_writer.write_array(schema.GPU_SAMPLES, rows, step)

    def _write_kernel_stats(self, fit, result: dict | None) -> None:
        if result is not None:
            fit.host_writer.write_json(schema.KERNEL_STATS, result, fit.step)

    def context(self) -> dict:
        if self._sampler is not None:
            return self._sampler.context()
        return {
            "state": "unavailable", "mode": gpu_collector.MODE_UNAVAILABLE,
            "reason": "the GPU sampler is off (gpu_interval=None)",
            "interval_s": None,
        }

    def kernels_context(self) -> dict | None:
        return self._window.context() if self._window is not None else None
