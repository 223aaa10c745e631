"""Small real training runs on JAX (CPU), each made to show or not show a
finding; the same recipes as tests/diagnosis_runs.py, which needs TensorFlow."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import keras
import numpy as np

import mpprof
from mpprof.records import reader


def fit(log_dir, model, x, y, *, batch_size=8, epochs=1, callbacks=(), **profiler):
    profiler.setdefault("gpu_interval", None)  # no sampler thread on CPU
    model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0, shuffle=False,
              callbacks=[mpprof.MixedPrecisionProfiler(log_dir=str(log_dir), **profiler),
                         *callbacks])
    return reader.read_run(str(log_dir), "train")


def classifier(policy: str, hidden: int = 64, inputs: int = 32, last_dtype="float32",
               **compile_kwargs) -> keras.Model:
    keras.mixed_precision.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.layers.Input((inputs,)),
        keras.layers.Dense(hidden, activation="relu", name="hidden"),
        keras.layers.Dense(8, dtype=last_dtype, name="logits"),
    ])
    compile_kwargs.setdefault("optimizer", "adam")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  **compile_kwargs)
    return model


def classes(samples=64, inputs=32):
    rng = np.random.default_rng(0)
    return rng.random((samples, inputs), dtype=np.float32), rng.integers(0, 8, samples)


def regression(kernel=None, head=None, *, initial_scale=2.0**15, learning_rate=0.0,
               growth_steps=2000, loss="mse", **compile_kwargs) -> keras.Model:
    """Ones in, a fixed target out; `learning_rate=0` keeps the gradients
    constant, so the loss-scale trajectory is deterministic."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.layers.Input((8,)),
        keras.layers.Dense(16, kernel_initializer=kernel or "glorot_uniform", name="first"),
        keras.layers.Dense(16, kernel_initializer=kernel or "glorot_uniform", name="second"),
        keras.layers.Dense(1, dtype="float32", kernel_initializer=head or "glorot_uniform",
                           name="head"),
    ])
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(learning_rate), initial_scale=initial_scale,
        dynamic_growth_steps=growth_steps)
    model.compile(optimizer=optimizer, loss=loss, **compile_kwargs)
    return model


def ones(samples, target):
    return np.ones((samples, 8), np.float32), np.full((samples, 1), target, np.float32)


def overflow_model(growth_steps=4, **compile_kwargs) -> keras.Model:
    """Scaled gradients overflow at first (scale 2**30, targets 1000), then
    grow back every `growth_steps` steps and overflow again: a storm with
    growths, as tests/conftest.py's `overflow_model`."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(1)
    model = keras.Sequential([
        keras.layers.Input((8,)),
        keras.layers.Dense(8, name="dense"),
        keras.layers.Dense(1, dtype="float32", name="dense_1"),
    ])
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(1e-6), initial_scale=2.0**30, dynamic_growth_steps=growth_steps)
    model.compile(optimizer=optimizer, loss="mse", **compile_kwargs)
    return model


class ScaleProbe(keras.callbacks.Callback):
    """The truth after every batch (touching `self.model` syncs Keras' JAX
    state to the variables each batch: slow, but exact)."""

    def __init__(self):
        super().__init__()
        self.scales, self.iterations = [], []

    def on_train_batch_end(self, batch, logs=None):
        optimizer = self.model.optimizer
        self.scales.append(float(np.asarray(optimizer.dynamic_scale.value)))
        self.iterations.append(int(np.asarray(optimizer.iterations.value)))


def fit_beside_a_twin(log_dir, make, x, y, **profiler):
    """`make()` fitted without the profiler (the truth, read after every
    batch), then a second `make()` under it on the same batches.

    Returns:
        (the truth: {"overflows": steps that skipped, "scale": the twin's
        final scale, "weights": its weights}, the profiled model, its run).
    """
    probe = ScaleProbe()
    twin = make()
    twin.fit(x, y, batch_size=8, verbose=0, shuffle=False, callbacks=[probe])
    skipped = np.flatnonzero(np.diff(np.concatenate([[0], probe.iterations])) == 0)
    profiled = make()
    run = fit(log_dir, profiled, x, y, **profiler)
    truth = {"overflows": skipped.tolist(), "scale": probe.scales[-1],
             "weights": [np.asarray(w.value) for w in twin.weights]}
    return truth, profiled, run


def same_weights(weights, model) -> bool:
    return all(np.array_equal(a, np.asarray(b.value))
               for a, b in zip(weights, model.weights, strict=True))


def run_script(script: str, log_dir) -> dict:
    """Runs `script` (Python source) in a fresh interpreter with the log dir
    and this folder as its arguments (a JAX that starts with other XLA_FLAGS);
    returns the JSON object its last line prints."""
    result = subprocess.run(
        [sys.executable, "-c", script, str(log_dir), os.path.dirname(__file__)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.splitlines()[-1])
