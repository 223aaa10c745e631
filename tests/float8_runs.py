"""Tiny float8 training runs (`model.quantize("float8")`) on CPU, for the
float8 tests and the float8 view's tests."""

from __future__ import annotations

import keras
import numpy as np

import mpprof

BATCH = 8
STEPS = 6


def float8_model(policy: str = "float32") -> keras.Model:
    """Dense -> LayerNormalization -> Dense, both Dense layers in float8; the
    normalisation keeps the head's inputs steady whatever the first layer sees."""
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_dtype_policy(policy)
    model = keras.Sequential([
        keras.layers.Input((8,)),
        keras.layers.Dense(16, activation="relu", name="hidden"),
        keras.layers.LayerNormalization(name="norm"),
        keras.layers.Dense(1, name="head", dtype="float32" if policy != "float32" else None),
    ], name="f8")
    model.quantize("float8", filters=lambda layer: isinstance(layer, keras.layers.Dense))
    return model


def compiled_float8_model(gradient_amax: float | None = None) -> keras.Model:
    """`float8_model()` compiled with SGD and mse; `gradient_amax` fills the
    hidden layer's output-gradient amax history: far beyond the gradients, it
    holds their scale up for the whole history and every gradient value of
    the layer quantizes to 0."""
    model = float8_model()
    if gradient_amax is not None:
        model.get_layer("hidden").outputs_grad_amax_history.assign(
            np.full(1024, gradient_amax, np.float32))
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    return model


def float8_data(growth: float = 1.0):
    """STEPS batches of normal inputs, batch i scaled by growth**i, and targets."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, 8)).astype(np.float32)
    x *= (growth ** np.repeat(np.arange(STEPS), BATCH))[:, None].astype(np.float32)
    return x, rng.normal(size=(BATCH * STEPS, 1)).astype(np.float32)


def fit_float8(log_dir, model, x, y, numerics_every=500) -> None:
    """Fits one epoch with the profiler; `numerics_every=1` samples every
    step but the first (of these few steps the default samples step 1 only)."""
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[mpprof.MixedPrecisionProfiler(
                  log_dir=str(log_dir), flush_every_steps=2, numerics_every=numerics_every)])
    keras.mixed_precision.set_dtype_policy("float32")
