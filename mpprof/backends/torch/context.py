"""The run context on PyTorch: versions (torch; no TensorFlow), policies,
optimizer and the devices torch sees."""

from __future__ import annotations

import keras
import torch

from mpprof.backends.context_facts import common_facts, framework_facts


def gpus_visible() -> int:
    """The CUDA devices torch sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_context(
    model, *, collectors: dict, step: int, fit_count: int, hardware: dict | None = None
) -> dict:
    """A JSON-ready description of the run `model` is about to train on
    PyTorch (`Backend.run_context`; the arguments: `context_facts.common_facts`)."""
    gpus = gpus_visible()
    return {
        **common_facts(model, collectors=collectors, step=step, fit_count=fit_count,
                       hardware=hardware),
        **framework_facts("PyTorch", torch.__version__, gpus),
        "keras_version": keras.__version__,
        "keras_flavor": "keras",
        "keras_backend": "torch",
        "global_policy": keras.mixed_precision.global_policy().name,
        "steps_per_execution": int(getattr(model, "steps_per_execution", 1) or 1),
        "distribution_strategy": "none",
        "num_replicas": 1,
        "devices": [{"name": "cpu:0", "type": "CPU"}] + [
            {"name": f"cuda:{i}", "type": "GPU"} for i in range(gpus)],
        "float32_matmuls": float32_matmuls(),
    }


def float32_matmuls() -> dict:
    """What a float32 matmul or convolution runs as (`RunContext.float32_matmuls`):
    PyTorch runs float32 matmuls in float32 by default
    (`torch.backends.cuda.matmul.allow_tf32` False) but cuDNN convolutions in
    TF32 (`torch.backends.cudnn.allow_tf32` True) on Ampere and newer."""
    matmul = bool(torch.backends.cuda.matmul.allow_tf32)
    convolution = bool(torch.backends.cudnn.allow_tf32)
    return {
        "framework": "torch",
        "matmul_allow_tf32": matmul,
        "cudnn_allow_tf32": convolution,
        "tf32_enabled": matmul or convolution,
        "setting": (f"torch.backends.cuda.matmul.allow_tf32 = {matmul}, "
                    f"torch.backends.cudnn.allow_tf32 = {convolution}"),
        "disable": ("torch.backends.cuda.matmul.allow_tf32 = False; "
                    "torch.backends.cudnn.allow_tf32 = False"),
    }
