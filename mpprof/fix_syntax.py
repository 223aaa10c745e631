"""The code a finding's fix shows, spelled for the Keras and the backend the
run trained with.

A fix is copied into the user's code: `keras.layers.Dense(..., dtype="float32")`
for Keras 3, `tf_keras.layers.Dense(...)` for tf-keras; a custom train step
is `tf.GradientTape` code on TensorFlow, `jax.value_and_grad` with
`stateless_apply` on JAX and `.backward()` with `apply` under
`torch.no_grad()` on PyTorch. The run context's "keras_flavor" and
"keras_backend" say which; nothing here imports either. Each backend's
spelling is one `Spelling` row in its own folder
(`mpprof/backends/<name>/fix_spelling.py`, named by its registration): the
rules ask `FixSyntax` and never branch on the backend themselves.
"""

from __future__ import annotations

import dataclasses

# The registry only, to find a backend's row: mpprof.backends' __init__ and
# the fix_spelling modules it names import no framework (pyproject.toml's
# exception to "Records, diagnosis and front ends import no framework").
from mpprof.backends import LEGACY_BACKEND, REGISTRY, TF_KERAS, load, registration


@dataclasses.dataclass(frozen=True)
class Spelling:
    """How a fix's code is spelled on one backend: each backend's row is
    the `SPELLING` of its `mpprof/backends/<name>/fix_spelling.py`, named by
    its `Registration.fix_spelling` (tf-keras, on TensorFlow only, has a row
    of its own). Every field is text shown to the user as is, but where it
    says it is a template.

    Attributes:
        framework: what must be installed to run the model again, as a user
            installs it ("TensorFlow", "TensorFlow and tf-keras").
        scaled_step: how a custom train step scales its loss and applies the
            gradients, in a line (`opt` the optimizer).
        custom_step: a custom `train_step` that scales its loss, as code
            indented four spaces (`x`, `y` the batch's); a template of
            `{optimizer}`.
        compile_step: MP010's advice on compiling the step (None: the
            backend always compiles it).
        input_pipeline: MP010's advice on keeping the GPU fed.
        scale_inputs: the division of a model input by a scale, outside the
            model; a template of `{scale}`.
        float8_gemm: why a float8 GEMM wants multiples of 16 on this backend.
        float_promotion: MP020's: which ops raise on float32 and float16
            operands rather than promote (seen in real fits: tests/keras_io/,
            tests/jax/, tests/torch/).
    """

    framework: str
    scaled_step: str
    custom_step: str
    compile_step: str | None
    input_pipeline: str
    scale_inputs: str
    float8_gemm: str
    float_promotion: str


# What more than one backend spells alike (backend folders do not import each
# other: their rows take it from here).
NUMPY_SCALE_INPUTS = ('x = x.astype("float32") * ({scale})  # or in the input '
                      "pipeline (NumPy), before model.fit")
XLA_FLOAT8 = ("float8: cuBLASLt's FP8 GEMM needs multiples of 16, XLA pads both "
              "operands on every call otherwise")


class FixSyntax:
    """How a fix's code is spelled in the model's own Keras ("keras" or
    "tf_keras") on its backend (a name of `mpprof.backends.REGISTRY`).

    Args:
        flavor: the run context's "keras_flavor".
        backend: the run context's "keras_backend" (None: TensorFlow, the
            backend of every run written before JAX was supported; a backend
            mpprof does not know is spelled as TensorFlow too).
    """

    def __init__(self, flavor: str | None, backend: str | None = None):
        self.module = "tf_keras" if flavor == "tf_keras" else "keras"
        if self.module == "tf_keras":
            registered = TF_KERAS
        else:
            registered = registration(backend or LEGACY_BACKEND) or REGISTRY[LEGACY_BACKEND]
        self.backend = registered.name
        self._spelling: Spelling = load(registered.fix_spelling)

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
