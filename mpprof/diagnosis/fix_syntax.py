"""The code a finding's fix shows, spelled for the Keras and the backend the
run trained with.

A fix is copied into the user's code: `keras.layers.Dense(..., dtype="float32")`
for Keras 3, `tf_keras.layers.Dense(...)` for tf-keras; a custom train step
is `tf.GradientTape` code on TensorFlow and `jax.value_and_grad` with
`stateless_apply` on JAX. The run context's "keras_flavor" and
"keras_backend" say which; nothing here imports either.
"""

from __future__ import annotations


class FixSyntax:
    """How a fix's code is spelled in the model's own Keras ("keras" or
    "tf_keras") on its backend ("tensorflow" or "jax").

    Args:
        flavor: the run context's "keras_flavor".
        backend: the run context's "keras_backend" (None: TensorFlow, the
            backend of every run written before JAX was supported).
    """

    def __init__(self, flavor: str | None, backend: str | None = None):
        self.module = "tf_keras" if flavor == "tf_keras" else "keras"
        self.backend = "jax" if backend == "jax" and self.module == "keras" else "tensorflow"

    def layer(self, cls: str, args: str = '..., dtype="float32"') -> str:
        return f"{self.module}.layers.{cls}({args})"

    def set_policy(self, policy: str) -> str:
        if self.module == "tf_keras":
            return f'tf_keras.mixed_precision.set_global_policy("{policy}")'
        return f'keras.mixed_precision.set_dtype_policy("{policy}")'

    def loss_scale_optimizer(self, inner: str, **kwargs) -> str:
        args = "".join(f", {k}={v}" for k, v in kwargs.items())
        where = "mixed_precision" if self.module == "tf_keras" else "optimizers"
        return f"{self.module}.{where}.LossScaleOptimizer({inner}{args})"

    def optimizer(self, name: str) -> str:
        return f"{self.module}.optimizers.{name}()"

    @property
    def loss_methods(self) -> str:
        """Where a train step hands its loss to the optimizer (what mpprof
        watches it in)."""
        if self.module == "tf_keras":
            return "optimizer.minimize or a LossScaleOptimizer's get_scaled_loss"
        return "optimizer.scale_loss"

    @property
    def scaled_step(self) -> str:
        """How a custom train step scales its loss and applies the gradients, in a line."""
        if self.module == "tf_keras":
            return ("loss = opt.get_scaled_loss(loss) inside the tape; "
                    "grads = opt.get_unscaled_gradients(grads); "
                    "opt.apply_gradients(zip(grads, variables)).")
        if self.backend == "jax":
            return ("return opt.scale_loss(loss) from the function jax.value_and_grad "
                    "differentiates (under keras.StatelessScope(state_mapping=...) of the "
                    "optimizer variables); opt.stateless_apply(...) unscales the gradients.")
        return ("loss = opt.scale_loss(loss) inside the tape; "
                "opt.apply(grads, variables) unscales them.")

    def custom_step(self, optimizer: str = "self.optimizer") -> str:
        """A custom `train_step` that scales its loss, as code in the run's
        Keras and backend (indented four spaces, copied from the Keras guides
        "Customizing what happens in fit()" for TensorFlow and JAX)."""
        if self.module == "tf_keras":
            return (
                "    with tf.GradientTape() as tape:\n"
                "        y_pred = self(x, training=True)\n"
                "        loss = self.compiled_loss(y, y_pred)\n"
                f"        scaled_loss = {optimizer}.get_scaled_loss(loss)\n"
                "    grads = tape.gradient(scaled_loss, self.trainable_variables)\n"
                f"    grads = {optimizer}.get_unscaled_gradients(grads)\n"
                f"    {optimizer}.apply_gradients(zip(grads, self.trainable_variables))"
            )
        if self.backend == "jax":
            return (
                "    def compute_loss_and_updates(self, trainable_variables,\n"
                "                                 non_trainable_variables,\n"
                "                                 optimizer_variables, x, y):\n"
                "        y_pred, non_trainable_variables = self.stateless_call(\n"
                "            trainable_variables, non_trainable_variables, x, training=True)\n"
                "        loss = self.compute_loss(x, y, y_pred)\n"
                f"        mapping = list(zip({optimizer}.variables, optimizer_variables))\n"
                "        with keras.StatelessScope(state_mapping=mapping):\n"
                f"            scaled_loss = {optimizer}.scale_loss(loss)\n"
                "        return scaled_loss, (loss, non_trainable_variables)\n"
                "\n"
                "    # in train_step(self, state, data):\n"
                "    grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)\n"
                "    (_, (loss, non_trainable_variables)), grads = grad_fn(\n"
                "        trainable_variables, non_trainable_variables, optimizer_variables, x, y)\n"
                f"    trainable_variables, optimizer_variables = {optimizer}.stateless_apply(\n"
                "        optimizer_variables, grads, trainable_variables)   # unscales them"
            )
        return (
            "    with tf.GradientTape() as tape:\n"
            "        y_pred = self(x, training=True)\n"
            "        loss = self.compute_loss(x=x, y=y, y_pred=y_pred)\n"
            f"        scaled_loss = {optimizer}.scale_loss(loss)\n"
            "    grads = tape.gradient(scaled_loss, self.trainable_variables)\n"
            f"    {optimizer}.apply(grads, self.trainable_variables)   # unscales them"
        )
