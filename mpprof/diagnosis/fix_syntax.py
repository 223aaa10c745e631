"""The code a finding's fix shows, spelled for the Keras the run trained with.

A fix is copied into the user's code: `keras.layers.Dense(..., dtype="float32")`
for Keras 3, `tf_keras.layers.Dense(...)` for tf-keras. The run context's
"keras_flavor" says which; nothing here imports either.
"""

from __future__ import annotations


class FixSyntax:
    """How a fix's code is spelled in the model's own Keras ("keras" or "tf_keras").

    Args:
        flavor: the run context's "keras_flavor".
    """

    def __init__(self, flavor: str | None):
        self.module = "tf_keras" if flavor == "tf_keras" else "keras"

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
        """How a custom train step scales its loss and applies the gradients."""
        if self.module == "tf_keras":
            return ("loss = opt.get_scaled_loss(loss) inside the tape; "
                    "grads = opt.get_unscaled_gradients(grads); "
                    "opt.apply_gradients(zip(grads, variables)).")
        return "loss = opt.scale_loss(loss); opt.apply(grads, variables) unscales them."
