"""Forensic replay on JAX of models whose `train_step` is their own: the
replay evaluates the model's own step (forward, backward, the optimizers'
updates), not Keras' standard loss, names the overflowing layer and op,
and verifies a float32 fix by re-running that step under the map."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax_runs
import keras
import numpy as np
import pytest
from custom_step_models import CustomStepRegressor, Gan, gan_data

import mpprof.replay
from mpprof.replay import files

BATCH = 4
HERE = os.path.dirname(__file__)


@keras.saving.register_keras_serializable(package="mpprof_replay_tests")
class RegisteredRegressor(CustomStepRegressor):
    """The regressor, rebuildable from its config (for `mpprof replay`)."""


def _regressor(kernel="glorot_uniform", optimizer="adam"):
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = RegisteredRegressor(kernel=kernel)
    model.compile(optimizer=optimizer)
    return model


def _ones(samples=16, target=1.0):
    return np.ones((samples, 8), np.float32), np.full((samples, 1), target, np.float32)


@pytest.fixture(scope="module")
def overflowing(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("custom_replay")
    # Adam at 0.1: verifying the fix trains 30 steps from the captured
    # weights, whose outputs reach 5e7 and whose loss (1e14) swings 2x from
    # one dropout mask to the next; at 1e-4 or 1e-3 the weights barely move,
    # and whether float32 "learns" in the trial was the masks' draw (measured
    # over four replay seeds: -2% to -40% at 1e-4, -90% to -95% at 0.1).
    model = _regressor(keras.initializers.Constant(300.0),
                       optimizer=keras.optimizers.Adam(0.1))
    x, y = _ones()
    run = jax_runs.fit(logdir, model, x, y, batch_size=BATCH, numerics_every=1)
    return logdir, model, run


def _check_second(result):
    first = result["first_op"]
    # first: 8 ones * 300 = 2400; second: 2400 * 300 * 16 > 65504.
    assert first["layer"] == "second" and first["op"] == "dot_general"
    assert first["phase"] == "forward" and first["dtype"] == "float16"
    assert first["input_abs_max"] == [2400.0, 300.0]
    assert result["replayed_as"].startswith("the model's own train_step")
    # The step's own loss (its MSE), not Keras' compiled loss (none: 0):
    # non-finite in float16, finite and huge in float32.
    assert result["loss"]["run_policy"] in ("inf", "nan")
    assert isinstance(result["loss"]["float32"], float) and result["loss"]["float32"] > 1e6
    assert result["divergence"][0]["layer"] == "second"
    assert result["float32_layers"][0] == "second"
    assert result["policy_map"]["registered_regressor/second"] == "float32"
    assert result["verified"] is True, result["verified_detail"]
    assert "notes" not in result  # loss watched, gradients handed to the optimizer


def test_custom_step_replay_names_the_layer_and_verifies_the_fix(overflowing):
    logdir, model, run = overflowing
    assert run.context["collectors"]["replay_capture"]["captures"]
    before = [np.asarray(v.value) for v in model.weights]
    result = mpprof.replay.replay(model, logdir=str(logdir), save=False)
    _check_second(result)
    # The dropout layer's float16 cast of the float32 output overflows too,
    # and the gradient of a float32 loss of that size overflows `first`'s.
    assert set(result["float32_layers"]) == {"second", "dropout", "first"}
    for value, variable in zip(before, model.weights, strict=True):
        np.testing.assert_array_equal(value, np.asarray(variable.value))


def test_the_fix_replays_clean_and_without_it_it_does_not(overflowing):
    """The verification, redone by hand: the map's layers in float32."""
    from mpprof.backends import keras_capture
    from mpprof.backends.jax import replay_engine, replay_step

    logdir, model, _ = overflowing
    capture = files.select_capture(str(logdir), "train", None)
    result = mpprof.replay.replay(model, logdir=str(logdir), save=False)
    keras_capture.load_weights(model, capture)
    tree = replay_engine.layer_tree(model)

    def unscaled(layers):
        return replay_engine.run_pass(
            model, capture.batch(), 1.0, layers,
            step=lambda m, t: replay_step.StepPass(m, t, set(), None))

    fixed = unscaled(result["float32_layers"])
    assert fixed.forward_clean and fixed.gradients_finite and np.isfinite(fixed.loss)
    partial = unscaled(["second"])
    assert not partial.forward_clean and partial.offender.layer == "dropout"
    assert set(tree) >= set(result["float32_layers"])


