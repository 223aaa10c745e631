"""Hardware facts on JAX: NVML knows most; where it cannot be used, JAX's
devices say whether training runs on a GPU (as TensorFlow's do in
`mpprof.backends.tensorflow.hardware`)."""

from __future__ import annotations

import jax

from mpprof.recording.nvml import sampler as gpu


def hardware_facts(sampler: gpu.GpuSampler | None = None) -> dict:
    """The run context's "hardware" entry (same keys as on TensorFlow, with
    `gpus_visible_to_jax`)."""
    if sampler is None:
        sampler = gpu.GpuSampler()
        sampler.probe()
    nvml = sampler.hardware()
    jax_gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if nvml["gpus"]:
        facts = {"source": "nvml", **nvml}
    elif jax_gpus:
        facts = {
            "source": "jax",
            "gpus": [{"index": i, "name": getattr(d, "device_kind", str(d)), "uuid": None,
                      "architecture": None, "compute_capability": None,
                      "fp16_tensor_cores": None, "bf16": None, "memory_total_bytes": None}
                     for i, d in enumerate(jax_gpus)],
            "driver_version": None,
            "cuda_driver_version": None,
        }
    else:
        facts = {"source": "none", "gpus": [], "driver_version": None,
                 "cuda_driver_version": None}
    facts["nvml"] = {"mode": sampler.mode, "reason": sampler.reason}
    facts["gpus_visible_to_jax"] = len(jax_gpus)
    facts["cpu_only"] = not jax_gpus
    if facts["cpu_only"]:
        facts["reason"] = (
            f"JAX sees no GPU, so training runs on the CPU (NVML: {sampler.reason}). "
            "CPUs have no fp16 Tensor Cores: mixed_float16 is usually slower than "
            "float32 there."
        )
    else:
        facts["reason"] = f"JAX sees {len(jax_gpus)} GPU(s)"
    return facts
