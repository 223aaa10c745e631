"""The run context on PyTorch: versions (torch; no TensorFlow), policies,
optimizer and the devices torch sees."""

from __future__ import annotations

import platform
import time

import keras
import torch

from mpprof._version import __version__


def gpus_visible() -> int:
    """The CUDA devices torch sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_context(
    model, *, collectors: dict, step: int, fit_count: int, hardware: dict | None = None
) -> dict:
    """As `mpprof.backends.tensorflow.context.run_context`, for Keras on PyTorch."""
    optimizer = model.optimizer
    gpus = gpus_visible()
    devices = [{"name": "cpu:0", "type": "CPU"}] + [
        {"name": f"cuda:{i}", "type": "GPU"} for i in range(gpus)]
    context = {
        "mpprof_version": __version__,
        "torch_version": torch.__version__,
        "keras_version": keras.__version__,
        "keras_flavor": "keras",
        "keras_backend": "torch",
        "python_version": platform.python_version(),
        "host": platform.node(),
        "global_policy": keras.mixed_precision.global_policy().name,
        "model_policy": model.dtype_policy.name,
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
        "jit_compile": bool(getattr(model, "jit_compile", False)),
        "run_eagerly": bool(model.run_eagerly),
        "steps_per_execution": int(getattr(model, "steps_per_execution", 1) or 1),
        "distribution_strategy": "none",
        "num_replicas": 1,
        "devices": devices,
        # The key the run context's reader knows for "GPUs the framework saw"
        # (`mpprof.records.run_context.RunContext.gpus_visible`), beside
        # torch's own.
        "gpus_visible": gpus,
        "gpus_visible_to_torch": gpus,
        "collectors": collectors,
        "start_step": int(step),
        "fit_count": int(fit_count),
        "wall_time": time.time(),
    }
    if hardware is not None:
        context["hardware"] = hardware
    return context
