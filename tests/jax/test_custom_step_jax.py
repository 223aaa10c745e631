"""Models with their own `train_step` on JAX: per-layer numerics on sampled
steps (host callbacks, `mpprof.backends.jax.numerics_callbacks`), the loss
watched through the step's loss metrics, a GAN's two optimizers recorded;
each finding with a healthy look-alike, weights bit-identical to a fit
without the profiler."""

from __future__ import annotations

import jax_runs
import keras
import numpy as np
from custom_step_models import CustomStepRegressor, Gan, gan_data

from mpprof import diagnosis

BATCH = 4


def _regressor(kernel="glorot_uniform"):
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = CustomStepRegressor(kernel=kernel)
    model.compile(optimizer="adam")
    return model


def _gan(g_kernel="glorot_uniform"):
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = Gan(g_kernel=g_kernel)
    model.compile(g_opt=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3)),
                  d_opt=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3)))
    return model


def _data(samples=16):
    rng = np.random.default_rng(0)
    return rng.random((samples, 8), dtype=np.float32), rng.random((samples, 1),
                                                                  dtype=np.float32)


def _found(run, code):
    return [f for f in diagnosis.diagnose(run) if f.code == code]


def _column(numerics, table, name, stat):
    names = numerics.layers if table in ("forward", "backward") else numerics.variables
    return getattr(numerics, table)[stat][:, names.index(name)]


def test_custom_step_overflow_names_the_layer(tmp_path):
    x, y = np.ones((16, 8), np.float32), np.ones((16, 1), np.float32)
    run = jax_runs.fit(tmp_path, _regressor(keras.initializers.Constant(300.0)), x, y,
                       batch_size=BATCH, numerics_every=1)
    found = _found(run, "MP003")
    assert found and found[0].layer == "second" and found[0].step == 0  # step 0's kept batch
    assert run.context["collectors"]["numerics"]["state"] == "ok"
    # first: 8 ones * 300 = 2400, in range; second: 2400 * 300 * 16 overflows.
    numerics = run.numerics
    np.testing.assert_array_equal(_column(numerics, "forward", "first", "abs_max"), 2400.0)
    assert (_column(numerics, "forward", "second", "nonfinite_frac") == 1).all()
    # Its loss is infinite on every step: watched through its loss metric.
    assert run.health["loss_watched"]
    assert run.health["first_nonfinite_loss_step"] == 0
    assert run.health["nonfinite_loss_steps"] == len(x) // BATCH


def test_healthy_custom_step_has_no_overflow_and_measured_gradients(tmp_path):
    x, y = _data()
    run = jax_runs.fit(tmp_path, _regressor(), x, y, batch_size=BATCH, numerics_every=1)
    assert not _found(run, "MP003") and not _found(run, "MP012")
    assert run.health["loss_watched"] and run.health["nonfinite_loss_steps"] == 0
    numerics = run.numerics
    np.testing.assert_array_equal(numerics.steps, [1, 2, 3])  # the first call runs plain
    # Counts by hand: one call of each layer per step, on a batch of 4.
    for layer, width in (("first", 16), ("second", 16), ("head", 1)):
        np.testing.assert_array_equal(_column(numerics, "forward", layer, "count"),
                                      BATCH * width)
        np.testing.assert_array_equal(_column(numerics, "backward", layer, "count"),
                                      BATCH * width)
    kernel = next(v for v in numerics.variables if "second" in v and "kernel" in v)
    np.testing.assert_array_equal(_column(numerics, "variable_grads", kernel, "count"), 256)
    # Scaled by the loss scale (2**15) before the optimizer unscales them.
    scaled = _column(numerics, "variable_grads", kernel, "abs_max")
    unscaled = _column(numerics, "unscaled_variable_grads", kernel, "abs_max")
    assert (unscaled > 0).all()
    np.testing.assert_allclose(scaled / unscaled, run.context["collectors"]["loss_scale"][
        "initial_scale"], rtol=1e-3)


def test_custom_step_weights_bit_identical_to_an_unprofiled_fit(tmp_path):
    x, y = _data()
    plain = _regressor()
    plain.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False)
    profiled = _regressor()
    jax_runs.fit(tmp_path, profiled, x, y, batch_size=BATCH, epochs=2, numerics_every=1)
    for a, b in zip(plain.weights, profiled.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value))
    assert "update_state" not in vars(profiled.loss_tracker)  # left as found


def test_gan_records_both_optimizers_and_each_layer(tmp_path):
    run = jax_runs.fit(tmp_path, _gan(), gan_data(), None, batch_size=BATCH,
                       numerics_every=1)
    used = {o["name"]: o for o in run.context["optimizers"]}
    assert set(used) == {"d_opt", "g_opt"}  # model.optimizer: never applied
    assert all(o["apply_called"] and o["loss_scale"] for o in used.values())
    loss_scale = run.context["collectors"]["loss_scale"]
    # Each followed through its stateless_apply (tests/jax/test_gan_loss_scales_jax.py).
    assert loss_scale["state"] == "ok" and set(loss_scale["series"]) == {"d_opt", "g_opt"}
    assert run.health["loss_watched"] and run.health["nonfinite_loss_steps"] == 0
    assert not _found(run, "MP003") and not _found(run, "MP008")
    numerics = run.numerics
    np.testing.assert_array_equal(numerics.steps, [1, 2, 3])
    forward = {layer: _column(numerics, "forward", layer, "count")
               for layer in numerics.layers}
    backward = {layer: _column(numerics, "backward", layer, "count")
                for layer in numerics.layers}
    # g_out runs in both steps (4 x 6 each), differentiated in the
    # generator's only; d_hidden sees 8 samples, then 4, both differentiated.
    np.testing.assert_array_equal(forward["generator/g_out"], 2 * BATCH * 6)
    np.testing.assert_array_equal(backward["generator/g_out"], BATCH * 6)
    np.testing.assert_array_equal(forward["discriminator/d_hidden"], 3 * BATCH * 8)
    np.testing.assert_array_equal(backward["discriminator/d_hidden"], 3 * BATCH * 8)
    # Both optimizers' gradients, as each step handed them over.
    for variable, size in (("g_hidden/kernel", 4 * 8), ("d_hidden/kernel", 6 * 8)):
        name = next(v for v in numerics.variables if v.endswith(variable))
        np.testing.assert_array_equal(_column(numerics, "variable_grads", name, "count"),
                                      size)


def test_gan_generator_overflow_names_its_layer(tmp_path):
    run = jax_runs.fit(tmp_path, _gan(keras.initializers.Constant(300.0)), gan_data(), None,
                       batch_size=BATCH, numerics_every=1)
    found = _found(run, "MP003")
    # Step 0 (traced by the first call, run plain) overflowed: sampled from
    # its kept batch by the next call.
    assert found and found[0].layer == "generator/g_out" and found[0].step == 0
    # Its non-finite loss came on steps d_opt skipped: judged, and excused.
    assert run.health["loss_watched"] and run.health["nonfinite_loss_steps"] > 0
    assert not _found(run, "MP012")


def test_gan_weights_bit_identical_to_an_unprofiled_fit(tmp_path):
    plain = _gan()
    plain.fit(gan_data(), batch_size=BATCH, epochs=2, verbose=0, shuffle=False)
    profiled = _gan()
    jax_runs.fit(tmp_path, profiled, gan_data(), None, batch_size=BATCH, epochs=2,
                 numerics_every=1)
    for a, b in zip(plain.weights, profiled.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value))
    # The optimizers' own state moved the same way (fit carries it).
    assert int(np.asarray(profiled.d_opt.iterations.value)) == 8
