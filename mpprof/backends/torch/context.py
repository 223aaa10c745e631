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
    }
