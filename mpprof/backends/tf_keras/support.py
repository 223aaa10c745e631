"""What differs when the model is a tf-keras (Keras 2) model.

Many production codebases still train with tf-keras (`TF_USE_LEGACY_KERAS=1`
and the `tf_keras` package, `pip install mpprof[tf-keras]`). mpprof never
imports tf_keras itself: a tf-keras model can only exist once its user has
imported it, so the module is looked up in `sys.modules`.

The differences mpprof cares about:

- variables are `tf.Variable`s: no `.path` (the name is "dense/kernel:0"),
  `dtype` is a `tf.DType`, `value` is a method;
- the global dtype policy lives in `tf_keras.mixed_precision`;
- the LossScaleOptimizer keeps `loss_scale`/`dynamic_counter` (see
  `mpprof.backends.tf_keras.loss_scale_series`), and its `apply_gradients` receives
  gradients already divided by the scale.
"""

from __future__ import annotations

import sys

import tensorflow as tf

from mpprof.backends.flavor import KERAS_3, TF_KERAS, is_tf_keras


def tf_keras_module():
    """The imported `tf_keras` package, or None when nobody imported it."""
    return sys.modules.get("tf_keras")


def keras_flavor(model) -> str:
    """`TF_KERAS` when `model` is a tf-keras model, else `KERAS_3`."""
    return TF_KERAS if is_tf_keras(model) else KERAS_3


def keras_version(model) -> str:
    if is_tf_keras(model):
        return tf_keras_module().__version__
    import keras

    return keras.__version__


def global_policy_name(model) -> str:
    """The global dtype policy of the Keras that `model` belongs to."""
    if is_tf_keras(model):
        return tf_keras_module().mixed_precision.global_policy().name
    import keras

    return keras.mixed_precision.global_policy().name


def variable_path(variable) -> str:
    """Keras 3's `variable.path`; for a tf.Variable its name without ":0"."""
    path = getattr(variable, "path", None)
    if isinstance(path, str) and path:
        return path
    name = variable.name
    return name[: -len(":0")] if name.endswith(":0") else name


def variable_short_name(variable) -> str:
    """"kernel" for Keras 3's "kernel" and tf-keras's "dense/kernel:0"."""
    return variable_path(variable).split("/")[-1]


def is_float_variable(variable) -> bool:
    return tf.as_dtype(variable.dtype).is_floating


def is_optimizer(value) -> bool:
    """Whether `value` is a tf-keras optimizer of either family: the new
    `tf_keras.optimizers.Optimizer` or the legacy `OptimizerV2`
    (`tf_keras.optimizers.legacy.Optimizer`); each LossScaleOptimizer
    (V3, V2) belongs to its inner optimizer's family."""
    tf_keras = tf_keras_module()
    if tf_keras is None:
        return False
    optimizers = tf_keras.optimizers
    return isinstance(value, (optimizers.Optimizer, optimizers.legacy.Optimizer))


def is_loss_scale_optimizer(optimizer) -> bool:
    """Whether `optimizer` is tf-keras's (V2 or V3) LossScaleOptimizer."""
    tf_keras = tf_keras_module()
    if tf_keras is None or optimizer is None:
        return False
    try:
        from tf_keras.src.mixed_precision.loss_scale_optimizer import BaseLossScaleOptimizer
    except ImportError:  # a tf-keras whose private layout changed
        return isinstance(optimizer, tf_keras.mixed_precision.LossScaleOptimizer)
    return isinstance(optimizer, BaseLossScaleOptimizer)


def fixed_steps_per_execution(model) -> int | None:
    """Keras 3's steps per execution, fixed once compiled; None for tf-keras,
    whose variable its tuner may change during fit."""
    value = getattr(model, "steps_per_execution", None)
    return value if isinstance(value, int) and value > 0 else None


def steps_per_execution(model) -> int:
    """Keras 3 keeps an int; tf-keras a variable (mirrored under a strategy)."""
    value = getattr(model, "steps_per_execution", None)
    if value is None:
        return 1
    if hasattr(value, "numpy"):
        value = value.numpy()
    return int(value) or 1
