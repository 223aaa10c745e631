"""The run context: what a run was (versions, policies, optimizer, devices)."""

from __future__ import annotations

import platform
import time

import keras
import tensorflow as tf

from mpprof._version import __version__
from mpprof.backends.tf_keras import support as tf_keras_support


def run_context(
    model, *, collectors: dict, step: int, fit_count: int, hardware: dict | None = None
) -> dict:
    """A JSON-ready description of the run `model` is about to train.

    Args:
        model: the compiled, built Keras model.
        collectors: per collector, its state: {"state": "ok"|"absent"|
            "unavailable", "reason": ..., plus its own settings}.
        step: the step the fit starts at.
        fit_count: how many fits this callback has profiled, this one included.
        hardware: GPU facts (`mpprof.backends.tensorflow.hardware.hardware_facts`), if known.
    """
    strategy = model.distribute_strategy
    optimizer = model.optimizer
    context = {
        "mpprof_version": __version__,
        "tensorflow_version": tf.__version__,
        "keras_version": tf_keras_support.keras_version(model),
        # "tf_keras" for a tf-keras (Keras 2) model, else "keras" (Keras 3).
        "keras_flavor": tf_keras_support.keras_flavor(model),
        "keras_backend": (
            "tensorflow" if tf_keras_support.is_tf_keras(model) else keras.backend.backend()
        ),
        "python_version": platform.python_version(),
        "host": platform.node(),
        "global_policy": tf_keras_support.global_policy_name(model),
        "model_policy": model.dtype_policy.name,
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
        "jit_compile": bool(getattr(model, "jit_compile", False)),
        "run_eagerly": bool(model.run_eagerly),
        "steps_per_execution": tf_keras_support.steps_per_execution(model),
        "distribution_strategy": type(strategy).__name__,
        "num_replicas": int(strategy.num_replicas_in_sync),
        "devices": [
            {"name": d.name, "type": d.device_type} for d in tf.config.list_logical_devices()
        ],
        "gpus_visible_to_tensorflow": len(tf.config.list_physical_devices("GPU")),
        "float32_matmuls": float32_matmuls(),
        "collectors": collectors,
        "start_step": int(step),
        "fit_count": int(fit_count),
        "wall_time": time.time(),
    }
    if hardware is not None:
        context["hardware"] = hardware
    return context


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