def test_cli_diagnose_replay_shows_the_custom_steps_layer(overflowing):
    logdir, _, _ = overflowing
    code = ("import sys; sys.path.insert(0, sys.argv[1])\n"
            "import test_jax_replay_custom  # registers the model class\n"
            "from mpprof import cli\n"
            "sys.exit(cli.main(['diagnose', sys.argv[2], '--replay', '--format', 'json']))\n")
    env = {**os.environ, "KERAS_BACKEND": "jax"}
    done = subprocess.run([sys.executable, "-c", code, HERE, str(logdir)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode in (0, 1, 2), done.stderr[-2000:]
    rows = json.loads(done.stdout)
    mp003 = next(row for row in rows if row["code"] == "MP003")
    assert mp003["layer"] == "second"
    _check_second(mp003["replay"])
    # Another process, a model rebuilt from its config (its dropout seeded
    # anew): the same capture gets the same verdict, trial losses included.
    model = overflowing[1]
    in_process = mpprof.replay.replay(model, logdir=str(logdir), save=False)
    assert (mp003["replay"]["verification"]["trial"]
            == json.loads(json.dumps(in_process["verification"]["trial"])))


def test_healthy_custom_step_captures_nothing(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.random((16, 8), dtype=np.float32), rng.random((16, 1), dtype=np.float32)
    run = jax_runs.fit(tmp_path, _regressor(), x, y, batch_size=BATCH, numerics_every=1)
    assert run.context["collectors"]["replay_capture"]["captures"] == []
    assert files.find_captures(str(tmp_path), "train") == []


def test_gan_generator_overflow_names_the_generators_layer(tmp_path):
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = Gan(g_kernel=keras.initializers.Constant(300.0))
    model.compile(g_opt=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3)),
                  d_opt=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3)))
    jax_runs.fit(tmp_path, model, gan_data(), None, batch_size=BATCH, numerics_every=1)
    capture = files.select_capture(str(tmp_path), "train", None)
    assert capture.manifest["weights_are_the_steps"] is True
    result = mpprof.replay.replay(model, logdir=str(tmp_path), save=False)
    first = result["first_op"]
    assert first["layer"] == "generator/g_out" and first["op"] == "dot_general"
    assert first["phase"] == "forward" and first["dtype"] == "float16"
    assert "generator/g_out" in result["policy_map"]
    assert result["verified"] is True, result["verified_detail"]


def test_scaled_gradient_overflow_is_the_backward_and_left_to_halving(tmp_path):
    """Gradients that overflow only once scaled: the first bad equation is
    in the backward pass, and no per-layer fix is offered (halving the loss
    scale handles it)."""
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(1e-9), initial_scale=2.0**20, dynamic_growth_steps=1)
    model = _regressor(optimizer=optimizer)
    x, y = _ones(samples=160, target=1000.0)
    run = jax_runs.fit(tmp_path, model, x, y, batch_size=BATCH, numerics_every=1)
    assert run.context["collectors"]["replay_capture"]["captures"], run.context
    result = mpprof.replay.replay(model, logdir=str(tmp_path), save=False)
    first = result["first_op"]
    assert first["phase"] == "backward" and first["dtype"] == "float16", first
    assert first["layer"] == "second" and first["op"] == "dot_general"
    assert result["verified"] is False and "halving" in result["verified_detail"]


