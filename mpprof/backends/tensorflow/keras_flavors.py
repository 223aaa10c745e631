"""What the two Keras flavours on TensorFlow answer differently: Keras 3 and
tf-keras (Keras 2), both served by the TensorFlow backend
(`mpprof.backends.tensorflow.backend`; tf-keras' own parts:
`mpprof.backends.tf_keras`). tf_keras is looked up, never imported: a
tf-keras model exists only once its user imported it."""

from __future__ import annotations

import sys

import tensorflow as tf

from mpprof.backends.flavor import KERAS_3, TF_KERAS, is_tf_keras


def _tf_keras():
    return sys.modules["tf_keras"]


def keras_flavor(model) -> str:
    """`TF_KERAS` when `model` is a tf-keras model, else `KERAS_3`."""
    return TF_KERAS if is_tf_keras(model) else KERAS_3


def keras_version(model) -> str:
    if is_tf_keras(model):
        return _tf_keras().__version__
    import keras

    return keras.__version__


def global_policy_name(model) -> str:
    """The global dtype policy of the Keras that `model` belongs to."""
    if is_tf_keras(model):
        return _tf_keras().mixed_precision.global_policy().name
    import keras

    return keras.mixed_precision.global_policy().name


def is_float_variable(variable) -> bool:
    return tf.as_dtype(variable.dtype).is_floating


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
