"""How a fix's code is spelled on JAX (framework-free: the diagnosis reads
it, `mpprof.fix_syntax.FixSyntax`)."""

from __future__ import annotations

from mpprof.fix_syntax import NUMPY_SCALE_INPUTS, XLA_FLOAT8, Spelling

# The train step is the Keras guide's "Customizing what happens in fit()" for
# JAX, with the loss scaled as Keras' own step scales it
# (keras/src/backend/jax/trainer.py).
SPELLING = Spelling(
    framework="JAX",
    scaled_step=("return opt.scale_loss(loss) from the function jax.value_and_grad "
                 "differentiates (under keras.StatelessScope(state_mapping=...) of the "
                 "optimizer variables); opt.stateless_apply(...) unscales the gradients."),
    custom_step=(
        "    def compute_loss_and_updates(self, trainable_variables,\n"
        "                                 non_trainable_variables,\n"
        "                                 optimizer_variables, x, y):\n"
        "        y_pred, non_trainable_variables = self.stateless_call(\n"
        "            trainable_variables, non_trainable_variables, x, training=True)\n"
        "        loss = self.compute_loss(x, y, y_pred)\n"
        "        mapping = list(zip({optimizer}.variables, optimizer_variables))\n"
        "        with keras.StatelessScope(state_mapping=mapping):\n"
        "            scaled_loss = {optimizer}.scale_loss(loss)\n"
        "        return scaled_loss, (loss, non_trainable_variables)\n"
        "\n"
        "    # in train_step(self, state, data):\n"
        "    grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)\n"
        "    (_, (loss, non_trainable_variables)), grads = grad_fn(\n"
        "        trainable_variables, non_trainable_variables, optimizer_variables, x, y)\n"
        "    trainable_variables, optimizer_variables = {optimizer}.stateless_apply(\n"
        "        optimizer_variables, grads, trainable_variables)   # unscales them"
    ),
    # JAX compiles every step with XLA already; its input pipeline is the user's.
    compile_step=None,
    input_pipeline=("if the GPU is mostly idle, the input pipeline is the bottleneck: "
                    "prefetch batches ahead of the step (e.g. a tf.data or grain "
                    "pipeline with prefetch)."),
    scale_inputs=NUMPY_SCALE_INPUTS,
    float8_gemm=XLA_FLOAT8,
    float_promotion=("jax.lax ops do not promote dtypes; jax.numpy, keras.ops and the "
                     "+, * and @ of JAX arrays do, to float32"),
)
