"""Forensic replay on JAX of the models users bring: a recurrent layer
(its loop is a `lax.scan`: the equation inside the body is named, and
mapped to the recurrent layer) and a model with two outputs and two losses."""

from __future__ import annotations

import jax_runs
import keras
import numpy as np

import mpprof.replay


def _lstm(steps: int) -> tuple[keras.Model, np.ndarray, np.ndarray]:
    """A linear LSTM on ones: with kernels of 10 and recurrent kernels of 1
    its state grows about 9-fold a step (40, 400, 3640, 32800, 295000):
    five steps pass float16's 65504 inside the loop, three do not."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    constant = keras.initializers.Constant
    model = keras.Sequential([
        keras.layers.Input((steps, 4)),
        keras.layers.LSTM(8, activation=None, kernel_initializer=constant(10.0),
                          recurrent_initializer=constant(1.0), name="lstm"),
        keras.layers.Dense(1, kernel_initializer=constant(1e-6), dtype="float32",
                           name="out"),
    ], name="recurrent")
    # Adam at a tiny rate: verifying the fix trains 30 steps from the captured
    # weights, in which float32 must learn (SGD diverges on states of 3e5).
    model.compile(optimizer=keras.optimizers.Adam(1e-9), loss="mse")
    return model, np.ones((16, steps, 4), np.float32), np.ones((16, 1), np.float32)


def test_lstm_overflow_names_the_equation_in_its_loop(tmp_path):
    model, x, y = _lstm(steps=5)
    run = jax_runs.fit(tmp_path, model, x, y, batch_size=4, numerics_every=1)
    assert run.context["collectors"]["replay_capture"]["captures"], run.context
    result = mpprof.replay.replay(str(tmp_path), save=False)
    first = result["first_op"]
    assert first["layer"] == "lstm" and first["phase"] == "forward"
    assert first["op"] not in ("scan", "while"), first  # the body's own equation
    assert first["dtype"] == "float16"
    # The layer with its cell (a layer goes to float32 with its sublayers).
    assert result["policy_map"] == {"recurrent/lstm": "float32",
                                    "recurrent/lstm/lstm_cell": "float32"}
    assert result["verified"] is True, result["verified_detail"]


def test_short_lstm_captures_nothing(tmp_path):
    model, x, y = _lstm(steps=3)
    run = jax_runs.fit(tmp_path, model, x, y, batch_size=4, numerics_every=1)
    assert run.context["collectors"]["replay_capture"]["captures"] == []


def _two_outputs(big: float) -> keras.Model:
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    constant = keras.initializers.Constant
    inputs = keras.layers.Input((8,))
    hidden = keras.layers.Dense(16, kernel_initializer=constant(0.1), name="hidden")(inputs)
    big_branch = keras.layers.Dense(16, kernel_initializer=constant(big), name="big")(hidden)
    small_branch = keras.layers.Dense(16, kernel_initializer=constant(0.1),
                                      name="small")(hidden)
    head_a = keras.layers.Dense(1, kernel_initializer=constant(1e-6), dtype="float32",
                                name="a")(big_branch)
    head_b = keras.layers.Dense(1, kernel_initializer=constant(0.1), dtype="float32",
                                name="b")(small_branch)
    model = keras.Model(inputs, {"a": head_a, "b": head_b}, name="two_outputs")
    # Adam at a rate that moves head a (activations of 8e4) in the 30-step
    # trial verifying the fix, without diverging.
    model.compile(optimizer=keras.optimizers.Adam(1e-8), loss={"a": "mse", "b": "mse"})
    return model


def test_two_output_model_names_the_branch_that_overflows(tmp_path):
    x = np.ones((16, 8), np.float32)
    y = {"a": np.ones((16, 1), np.float32), "b": np.ones((16, 1), np.float32)}
    run = jax_runs.fit(tmp_path, _two_outputs(6000.0), x, y, batch_size=4,
                       numerics_every=1)
    assert run.context["collectors"]["replay_capture"]["captures"], run.context
    result = mpprof.replay.replay(str(tmp_path), save=False)
    first = result["first_op"]
    # hidden: 8 * 0.1 = 0.8; big: 0.8 * 16 * 6000 = 76800, beyond 65504.
    assert first["layer"] == "big" and first["op"] == "dot_general", first
    # A functional model's layers are made outside it: their path is their name.
    assert result["policy_map"] == {"big": "float32"}
    assert result["verified"] is True, result["verified_detail"]


def test_two_output_model_in_range_captures_nothing(tmp_path):
    x = np.ones((16, 8), np.float32)
    y = {"a": np.ones((16, 1), np.float32), "b": np.ones((16, 1), np.float32)}
    run = jax_runs.fit(tmp_path, _two_outputs(1.0), x, y, batch_size=4, numerics_every=1)
    assert run.context["collectors"]["replay_capture"]["captures"] == []
