"""Shared fixtures: logdirs written by real (small) training runs on CPU."""

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# TensorFlow's oneDNN float16 kernels are emulated on CPUs without native
# float16 math: a mixed_float16 step of the seed model takes ~50x longer with
# them. Training runs here only produce records to test, so use the plain
# Eigen kernels (subprocesses inherit this).
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
# The plugin's run summaries saved between TensorBoard restarts would carry
# over from one test's plugin to the next on the same logdir (and into
# ~/.cache): off, except where a test turns it on (test_summary_store.py).
os.environ.setdefault("MPPROF_SUMMARY_CACHE", "off")

import keras
import numpy as np
import pytest

# In CI (CI=true) a skipped test fails, with its skip reason.
from no_silent_skips import pytest_runtest_makereport  # noqa: F401

import mpprof

# tests/jax and tests/torch run in their own processes with KERAS_BACKEND set
# (`make test`): Keras picks its backend once, at import.
collect_ignore = [folder for folder in ("jax", "torch") if keras.backend.backend() != folder]


@pytest.fixture(autouse=True)
def _restore_global_policy():
    """Tests set the global dtype policy; each starts from float32."""
    keras.mixed_precision.set_dtype_policy("float32")
    yield
    keras.mixed_precision.set_dtype_policy("float32")


def seed_model(policy: str = "mixed_float16", last_dtype=None) -> keras.Model:
    """The seed's Dense(256) -> Dense(10) model under `policy`, compiled."""
    keras.mixed_precision.set_dtype_policy(policy)
    model = keras.Sequential([
        keras.layers.Input((784,)),
        keras.layers.Dense(256, activation="relu", name="dense"),
        keras.layers.Dense(10, dtype=last_dtype, name="dense_1"),
    ])
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def mnist_like(samples: int = 256, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.random((samples, 784), dtype=np.float32), rng.integers(0, 10, samples)


def overflow_model(initial_scale: float = 2.0**30, growth_steps: int = 2000,
                   gradient_accumulation_steps: int | None = None, **compile_kwargs):
    """A small mixed_float16 model whose scaled gradients overflow at first.

    With ones as inputs and targets of 1000, the loss gradient scaled by
    `initial_scale` is far beyond float16: the scale halves on each early step.
    """
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    model = keras.Sequential([
        keras.layers.Input((8,)),
        keras.layers.Dense(8, name="dense"),
        keras.layers.Dense(1, dtype="float32", name="dense_1"),
    ])
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(1e-6, gradient_accumulation_steps=gradient_accumulation_steps),
        initial_scale=initial_scale,
        dynamic_growth_steps=growth_steps,
    )
    model.compile(optimizer=optimizer, loss="mse", **compile_kwargs)
    return model


def overflow_data(samples: int = 128):
    return np.ones((samples, 8), np.float32), np.full((samples, 1), 1000.0, np.float32)


class ScaleProbe(keras.callbacks.Callback):
    """Ground truth of a fit: the optimizer's loss scale and iterations after
    every batch."""

    def __init__(self):
        super().__init__()
        self.scales, self.iterations = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.scales.append(float(self.model.optimizer.dynamic_scale.numpy()))
        self.iterations.append(int(self.model.optimizer.iterations.numpy()))


class BatchTimes(keras.callbacks.Callback):
    """Times each batch's begin and end, then sleeps `sleep_s` (so that each
    step lasts at least that long)."""

    def __init__(self, sleep_s: float):
        super().__init__()
        self.begins, self.ends, self.sleep_s = [], [], sleep_s

    def on_train_batch_begin(self, batch, logs=None):
        self.begins.append(time.time())

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(time.time())
        time.sleep(self.sleep_s)


@pytest.fixture
def reads(monkeypatch):
    """The runs read in full (`reader.read_run`), in order."""
    from mpprof.records import reader

    done = []
    read_run = reader.read_run

    def counting(logdir, run, *args, **kwargs):
        done.append(run)
        return read_run(logdir, run, *args, **kwargs)

    monkeypatch.setattr(reader, "read_run", counting)
    return done


@pytest.fixture(scope="session")
def seed_logdir(tmp_path_factory):
    """A healthy mixed_float16 run of the seed model (float32 logits)."""
    logdir = tmp_path_factory.mktemp("seed")
    model = seed_model(last_dtype="float32")
    x, y = mnist_like()
    model.fit(x, y, batch_size=32, epochs=2, verbose=0,
              callbacks=[mpprof.MixedPrecisionProfiler(log_dir=str(logdir))])
    keras.mixed_precision.set_dtype_policy("float32")
    return logdir


@pytest.fixture(scope="session")
def overflow_logdir(tmp_path_factory):
    """A mixed_float16 run with a gradient overflow storm at its start."""
    logdir = tmp_path_factory.mktemp("overflow")
    model = overflow_model(growth_steps=4)
    x, y = overflow_data()
    model.fit(x, y, batch_size=8, epochs=3, verbose=0,
              callbacks=[mpprof.MixedPrecisionProfiler(log_dir=str(logdir))])
    keras.mixed_precision.set_dtype_policy("float32")
    return logdir