def _plain_adam_gan(logdir, large_step: int, factor: float = 1e6, d_out_kernel=None):
    """A GAN with plain Adam (no loss scaling), sampled every other step
    (2, 4, ...), whose real batch `large_step` is `factor` times larger: 1e6
    overflows the discriminator's float16 input cast (> 65504). Adam applies
    that step's NaN gradients: from then on the weights are NaN. Returns the
    model and the steps captured."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = Gan()
    model.compile(g_opt=keras.optimizers.Adam(1e-3), d_opt=keras.optimizers.Adam(1e-3))
    if d_out_kernel is not None:
        d_out = model.discriminator.get_layer("d_out")
        d_out.kernel.assign(np.full(d_out.kernel.shape, d_out_kernel, "float32"))
    real = gan_data(32)
    real[large_step * BATCH:(large_step + 1) * BATCH] *= factor
    run = jax_runs.fit(logdir, model, real, None, batch_size=BATCH, numerics_every=2)
    return model, [c["step"] for c in run.context["collectors"]["replay_capture"]["captures"]]


def test_plain_adam_gan_whose_weights_are_already_nan_is_refused(tmp_path):
    """The overflow came at step 1, not sampled: step 2 is captured with the
    NaN weights step 1's update wrote. No replay from them can run the step
    that went wrong (every layer would read NaN, in float32 too): refused,
    with what to do."""
    model, steps = _plain_adam_gan(tmp_path, large_step=1)
    assert steps[0] == 2
    capture = files.select_capture(str(tmp_path), "train", None)
    assert capture.manifest["weights_are_the_steps"] is True  # copied before step 2
    with pytest.raises(files.ReplayError, match="captured at step 2 are already non-finite") \
            as refused:
        mpprof.replay.replay(model, logdir=str(tmp_path), save=False)
    message = str(refused.value)
    # The layers' weights are named before the optimizers' slots.
    assert re.search(r"\(\d+ of 28 variables hold NaN or inf: generator/g_hidden/kernel, ",
                     message), message
    assert "adam/" not in message
    assert "an earlier step's update" in message
    assert "LossScaleOptimizer" in message and "numerics_every=1" in message


def test_plain_adam_gan_whose_overflow_is_sampled_replays(tmp_path):
    """The healthy look-alike: the same GAN and overflow, at step 2, which is
    sampled; its weights, copied before it ran, are finite: the replay names
    the discriminator's input cast and verifies the fix."""
    model, steps = _plain_adam_gan(tmp_path, large_step=2)
    assert steps[0] == 2
    result = mpprof.replay.replay(model, logdir=str(tmp_path), save=False)
    first = result["first_op"]
    assert first["layer"] == "discriminator" and first["op"] == "convert_element_type"
    assert first["phase"] == "forward" and first["dtype"] == "float16"
    assert result["float32_layers"] == ["discriminator"]
    assert result["verified"] is True, result["verified_detail"]


@pytest.mark.parametrize("factor", [3e3, 1.0])
def test_an_optimizer_update_gone_non_finite_is_never_the_culprit(tmp_path, factor):
    """The discriminator's kernel gradient overflows float16 in the
    backward pass (a real batch 3000 times larger, through d_out's kernel
    of -300: 4 rows * ~1500 * 37.5 > 65504); its Adam update turns that into
    inf weights, the first non-finite value of the forward phase (an update
    is not a transposed equation), and the generator's loss goes NaN on
    them. Were the update's equations judged, the first op would be its
    float32 `sub` (forward phases rank before backward ones); the culprit
    is the discriminator's backward dot_general. The same GAN on the usual
    batch (factor 1) overflows nowhere: nothing is captured."""
    model, steps = _plain_adam_gan(tmp_path, large_step=2, factor=factor, d_out_kernel=-300.0)
    if factor == 1.0:
        assert steps == []
        return
    assert steps[0] == 2
    result = mpprof.replay.replay(model, logdir=str(tmp_path), save=False)
    first = result["first_op"]
    assert first["layer"] == "discriminator/d_hidden" and first["op"] == "dot_general"
    assert first["phase"] == "backward" and first["dtype"] == "float16"
    assert first["input_abs_max"][0] == 37.5  # 300 * the logits' gradient, 1/8
    assert result["float32_layers"] == ["discriminator/d_hidden"]
    assert result["verified"] is True, result["verified_detail"]
