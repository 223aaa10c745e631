"""Hardware facts on PyTorch: NVML knows most; where it cannot be used,
torch's CUDA devices say whether training runs on a GPU (as TensorFlow's do
in `mpprof.backends.tensorflow.hardware`)."""

from __future__ import annotations

import torch

from mpprof import dtypes
from mpprof.backends.torch.context import gpus_visible
from mpprof.recording.nvml import devices as gpu_devices
from mpprof.recording.nvml import sampler as gpu


def _torch_gpus() -> list[dict]:
    found = []
    for index in range(gpus_visible()):
        properties = torch.cuda.get_device_properties(index)
        capability = [properties.major, properties.minor]
        found.append({
            "index": index, "name": properties.name, "uuid": None,
            "architecture": gpu_devices.architecture_name(None, capability),
            "compute_capability": capability,
            "fp16_tensor_cores": dtypes.has_fp16_tensor_cores(capability),
            "bf16": dtypes.has_native_bf16(capability),
            "memory_total_bytes": int(properties.total_memory),
        })
    return found


def hardware_facts(sampler: gpu.GpuSampler | None = None) -> dict:
    """The run context's "hardware" entry (same keys as on TensorFlow, with
    `gpus_visible_to_torch`)."""
    if sampler is None:
        sampler = gpu.GpuSampler()
        sampler.probe()
    nvml = sampler.hardware()
    torch_gpus = _torch_gpus()
    if nvml["gpus"]:
        facts = {"source": "nvml", **nvml}
    elif torch_gpus:
        facts = {"source": "torch", "gpus": torch_gpus, "driver_version": None,
                 "cuda_driver_version": None}
    else:
        facts = {"source": "none", "gpus": [], "driver_version": None,
                 "cuda_driver_version": None}
    facts["nvml"] = {"mode": sampler.mode, "reason": sampler.reason}
    facts["gpus_visible_to_torch"] = len(torch_gpus)
    facts["cpu_only"] = not torch_gpus
    if facts["cpu_only"]:
        facts["reason"] = (
            f"PyTorch sees no GPU, so training runs on the CPU (NVML: {sampler.reason}). "
            "CPUs have no fp16 Tensor Cores: mixed_float16 is usually slower than "
            "float32 there."
        )
    else:
        facts["reason"] = f"PyTorch sees {len(torch_gpus)} GPU(s)"
    return facts
