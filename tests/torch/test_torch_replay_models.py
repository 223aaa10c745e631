"""Forensic replay on PyTorch of the models users bring, as on JAX
(tests/jax/test_jax_replay_models.py, whose models these are): a recurrent
layer (the op inside its time loop is named, mapped to the recurrent layer)
and a model with two outputs and two losses; each with a look-alike in range
that captures nothing."""

from __future__ import annotations

import jax_runs
import numpy as np
from test_jax_replay_models import _lstm, _two_outputs

import mpprof.replay


def test_lstm_overflow_names_the_op_in_its_loop(tmp_path):
    model, x, y = _lstm(steps=5)
    run = jax_runs.fit(tmp_path, model, x, y, batch_size=4, numerics_every=1)
    assert run.context["collectors"]["replay_capture"]["captures"], run.context
    result = mpprof.replay.replay(str(tmp_path), save=False)
    first = result["first_op"]
    assert first["layer"] == "lstm" and first["phase"] == "forward"
    assert first["dtype"] == "float16" and "inf" in first["output"]
    # The step whose state passes 65504: 3640 * 9 = 32800 in, inf out.
    assert max(first["input_abs_max"]) == 32800.0
    assert result["policy_map"] == {"recurrent/lstm": "float32",
                                    "recurrent/lstm/lstm_cell": "float32"}
    assert result["verified"] is True, result["verified_detail"]


def test_short_lstm_captures_nothing(tmp_path):
    model, x, y = _lstm(steps=3)
    run = jax_runs.fit(tmp_path, model, x, y, batch_size=4, numerics_every=1)
    assert run.context["collectors"]["replay_capture"]["captures"] == []


def _xy():
    return np.ones((16, 8), np.float32), {"a": np.ones((16, 1), np.float32),
                                          "b": np.ones((16, 1), np.float32)}


def test_two_output_model_names_the_branch_that_overflows(tmp_path):
    x, y = _xy()
    run = jax_runs.fit(tmp_path, _two_outputs(6000.0), x, y, batch_size=4,
                       numerics_every=1)
    assert run.context["collectors"]["replay_capture"]["captures"], run.context
    result = mpprof.replay.replay(str(tmp_path), save=False)
    first = result["first_op"]
    # hidden: 8 * 0.1 = 0.8; big: 0.8 * 16 * 6000 = 76800, beyond 65504 (on a
    # CPU the float32 product's cast back to float16: tests/torch/test_torch_replay.py).
    assert first["layer"] == "big" and first["dtype"] == "float16", first
    assert result["policy_map"] == {"big": "float32"}
    assert result["verified"] is True, result["verified_detail"]


def test_two_output_model_in_range_captures_nothing(tmp_path):
    x, y = _xy()
    run = jax_runs.fit(tmp_path, _two_outputs(1.0), x, y, batch_size=4, numerics_every=1)
    assert run.context["collectors"]["replay_capture"]["captures"] == []
