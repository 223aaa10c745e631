"""The code a finding's fix shows, spelled for the Keras and the backend the
run trained with.

A fix is copied into the user's code: `keras.layers.Dense(..., dtype="float32")`
for Keras 3, `tf_keras.layers.Dense(...)` for tf-keras; a custom train step
is `tf.GradientTape` code on TensorFlow, `jax.value_and_grad` with
`stateless_apply` on JAX and `.backward()` with `apply` under
`torch.no_grad()` on PyTorch. The run context's "keras_flavor" and
"keras_backend" say which; nothing here imports either. Each backend's
spelling is one row of `_SPELLINGS`: the rules ask `FixSyntax` and never
branch on the backend themselves.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class _Spelling:
    """What differs by backend (tf-keras, on TensorFlow only, is a row of its
    own). `custom_step` is a template of `{optimizer}`."""

    framework: str  # what must be installed to run the model again
    scaled_step: str
    custom_step: str
    # MP010's advice: how to compile the step (None: it always is) and how to
    # keep the GPU fed.
    compile_step: str | None
    input_pipeline: str
    # The division of a model input by a scale (`{scale}`), outside the model.
    scale_inputs: str
    # Why a float8 GEMM wants multiples of 16 on this backend.
    float8_gemm: str
    # MP020's: which ops raise on float32 and float16 operands rather than
    # promote (seen in real fits: tests/keras_io/, tests/jax/, tests/torch/).
    float_promotion: str


_NUMPY_SCALE_INPUTS = ('x = x.astype("float32") * ({scale})  # or in the input '
                       "pipeline (NumPy), before model.fit")
_XLA_FLOAT8 = ("float8: cuBLASLt's FP8 GEMM needs multiples of 16, XLA pads both "
               "operands on every call otherwise")

# The train steps are the Keras guides' "Customizing what happens in fit()"
# for TensorFlow, JAX and PyTorch, with the loss scaled as Keras' own steps
# scale it (keras/src/backend/<name>/trainer.py).
_TENSORFLOW = _Spelling(
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
    float8_gemm=_XLA_FLOAT8,
    float_promotion=("TensorFlow's ops and the +, * and @ of its tensors do not promote "
                     "dtypes; keras.ops do, to float32"),
)

_SPELLINGS = {
    "tensorflow": _TENSORFLOW,
    # tf-keras is TensorFlow with its own LossScaleOptimizer API.
    "tf_keras": dataclasses.replace(
        _TENSORFLOW,
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
    ),
    "jax": _Spelling(
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
        scale_inputs=_NUMPY_SCALE_INPUTS,
        float8_gemm=_XLA_FLOAT8,
        float_promotion=("jax.lax ops do not promote dtypes; jax.numpy, keras.ops and the "
                         "+, * and @ of JAX arrays do, to float32"),
    ),
    # Keras' PyTorch step (TorchTrainer.train_step) calls `scale_loss`, then
    # `.backward()` on the scaled loss; LossScaleOptimizer.apply divides the
    # gradients by the scale (`_common_apply` on every backend but TensorFlow).
    "torch": _Spelling(
        framework="PyTorch",
        scaled_step=("opt.scale_loss(loss).backward(); "
                     "opt.apply([v.value.grad for v in variables], variables) under "
                     "torch.no_grad() unscales them."),
        custom_step=(
            "    self.zero_grad()\n"
            "    y_pred = self(x, training=True)\n"
            "    loss = self.compute_loss(x=x, y=y, y_pred=y_pred)\n"
            "    {optimizer}.scale_loss(loss).backward()\n"
            "    trainable_weights = self.trainable_weights[:]\n"
            "    gradients = [v.value.grad for v in trainable_weights]\n"
            "    with torch.no_grad():\n"
            "        {optimizer}.apply(gradients, trainable_weights)   # unscales them"
        ),
        # `jit_compile="auto"` is eager on PyTorch (Trainer._resolve_auto_jit_compile).
        compile_step=("compile the step with torch.compile: model.compile(..., "
                      "jit_compile=True) (Keras on PyTorch runs it eagerly by default; "
                      "mpprof's per-layer numerics are off under it);"),
        input_pipeline=("if the GPU is mostly idle, the input pipeline is the bottleneck: "
                        "give fit a torch.utils.data.DataLoader(..., num_workers=4, "
                        "pin_memory=True), or a tf.data or grain pipeline with prefetch."),
        scale_inputs=_NUMPY_SCALE_INPUTS,
        # Keras' float8 layers quantize and dequantize around `ops.matmul`:
        # XLA fuses that into an FP8 GEMM, PyTorch runs the compute dtype's.
        float8_gemm=("float8: cuBLASLt's FP8 GEMM needs multiples of 16 (Keras on "
                     "PyTorch runs float8 layers' GEMMs in the compute dtype)"),
        float_promotion=("PyTorch promotes + and *, but its matrix products and "
                         "convolutions (@, torch.matmul, F.linear, F.conv2d) do not; "
                         "keras.ops promote, to float32"),
    ),
}


class FixSyntax:
    """How a fix's code is spelled in the model's own Keras ("keras" or
    "tf_keras") on its backend ("tensorflow", "jax" or "torch").

    Args:
        flavor: the run context's "keras_flavor".
        backend: the run context's "keras_backend" (None: TensorFlow, the
            backend of every run written before JAX was supported).
    """

    def __init__(self, flavor: str | None, backend: str | None = None):
        self.module = "tf_keras" if flavor == "tf_keras" else "keras"
        if self.module == "tf_keras" or backend not in _SPELLINGS:
            backend = "tensorflow"
        self.backend = backend
        self._spelling = _SPELLINGS["tf_keras" if self.module == "tf_keras" else backend]

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
    def framework(self) -> str:
        """The framework the model trained on, as a user installs it."""
        return self._spelling.framework

    @property
    def scaled_step(self) -> str:
        """How a custom train step scales its loss and applies the gradients, in a line."""
        return self._spelling.scaled_step

    def custom_step(self, optimizer: str = "self.optimizer") -> str:
        """A custom `train_step` that scales its loss, as code in the run's
        Keras and backend (indented four spaces; `x`, `y` the batch's)."""
        return self._spelling.custom_step.format(optimizer=optimizer)

    def faster_step(self) -> list[str]:
        """MP010's advice beyond the GEMM shapes: compiling the step (where
        the backend does not always) and feeding the GPU, as bullet lines."""
        compile_step = self._spelling.compile_step
        return [f"- {line}" for line in (compile_step, self._spelling.input_pipeline) if line]

    def scale_inputs(self, scale: str) -> list[str]:
        """Model inputs divided into range (`scale`, code: "1 / 65535"): a
        float32 first layer (a float16 Rescaling would cast the raw input to
        float16 first, the very overflow), or the division outside the model."""
        rescaling = self.layer("Rescaling", f'{scale}, dtype="float32"')
        return [
            f"{rescaling}  # as the model's first layer, right after its Input",
            self._spelling.scale_inputs.format(scale=scale),
        ]

    def cast(self, value: str, dtype: str) -> str:
        """`value` cast to `dtype` (code: `"float32"`, `self.compute_dtype`):
        keras.ops runs on every Keras 3 backend; tf-keras has no ops module."""
        if self.module == "tf_keras":
            return f"tf.cast({value}, {dtype})"
        return f"keras.ops.cast({value}, {dtype})"

    @property
    def float_promotion(self) -> str:
        """Which of this backend's ops raise on float32 and float16 operands
        where others promote (MP020's "mixed_floats")."""
        return self._spelling.float_promotion

    @property
    def float8_gemm(self) -> str:
        """Why a float8 GEMM dimension wants a multiple of 16, on this backend."""
        return self._spelling.float8_gemm
