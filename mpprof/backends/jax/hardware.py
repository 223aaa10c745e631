"""Hardware facts for the run context on JAX (`context_facts.hardware_facts`;
where NVML cannot be used, JAX's devices say whether training runs on a GPU)."""

from __future__ import annotations

import jax

from mpprof.backends import context_facts


def hardware_facts(sampler) -> dict:
    """The run context's "hardware" entry (`context_facts.hardware_facts`).

    Args:
        sampler: the fit's started (or probed) NVML sampler
            (`mpprof.recording.nvml.sampler.GpuSampler`), whose facts to use.
    """
    jax_gpus = [d for d in jax.devices() if d.platform == "gpu"]
    return context_facts.hardware_facts(sampler, "JAX", [
        {"index": i, "name": getattr(d, "device_kind", str(d)), "uuid": None,
         "architecture": None, "compute_capability": None,
         "fp16_tensor_cores": None, "bf16": None, "memory_total_bytes": None}
        for i, d in enumerate(jax_gpus)])
