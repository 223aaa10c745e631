"""The logdir the dashboard tests share: two real training runs on CPU.

- `<img src=x onerror=alert(1)>/train`: a mixed_float16 run in a directory
  with a hostile name (HTML that would run script if rendered as markup;
  Keras on TensorFlow refuses such layer names, they must be valid TF scope
  names), trained with a loss scale so large that the first steps overflow:
  loss-scale events, a float32 island, casts.
- `bfloat16/train`: the same shape under mixed_bfloat16 (no loss scaling),
  with per-layer numerics off, to compare runs.

Written once per test session and shared by the route and the browser tests.
"""

from __future__ import annotations

import pathlib

import keras
import numpy as np

import mpprof

HOSTILE_NAME = "<img src=x onerror=alert(1)>"
FLOAT16_RUN = f"{HOSTILE_NAME}/train"
FIRST_LAYER = "dense_in"
BFLOAT16_RUN = "bfloat16/train"

_written: dict[str, pathlib.Path] = {}


def dashboard_logdir(tmp_path_factory) -> pathlib.Path:
    """The shared logdir, trained on first use."""
    if "logdir" not in _written:
        logdir = tmp_path_factory.mktemp("dashboard")
        _train(logdir / HOSTILE_NAME, "mixed_float16", initial_scale=2.0**30)
        _train(logdir / "bfloat16", "mixed_bfloat16", initial_scale=None, numerics_every=None)
        keras.mixed_precision.set_dtype_policy("float32")
        _written["logdir"] = logdir
    return _written["logdir"]


def _train(
    log_dir: pathlib.Path,
    policy: str,
    initial_scale: float | None,
    numerics_every: int | None = 500,
) -> None:
    keras.mixed_precision.set_dtype_policy(policy)
    model = keras.Sequential(
        [
            keras.layers.Input((8,)),
            keras.layers.Dense(16, activation="relu", name=FIRST_LAYER),
            keras.layers.Dense(1, dtype="float32", name="head"),
        ]
    )
    optimizer = keras.optimizers.SGD(0.001)
    if initial_scale is not None:
        # Targets of 1000 scaled by 2**30 overflow float16: the scale halves
        # on each of the first steps, then grows every 4 finite steps.
        optimizer = keras.optimizers.LossScaleOptimizer(
            optimizer, initial_scale=initial_scale, dynamic_growth_steps=4
        )
    model.compile(optimizer=optimizer, loss="mse")
    x = np.ones((128, 8), np.float32)
    y = np.full((128, 1), 1000.0, np.float32)
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=3,
        verbose=0,
        callbacks=[
            mpprof.MixedPrecisionProfiler(log_dir=str(log_dir), numerics_every=numerics_every)
        ],
    )
