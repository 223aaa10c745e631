"""Hardware facts for the run context: which GPUs, and can they do fp16/bf16 fast.

NVML (through the GPU sampler) knows most; when it cannot be used but
TensorFlow sees GPUs, TensorFlow's device details fill in name and compute
capability. On a CPU-only machine the facts say so: mixed_float16 is slower
than float32 there (no fp16 Tensor Cores), which the diagnosis warns about.
"""

from __future__ import annotations

import tensorflow as tf

from mpprof import dtypes
from mpprof.recording.nvml import devices as gpu_devices
from mpprof.recording.nvml import sampler as gpu


def hardware_facts(sampler: gpu.GpuSampler | None = None) -> dict:
    """The run context's "hardware" entry.

    Args:
        sampler: a started GpuSampler whose NVML facts to use; None probes
            NVML once (the sampler is disabled).

    Returns:
        `{"cpu_only", "reason", "gpus": [...], "driver_version",
        "cuda_driver_version", "source": "nvml"|"tensorflow"|"none",
        "nvml": {"mode", "reason"}}`; each GPU has "index", "name", "uuid",
        "architecture", "compute_capability" [major, minor],
        "fp16_tensor_cores", "bf16", "memory_total_bytes".
    """
    if sampler is None:
        sampler = gpu.GpuSampler()
        sampler.probe()
    nvml = sampler.hardware()
    tensorflow_gpus = _tensorflow_gpus()
    if nvml["gpus"]:
        facts = {"source": "nvml", **nvml}
    elif tensorflow_gpus:
        facts = {
            "source": "tensorflow",
            "gpus": tensorflow_gpus,
            "driver_version": None,
            "cuda_driver_version": None,
        }
    else:
        facts = {
            "source": "none",
            "gpus": [],
            "driver_version": None,
            "cuda_driver_version": None,
        }
    facts["nvml"] = {"mode": sampler.mode, "reason": sampler.reason}
    facts["gpus_visible_to_tensorflow"] = len(tensorflow_gpus)
    # What matters for mixed precision is where TensorFlow runs the model.
    facts["cpu_only"] = not tensorflow_gpus
    if facts["cpu_only"]:
        facts["reason"] = (
            "TensorFlow sees no GPU, so training runs on the CPU (NVML: "
            f"{sampler.reason}). CPUs have no fp16 Tensor Cores: mixed_float16 is "
            "usually slower than float32 there."
        )
    else:
        facts["reason"] = f"TensorFlow sees {len(tensorflow_gpus)} GPU(s)"
    return facts


def _tensorflow_gpus() -> list[dict]:
    found = []
    for index, device in enumerate(tf.config.list_physical_devices("GPU")):
        try:
            details = tf.config.experimental.get_device_details(device)
        except Exception:  # noqa: BLE001 - details are optional
            details = {}
        capability = details.get("compute_capability")
        capability = list(capability) if capability else None
        found.append(
            {
                "index": index,
                "name": details.get("device_name", device.name),
                "uuid": None,
                "architecture": gpu_devices.architecture_name(None, capability),
                "compute_capability": capability,
                "fp16_tensor_cores": dtypes.has_fp16_tensor_cores(capability),
                "bf16": dtypes.has_native_bf16(capability),
                "memory_total_bytes": None,
            }
        )
    return found
