"""Hardware facts on PyTorch: NVML knows most; where it cannot be used,
torch's CUDA devices say whether training runs on a GPU
(`mpprof.backends.context_facts.hardware_facts`, as on every backend)."""

from __future__ import annotations

import torch

from mpprof import dtypes
from mpprof.backends import context_facts
from mpprof.backends.torch.context import gpus_visible


def _torch_gpus() -> list[dict]:
    found = []
    for index in range(gpus_visible()):
        properties = torch.cuda.get_device_properties(index)
        capability = [properties.major, properties.minor]
        found.append({
            "index": index, "name": properties.name, "uuid": None,
            "architecture": dtypes.architecture_of(capability),
            "compute_capability": capability,
            "fp16_tensor_cores": dtypes.has_fp16_tensor_cores(capability),
            "bf16": dtypes.has_native_bf16(capability),
            "memory_total_bytes": int(properties.total_memory),
        })
    return found


def hardware_facts(sampler) -> dict:
    """The run context's "hardware" entry (`context_facts.hardware_facts`).

    Args:
        sampler: the fit's started (or probed) NVML sampler
            (`mpprof.recording.nvml.sampler.GpuSampler`), whose facts to use.
    """
    return context_facts.hardware_facts(sampler, "PyTorch", _torch_gpus())
