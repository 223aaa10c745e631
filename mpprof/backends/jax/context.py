"""The run context on JAX: versions (jax, jaxlib; no TensorFlow), policies,
optimizer, devices."""

from __future__ import annotations

import platform
import time

import jax
import jaxlib
import keras

from mpprof._version import __version__


def run_context(
    model, *, collectors: dict, step: int, fit_count: int, hardware: dict | None = None
) -> dict:
    """As `mpprof.backends.tensorflow.context.run_context`, for Keras on JAX."""
    optimizer = model.optimizer
    distribution = keras.distribution.distribution()
    devices = jax.devices()
    context = {
        "mpprof_version": __version__,
        "jax_version": jax.__version__,
        "jaxlib_version": jaxlib.__version__,
        "keras_version": keras.__version__,
        "keras_flavor": "keras",
        "keras_backend": "jax",
        "python_version": platform.python_version(),
        "host": platform.node(),
        "global_policy": keras.mixed_precision.global_policy().name,
        "model_policy": model.dtype_policy.name,
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
        "jit_compile": bool(getattr(model, "jit_compile", False)),
        "run_eagerly": bool(model.run_eagerly),
        "steps_per_execution": int(getattr(model, "steps_per_execution", 1) or 1),
        "distribution_strategy": (type(distribution).__name__ if distribution is not None
                                  else "none"),
        "num_replicas": len(distribution.device_mesh.devices.flatten())
        if distribution is not None else 1,
        "devices": [{"name": str(d), "type": d.platform.upper()} for d in devices],
        "gpus_visible_to_jax": sum(d.platform == "gpu" for d in devices),
        "collectors": collectors,
        "start_step": int(step),
        "fit_count": int(fit_count),
        "wall_time": time.time(),
    }
    if hardware is not None:
        context["hardware"] = hardware
    return context
