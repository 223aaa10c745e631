"""What every backend's run context holds alike, framework-free.

Each backend's `context.run_context` adds its framework's own facts (its
versions, devices, distribution) to `common_facts`, and names its framework
with `framework_facts`: the keys are the same on every backend, the
framework is data (`"framework": {"name": "JAX", ...}`, `"gpus_visible"`),
so that readers never branch on a backend's name
(`mpprof.records.run_context.RunContext` also reads the per-framework keys
older runs have: `tensorflow_version`,
`gpus_visible_to_tensorflow`, `jax_version`, `gpus_visible_to_jax`).
"""

from __future__ import annotations

import platform
import time

from mpprof._version import __version__


def common_facts(model, *, collectors: dict, step: int, fit_count: int,
                 hardware: dict | None = None) -> dict:
    """The run context's keys that need no framework.

    Args:
        model: the compiled, built Keras model.
        collectors: per collector, its state: {"state": "ok"|"absent"|
            "unavailable", "reason": ..., plus its own settings}.
        step: the step the fit starts at.
        fit_count: how many fits this callback has profiled, this one included.
        hardware: GPU facts (the backend's `hardware.hardware_facts`), if known.
    """
    optimizer = model.optimizer
    facts = {
        "mpprof_version": __version__,
        "python_version": platform.python_version(),
        "host": platform.node(),
        "model_policy": model.dtype_policy.name,
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
        "jit_compile": bool(getattr(model, "jit_compile", False)),
        "run_eagerly": bool(model.run_eagerly),
        "collectors": collectors,
        "start_step": int(step),
        "fit_count": int(fit_count),
        "wall_time": time.time(),
    }
    if hardware is not None:
        facts["hardware"] = hardware
    return facts


def framework_facts(name: str, version: str, gpus_visible: int, **libraries: str) -> dict:
    """The framework the model trains on, by name, as data.

    Args:
        name: the framework, as people write it ("TensorFlow", "JAX").
        version: its version.
        gpus_visible: how many GPUs it sees (what matters for mixed
            precision is where the framework runs the model).
        libraries: the versions of its other libraries (JAX's `jaxlib`).
    """
    return {"framework": {"name": name, "version": version, "libraries": libraries},
            "gpus_visible": int(gpus_visible)}


def hardware_facts(sampler, framework: str, framework_gpus: list[dict]) -> dict:
    """The run context's "hardware" entry, for every backend.

    NVML (through the GPU sampler) knows most; when it cannot be used but the
    framework sees GPUs, the framework's device details fill in what they
    can. On a CPU-only machine the facts say so: mixed_float16 is slower than
    float32 there (no fp16 Tensor Cores), which the diagnosis warns about.

    Args:
        sampler: a started `GpuSampler` (`mpprof.recording.nvml.sampler`).
        framework: the framework, as people write it ("TensorFlow").
        framework_gpus: the GPUs the framework sees, each with "index",
            "name", "uuid", "architecture", "compute_capability",
            "fp16_tensor_cores", "bf16", "memory_total_bytes" (None where the
            framework does not say).

    Returns:
        `{"cpu_only", "reason", "gpus": [...], "driver_version",
        "cuda_driver_version", "source": "nvml"|<framework, lower case>|"none",
        "nvml": {"mode", "reason"}, "gpus_visible"}`.
    """
    nvml = sampler.hardware()
    if nvml["gpus"]:
        facts = {"source": "nvml", **nvml}
    else:
        facts = {"source": framework.lower() if framework_gpus else "none",
                 "gpus": framework_gpus, "driver_version": None, "cuda_driver_version": None}
    facts["nvml"] = {"mode": sampler.mode, "reason": sampler.reason}
    facts["gpus_visible"] = len(framework_gpus)
    # What matters for mixed precision is where the framework runs the model.
    facts["cpu_only"] = not framework_gpus
    if facts["cpu_only"]:
        facts["reason"] = (
            f"{framework} sees no GPU, so training runs on the CPU (NVML: "
            f"{sampler.reason}). CPUs have no fp16 Tensor Cores: mixed_float16 is "
            "usually slower than float32 there."
        )
    else:
        facts["reason"] = f"{framework} sees {len(framework_gpus)} GPU(s)"
    return facts
