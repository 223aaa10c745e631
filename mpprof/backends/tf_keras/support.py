"""What differs when the model is a tf-keras (Keras 2) model.

Many production codebases still train with tf-keras (`TF_USE_LEGACY_KERAS=1`
and the `tf_keras` package, `pip install mpprof[tf-keras]`). mpprof never
imports tf_keras itself: a tf-keras model can only exist once its user has
imported it, so the module is looked up in `sys.modules`.

The differences mpprof cares about:

- variables are `tf.Variable`s: no `.path` (the name is "dense/kernel:0",
  `mpprof.backends.layer_records.variable_path`), `dtype` is a `tf.DType`,
  `value` is a method;
- the global dtype policy lives in `tf_keras.mixed_precision`, the steps per
  execution in a variable (`mpprof.backends.tensorflow.keras_flavors`, which
  the TensorFlow backend asks for both flavours);
- the LossScaleOptimizer keeps `loss_scale`/`dynamic_counter` (see
  `mpprof.backends.tf_keras.loss_scale_series`), and its `apply_gradients` receives
  gradients already divided by the scale.
"""

from __future__ import annotations

import sys


def tf_keras_module():
    """The imported `tf_keras` package, or None when nobody imported it."""
    return sys.modules.get("tf_keras")


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
