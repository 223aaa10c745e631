"""The dtype errors a mixed policy brings out in a user's own layer, for MP020's
tests on every backend (tests/keras_io/test_keras_io.py, tests/jax/,
tests/torch/): a float32 random draw beside float16 activations (keras-io's VAE
`Sampling` layer is the published case) and an op without a float16 kernel.
Each layer acts in training only (as GaussianNoise does), so the model builds
and the error comes from inside fit's train step; `cast=True` is the fix
MP020 names, the healthy look-alike.
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
from keras import layers, ops

import mpprof
from mpprof.reader import read_logdir

BATCH = 32


def sampling(x, epsilon):
    """keras-io's VAE `Sampling`: `z_mean + ops.exp(0.5 * z_log_var) * epsilon`."""
    return x + ops.exp(0.5 * x) * epsilon


def matmul_operator(x, epsilon):
    """A random projection with the tensors' own `@` (not keras.ops.matmul)."""
    return x @ epsilon


class DrawnNoise(layers.Layer):
    """`combine(x, epsilon)` of the float16 input and a `keras.random.normal`
    draw (float32: a draw's default dtype is floatx), of x's shape, or square
    (x's last dimension) when `square`."""

    def __init__(self, combine, square=False, cast=False, **kwargs):
        super().__init__(**kwargs)
        self.combine, self.square, self.cast = combine, square, cast
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, x, training=False):
        if not training:
            return x
        shape = (x.shape[-1], x.shape[-1]) if self.square else ops.shape(x)
        epsilon = keras.random.normal(shape, seed=self.seed_generator)
        if self.cast:
            epsilon = ops.cast(epsilon, self.compute_dtype)
        return self.combine(x, epsilon)


class Whitening(layers.Layer):
    """Multiplies its input by the inverse of its (regularised) Gram matrix:
    `ops.linalg.inv`, which has no float16 kernel on PyTorch's or JAX's CPU.
    `cast=True` inverts in float32 and casts the result back."""

    def __init__(self, cast=False, **kwargs):
        super().__init__(**kwargs)
        self.cast = cast

    def call(self, x, training=False):
        if not training:
            return x
        gram = ops.matmul(ops.transpose(x), x) + ops.eye(x.shape[-1], dtype=x.dtype)
        if self.cast:
            gram = ops.cast(gram, "float32")
        return ops.matmul(x, ops.cast(ops.linalg.inv(gram), self.compute_dtype))


def fit(log_dir, layer_class, *args, policy="mixed_float16", **kwargs):
    """A Dense(8) -> `layer_class(*args, **kwargs)` -> float32 Dense(1)
    regression (the layer made under `policy`, as a model's layers are),
    fitted for 2 steps with a profiler at its defaults: (the run, what fit
    raised or None, the warnings it gave)."""
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_dtype_policy(policy)
    model = keras.Sequential([keras.Input((8,)), layers.Dense(8), layer_class(*args, **kwargs),
                              layers.Dense(1, dtype="float32")])
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.random((BATCH * 2, 8), "float32"), rng.random((BATCH * 2, 1), "float32")
    raised = None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
                      callbacks=[mpprof.MixedPrecisionProfiler(log_dir=str(log_dir))])
    except (TypeError, RuntimeError, NotImplementedError) as error:  # the dtype errors
        raised = error
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    return read_logdir(str(log_dir))["train"], raised, caught


def check_no_half_kernel(tmp_path):
    """The Whitening layer's fit (on a backend whose CPU has no float16
    `linalg.inv`) is MP020's "no_half_kernel" with a cast to float32 as the
    fix, and its float32 inversion trains with no MP020. Returns (the
    finding, what fit raised) for the backend's own words."""
    from keras_io_checks import codes, only

    run, raised, _ = fit(tmp_path / "published", Whitening)
    finding = only(run, "MP020")
    assert finding.evidence["kind"] == "no_half_kernel"
    assert 'keras.ops.cast(x, "float32")' in finding.fix and "top-k" not in finding.fix
    healthy, healthy_raised, _ = fit(tmp_path / "healthy", Whitening, cast=True)
    assert healthy_raised is None and codes(healthy) == {"MP011"}
    return finding, raised
