"""Hardware facts for the run context on TensorFlow: which GPUs, and can they
do fp16/bf16 fast (`context_facts.hardware_facts`; where NVML cannot be used,
TensorFlow's device details give the name and compute capability)."""

from __future__ import annotations

import tensorflow as tf

from mpprof import dtypes
from mpprof.backends import context_facts


def hardware_facts(sampler) -> dict:
    """The run context's "hardware" entry (`context_facts.hardware_facts`).

    Args:
        sampler: the fit's started (or probed) NVML sampler
            (`mpprof.recording.nvml.sampler.GpuSampler`), whose facts to use.
    """
    return context_facts.hardware_facts(sampler, "TensorFlow", _tensorflow_gpus())


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
                "architecture": dtypes.architecture_of(capability),
                "compute_capability": capability,
                "fp16_tensor_cores": dtypes.has_fp16_tensor_cores(capability),
                "bf16": dtypes.has_native_bf16(capability),
                "memory_total_bytes": None,
            }
        )
    return found
