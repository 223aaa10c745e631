"""The run context: what a run was (versions, policies, optimizer, devices)."""

from __future__ import annotations

import keras
import tensorflow as tf

from mpprof.backends.context_facts import common_facts, framework_facts
from mpprof.backends.flavor import is_tf_keras
from mpprof.backends.tensorflow import keras_flavors


def run_context(
    model, *, collectors: dict, step: int, fit_count: int, hardware: dict | None = None
) -> dict:
    """A JSON-ready description of the run `model` is about to train
    (`Backend.run_context`; the arguments: `context_facts.common_facts`)."""
    strategy = model.distribute_strategy
    return {
        **common_facts(model, collectors=collectors, step=step, fit_count=fit_count,
                       hardware=hardware),
        **framework_facts("TensorFlow", tf.__version__,
                          len(tf.config.list_physical_devices("GPU"))),
        "keras_version": keras_flavors.keras_version(model),
        # "tf_keras" for a tf-keras (Keras 2) model, else "keras" (Keras 3).
        "keras_flavor": keras_flavors.keras_flavor(model),
        "keras_backend": (
            "tensorflow" if is_tf_keras(model) else keras.backend.backend()
        ),
        "global_policy": keras_flavors.global_policy_name(model),
        "steps_per_execution": keras_flavors.steps_per_execution(model),
        "distribution_strategy": type(strategy).__name__,
        "num_replicas": int(strategy.num_replicas_in_sync),
        "devices": [
            {"name": d.name, "type": d.device_type} for d in tf.config.list_logical_devices()
        ],
        "float32_matmuls": float32_matmuls(),
    }


def float32_matmuls() -> dict:
    """What a float32 matmul or convolution runs as (`RunContext.float32_matmuls`):
    TensorFlow runs them in TF32 on Ampere and newer GPUs unless
    `tf.config.experimental.enable_tensor_float_32_execution(False)`."""
    enabled = bool(tf.config.experimental.tensor_float_32_execution_enabled())
    return {
        "framework": "tensorflow",
        "tf32_enabled": enabled,
        "setting": f"tf.config.experimental.tensor_float_32_execution_enabled() = {enabled}",
        "disable": "tf.config.experimental.enable_tensor_float_32_execution(False)",
    }
