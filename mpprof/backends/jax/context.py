"""The run context on JAX: versions (jax, jaxlib; no TensorFlow), policies,
optimizer, devices, and the `keras.distribution` the fit runs under."""

from __future__ import annotations

import jax
import jaxlib
import keras

from mpprof.backends.context_facts import common_facts, framework_facts
from mpprof.backends.worker_role import WorkerRole


def run_context(
    model, *, collectors: dict, step: int, fit_count: int, hardware: dict | None = None
) -> dict:
    """A JSON-ready description of the run `model` is about to train on JAX
    (`Backend.run_context`; the arguments: `context_facts.common_facts`)."""
    distribution = keras.distribution.distribution()
    devices = jax.devices()
    return {
        **common_facts(model, collectors=collectors, step=step, fit_count=fit_count,
                       hardware=hardware),
        **framework_facts("JAX", jax.__version__,
                          sum(d.platform == "gpu" for d in devices),
                          jaxlib=jaxlib.__version__),
        "keras_version": keras.__version__,
        "keras_flavor": "keras",
        "keras_backend": "jax",
        "global_policy": keras.mixed_precision.global_policy().name,
        "steps_per_execution": int(getattr(model, "steps_per_execution", 1) or 1),
        "distribution_strategy": (type(distribution).__name__ if distribution is not None
                                  else "none"),
        "num_replicas": _model_replicas(distribution),
        "distribution": distribution_facts(model, distribution),
        "devices": [{"name": str(d), "type": d.platform.upper()} for d in devices],
        **({"local_devices": [{"name": str(d), "type": d.platform.upper()}
                              for d in jax.local_devices()]}
           if jax.process_count() > 1 else {}),
        "float32_matmuls": float32_matmuls(),
    }


def worker_role() -> WorkerRole:
    """This process's place in a job on `jax.distributed`: under a
    `keras.distribution` whose device mesh holds other processes' devices,
    the fit is one job of `jax.process_count()` processes, process 0 its
    chief. Otherwise one process (`jax.distributed` without such a
    distribution trains a model per process, each its own run)."""
    distribution = keras.distribution.distribution()
    if distribution is None or jax.process_count() < 2:
        return WorkerRole()
    here = jax.process_index()
    if all(d.process_index == here for d in distribution.device_mesh.devices.flatten()):
        return WorkerRole()
    return WorkerRole(multi_worker=True, is_chief=here == 0, task_type="process",
                      task_index=here, num_workers=jax.process_count(), worker_index=here)


# What mpprof cannot say under a keras.distribution: it reads each global
# array, which JAX assembles from its shards.
NOT_MEASURED_PER_DEVICE = [
    "numerics statistics are of each whole (global) tensor: which device or shard held a "
    "value, an overflow included, is not recorded",
    "the Tensor Core shape lint (MP007) checks each layer's global dimensions: the "
    "per-device shards of the sharded variables are not checked",
]


def _model_replicas(distribution) -> int:
    """Copies of the model the batch is split over: the mesh's batch axis
    (1 under a ModelParallel mesh with a batch axis of 1), every device under
    DataParallel; Keras before `num_model_replicas`: every device."""
    if distribution is None:
        return 1
    replicas = getattr(distribution, "num_model_replicas", None)
    return int(replicas if replicas is not None else distribution.device_mesh.devices.size)


def distribution_facts(model, distribution) -> dict | None:
    """The distribution by name, its device mesh, the variables it shards and
    what is not measured per device; None without one.

    Args:
        model: the built model (its variables' shardings are read).
        distribution: `keras.distribution.distribution()`.
    """
    if distribution is None:
        return None
    mesh = distribution.device_mesh
    sharded = {}
    for variable in model.weights:
        # The layout the distribution gives it (its arrays may be donated
        # to the jitted step by now: their shardings are not read).
        axes = distribution.get_variable_layout(variable).axes
        if any(axis is not None for axis in axes):
            sharded[variable.path] = [axis if axis is None or isinstance(axis, str)
                                      else list(axis) for axis in axes]
    return {
        "name": type(distribution).__name__,
        "mesh": {"shape": [int(n) for n in mesh.shape], "axis_names": list(mesh.axis_names),
                 "devices": [str(d) for d in mesh.devices.flatten()]},
        "batch_dim_name": getattr(distribution, "batch_dim_name", None),
        "sharded_variables": sharded,
        "not_measured": NOT_MEASURED_PER_DEVICE,
    }


# jax_default_matmul_precision values whose float32 dots keep full float32
# (on GPU: no TF32, no bfloat16 passes).
_FULL_FLOAT32 = ("highest", "float32")


def float32_matmuls() -> dict:
    """What a float32 matmul runs as (`RunContext.float32_matmuls`): JAX's
    default matmul precision uses TF32 on A100/H100 and bfloat16 passes on
    TPU (jax#18934) unless `jax_default_matmul_precision` is "highest"."""
    precision = getattr(jax.config, "jax_default_matmul_precision", None)
    shown = "None (the default)" if precision is None else repr(str(precision))
    return {
        "framework": "jax",
        "jax_default_matmul_precision": None if precision is None else str(precision),
        "tf32_enabled": str(precision).lower() not in _FULL_FLOAT32,
        "setting": f"jax.config.jax_default_matmul_precision = {shown}",
        "disable": 'jax.config.update("jax_default_matmul_precision", "highest")',
    }
