"""How a fix's code is spelled for tf-keras (framework-free): TensorFlow's
row with tf-keras' own LossScaleOptimizer API."""

from __future__ import annotations

import dataclasses

from mpprof.backends.tensorflow import fix_spelling

SPELLING = dataclasses.replace(
    fix_spelling.SPELLING,
    framework="TensorFlow and tf-keras",
    scaled_step=("loss = opt.get_scaled_loss(loss) inside the tape; "
                 "grads = opt.get_unscaled_gradients(grads); "
                 "opt.apply_gradients(zip(grads, variables))."),
    custom_step=(
        "    with tf.GradientTape() as tape:\n"
        "        y_pred = self(x, training=True)\n"
        "        loss = self.compiled_loss(y, y_pred)\n"
        "        scaled_loss = {optimizer}.get_scaled_loss(loss)\n"
        "    grads = tape.gradient(scaled_loss, self.trainable_variables)\n"
        "    grads = {optimizer}.get_unscaled_gradients(grads)\n"
        "    {optimizer}.apply_gradients(zip(grads, self.trainable_variables))"
    ),
)
