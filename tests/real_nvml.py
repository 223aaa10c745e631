"""The machine's own NVML, asked directly: the reference that tests of the
real (unfaked) GPU path compare the profiler's records with."""

from __future__ import annotations

import pynvml


def nvml_on_this_machine() -> dict | None:
    """What the real NVML says here, asked directly through pynvml: None
    without the library, else {uuid: (total memory, GPM supported)} per GPU."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        return None
    try:
        gpus = {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            try:
                gpm = bool(pynvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)
            except pynvml.NVMLError:
                gpm = False
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            gpus[uuid] = (pynvml.nvmlDeviceGetMemoryInfo(handle).total, gpm)
        return gpus
    finally:
        pynvml.nvmlShutdown()
