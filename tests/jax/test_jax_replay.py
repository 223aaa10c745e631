"""Forensic replay on JAX: a sampled step that overflowed is captured, and
`mpprof replay` (the JAX engine: the step's jaxpr evaluated equation by
equation) names the first op and its layer, ranks the layers float16 vs
float32 and verifies a DTypePolicyMap fix, as on TensorFlow
(tests/test_replay.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import mpprof
from mpprof.records import reader
from mpprof.replay import files

FIX = {"third_dense/d3": "float32"}


def third_dense_model(third_kernel: float = 5000.0) -> keras.Model:
    """Ones through Dense(0.1) twice reach the third Dense at 1.28: with a
    kernel of 5000 its float16 matmul gives 1.28 * 16 * 5000 > 65504."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    constant = keras.initializers.Constant
    model = keras.Sequential([
        keras.layers.Input((8,)),
        keras.layers.Dense(16, kernel_initializer=constant(0.1), name="d1"),
        keras.layers.Dense(16, kernel_initializer=constant(0.1), name="d2"),
        keras.layers.Dense(16, kernel_initializer=constant(third_kernel), name="d3"),
        keras.layers.Dense(1, kernel_initializer=constant(1e-6), dtype="float32",
                           name="out"),
    ], name="third_dense")
    # Adam at a tiny rate: the overflowing steps are skipped (the weights stay
    # as initialised), and verifying the fix trains 30 steps from them, in
    # which float32 must learn without diverging from activations of 1e5.
    model.compile(optimizer=keras.optimizers.Adam(1e-9), loss="mse")
    return model


def _fit(model, logdir, **profiler):
    x = np.ones((32, 8), "float32")
    y = np.ones((32, 1), "float32")
    profiler.setdefault("numerics_every", 2)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False,
              callbacks=[mpprof.MixedPrecisionProfiler(str(logdir), gpu_interval=None,
                                                       **profiler)])
    return reader.read_run(str(logdir), "train").context["collectors"]["replay_capture"]


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("jax_replay")
    context = _fit(third_dense_model(), logdir)
    return logdir, context


def _check(result):
    first = result["first_op"]
    assert first["layer"] == "d3" and first["phase"] == "forward"
    assert first["op"] == "dot_general" and first["dtype"] == "float16"
    assert "inf" in first["output"]
    assert max(first["input_abs_max"]) == pytest.approx(5000.0)
    assert result["divergence"][0]["layer"] == "d3"
    assert result["float32_layers"] == ["d3"]
    assert result["policy_map"] == FIX
    assert result["verified"] is True, result["verified_detail"]
    assert result["dtype_lines"] == ['d3: Dense(..., name="d3", dtype="float32")']


def test_the_capture_says_jax_and_holds_the_step(captured):
    logdir, context = captured
    assert context["state"] == "ok" and context["captures"], context
    capture = files.select_capture(str(logdir), "train", None)
    manifest = capture.manifest
    assert manifest["backend"] == "jax"
    assert "non-finite loss" in manifest["reasons"]
    assert manifest["batch_shapes"] == [[8, 8], [8, 1]]
    assert manifest["layer_paths"]["d3"] == "third_dense/d3"
    weights = capture.weights()
    kernel = next(v for k, v in weights.items() if k.endswith("d3/kernel"))
    assert np.all(kernel == 5000.0)


def test_cli_replay_without_tensorflow_names_the_op_and_verifies_the_fix(captured):
    logdir, _ = captured
    code = ("import sys; sys.modules['tensorflow'] = None\n"
            "from mpprof import cli\n"
            f"sys.exit(cli.main(['replay', {str(logdir)!r}, '--format', 'json']))\n")
    env = {**os.environ, "KERAS_BACKEND": "jax"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    shown = json.loads(done.stdout)
    results = shown if isinstance(shown, list) else [shown]
    result = next(r for r in results if r.get("first_op"))
    _check(result)


def test_in_process_replay_is_the_same(captured):
    logdir, _ = captured
    result = mpprof.replay.replay(str(logdir), save=False)
    _check(result)
    assert result["backend"] == "jax"


def test_the_healthy_twin_captures_nothing(tmp_path):
    context = _fit(third_dense_model(third_kernel=1.0), tmp_path)
    assert context["state"] == "ok" and context["captures"] == []
    assert files.find_captures(str(tmp_path), "train") == []
