"""How a fix's code is spelled on TensorFlow (framework-free: the diagnosis
reads it, `mpprof.fix_syntax.FixSyntax`)."""

from __future__ import annotations

from mpprof.fix_syntax import XLA_FLOAT8, Spelling

# The train step is the Keras guide's "Customizing what happens in fit()" for
# TensorFlow, with the loss scaled as Keras' own step scales it
# (keras/src/backend/tensorflow/trainer.py).
SPELLING = Spelling(
    framework="TensorFlow",
    scaled_step=("loss = opt.scale_loss(loss) inside the tape; "
                 "opt.apply(grads, variables) unscales them."),
    custom_step=(
        "    with tf.GradientTape() as tape:\n"
        "        y_pred = self(x, training=True)\n"
        "        loss = self.compute_loss(x=x, y=y, y_pred=y_pred)\n"
        "        scaled_loss = {optimizer}.scale_loss(loss)\n"
        "    grads = tape.gradient(scaled_loss, self.trainable_variables)\n"
        "    {optimizer}.apply(grads, self.trainable_variables)   # unscales them"
    ),
    compile_step="compile with XLA: model.compile(..., jit_compile=True);",
    input_pipeline=("if the GPU is mostly idle, the input pipeline is the bottleneck: "
                    "dataset.prefetch(tf.data.AUTOTUNE)."),
    scale_inputs=("dataset = dataset.map(lambda x, y: (tf.cast(x, tf.float32) * "
                  "({scale}), y))  # or in the input pipeline"),
    float8_gemm=XLA_FLOAT8,
    float_promotion=("TensorFlow's ops and the +, * and @ of its tensors do not promote "
                     "dtypes; keras.ops do, to float32"),
)
