"""Per-layer numerics for tf-keras models.

The layer taps of `NumericsTaps` work unchanged on tf-keras layers; only
the optimizer differs. tf-keras's LossScaleOptimizer scales the loss in
`get_scaled_loss` and divides the gradients by the scale BEFORE
`apply_gradients`, so the gradients recorded there are the unscaled ones and
the scaled ones (what float16 had to hold) are recomputed by multiplying back.
"""

from __future__ import annotations

import tensorflow as tf

from mpprof.backends.patching import Patches
from mpprof.backends.tensorflow.numerics_taps import NumericsTaps


class TfKerasNumericsTaps(NumericsTaps):
    """`NumericsTaps` with tf-keras's `apply_gradients` wrapped."""

    @tf.autograph.experimental.do_not_convert
    def on_call(self, layer, args, kwargs, outputs):
        # tf-keras hands a subclassed layer's `call` (mpprof's wrapper, there)
        # to AutoGraph, which would try to convert this hook too and warn that
        # it cannot; it is plain Python over traced tensors: run it as it is.
        return super().on_call(layer, args, kwargs, outputs)

    def wrap_optimizer(self, optimizer, loss_scale_getter, patches: Patches) -> None:
        """An instance-level wrapper of `apply_gradients`, through `patches`.

        May be called for each optimizer the train step uses; None wraps
        nothing. The step's loss comes from `TfKerasLossWatch`,
        which watches `minimize` on every step.
        """
        if optimizer is None or any(optimizer is o for o in self._optimizers):
            return
        apply_gradients = optimizer.apply_gradients

        def instrumented_apply_gradients(grads_and_vars, *args, **kwargs):
            grads_and_vars = list(grads_and_vars)
            if self.instrumenting:
                self._record_gradients(grads_and_vars, loss_scale_getter)
            return apply_gradients(grads_and_vars, *args, **kwargs)

        patches.set(optimizer, "apply_gradients", instrumented_apply_gradients)
        self._optimizers.append(optimizer)

    def _record_gradients(self, grads_and_vars, loss_scale_getter) -> None:
        scale = tf.cast(loss_scale_getter(), tf.float32)
        rows, grads = self._gradient_rows(
            [g for g, _ in grads_and_vars], [v for _, v in grads_and_vars]
        )
        unscaled = [tf.cast(g, tf.float32) for g in grads]
        self.gradients.record_many(rows, [g * scale for g in unscaled])
        self.unscaled_gradients.record_many(rows, unscaled)
