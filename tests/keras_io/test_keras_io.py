"""mpprof on keras-io examples (code nobody here wrote), Keras 3 on TensorFlow.

Each example is trained as published (shrunk, random data, `mixed_float16`,
CPU) and as users break it; each test asserts the exact findings, that
nothing else fires, and what the fix says. The JAX twin is
tests/jax/test_keras_io_jax.py.
"""

from __future__ import annotations

import os
import traceback
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers, ops
from keras_io_checks import BATCH
from keras_io_checks import codes as _codes
from keras_io_checks import only as _only
from keras_io_checks import policy as _policy
from keras_io_examples import (
    mnist_convnet,
    mnist_data,
    mnist_retrained_losses,
    text_data,
    text_transformer,
    vit_classifier,
    vit_data,
)

import mpprof
from mpprof import diagnosis
from mpprof.reader import read_logdir


def _fit(log_dir, model, x, y=None, steps=2, expect_error=False):
    """Fits `model` for `steps` steps at mpprof's defaults; returns the run and
    what fit raised (with the warnings it gave)."""
    profiler = mpprof.MixedPrecisionProfiler(log_dir=str(log_dir))
    raised = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=steps, verbose=0,
                      callbacks=[profiler])
        except Exception as error:
            if not expect_error:
                raise
            raised = error
    assert (raised is not None) == expect_error
    return read_logdir(str(log_dir))["train"], raised, caught


# ---------------------------------------------------------------------------
# MNIST convnet


@pytest.fixture(scope="module")
def mnist_runs(tmp_path_factory):
    runs = {}
    for name, head, raw in (("published", None, False), ("healthy", "float32", False),
                            ("raw_units", "float32", True)):
        _policy("mixed_float16")
        x, y = mnist_data(BATCH * 2, raw_units=raw)
        runs[name] = _fit(tmp_path_factory.mktemp(f"mnist_{name}"), mnist_convnet(head),
                          x, y)[0]
    keras.mixed_precision.set_dtype_policy("float32")
    return runs


def test_mnist_healthy_has_only_the_cpu_finding(mnist_runs):
    run = mnist_runs["healthy"]
    assert _codes(run) == {"MP011"}  # mixed_float16 on a CPU: slower there
    # Short fits are not blind: the defaults sampled steps 1 (and 10, 100 later).
    assert list(run.numerics.steps) == [1]
    # A projection for a GPU: the 1 grayscale channel and the 10-class head
    # are the data's and the task's; the 32/64 filters are multiples of 8.
    checked = diagnosis.evaluate(run, assume_gpu=True)
    assert {f.code for f in checked.findings} == {"MP011"}
    notes = {c.code: c for c in diagnosis.evaluate(run).checks}
    assert notes["MP007"].status == "not applicable"
    assert "no GPU" in notes["MP007"].reason


def test_mnist_published_float16_head_is_mp006(mnist_runs):
    run = mnist_runs["published"]
    assert _codes(run) == {"MP006", "MP011"}
    finding = _only(run, "MP006")
    assert finding.layer == "dense"
    assert finding.evidence["loss_input_dtypes"] == ["float16"]
    assert 'keras.layers.Dense(..., dtype="float32")' in finding.fix


def test_mnist_raw_units_names_the_first_conv_only(mnist_runs):
    """Pixels in 0..65535 (past float16's 65504): conv2d's input cast is inf.
    One cause, one finding: the layers after it (max pooling, weightless)
    are its evidence, not MP004 findings."""
    run = mnist_runs["raw_units"]
    codes = _codes(run)
    assert "MP003" in codes and "MP004" not in codes
    assert codes <= {"MP003", "MP002", "MP011", "MP019", "MP013"}
    mp003 = _only(run, "MP003")
    assert mp003.layer == "conv2d"
    assert mp003.step == 1  # sampled at the defaults


# ---------------------------------------------------------------------------
# Text classification with a Transformer


@pytest.fixture(scope="module")
def text_runs(tmp_path_factory):
    runs = {}
    for name, head in (("published", None), ("healthy", "float32")):
        _policy("mixed_float16")
        x, y = text_data(BATCH * 2)
        runs[name] = _fit(tmp_path_factory.mktemp(f"text_{name}"), text_transformer(head),
                          x, y)[0]
    keras.mixed_precision.set_dtype_policy("float32")
    return runs


def test_text_transformer_findings(text_runs):
    assert _codes(text_runs["healthy"]) == {"MP011"}
    assert _codes(text_runs["published"]) == {"MP006", "MP011"}
    # Projected on a GPU: the binary head (2 units) is the task's; the
    # Dense(20) is a small share of the GEMM work; nothing to round.
    for run in text_runs.values():
        assert "MP007" not in _codes(run, assume_gpu=True)


# ---------------------------------------------------------------------------
# Vision Transformer with a top-5 accuracy metric


@pytest.fixture(scope="module")
def vit_runs(tmp_path_factory):
    runs = {}
    for name, head in (("published", None), ("healthy", "float32")):
        _policy("mixed_float16")
        x, y = vit_data(BATCH * 2)
        runs[name] = _fit(tmp_path_factory.mktemp(f"vit_{name}"), vit_classifier(True, head),
                          x, y, steps=2, expect_error=head is None)
    keras.mixed_precision.set_dtype_policy("float32")
    return runs


def test_vit_top5_metric_failure_is_diagnosed(vit_runs):
    run, raised, caught = vit_runs["published"]
    finding = _only(run, "MP020")
    assert finding.step == 0
    assert finding.evidence["type"] == type(raised).__name__
    assert finding.evidence["kind"] == "no_half_kernel"
    assert "InTopK" in finding.evidence["op"]
    assert 'keras.layers.Dense(..., dtype="float32")' in finding.fix
    assert "numerics_every" not in finding.fix
    # Nothing else (the step never completed: no inventory for MP006, whose
    # fix MP020's is); the numerics rules say once that the fit raised.
    assert _codes(run) == {"MP020", "MP011"}
    text = diagnosis.format_text(run, diagnosis.evaluate(run))
    assert text.count("not measured") == text.count("not measured:") >= 1
    assert "lower numerics_every" not in text
    numerics = [line for line in text.splitlines() if "before its first sample" in line]
    assert len(numerics) == 1 and "MP003, MP004, MP005, MP019" in numerics[0]
    # No warning that contradicts the failed fit.
    assert not [w for w in caught if "training goes on" in str(w.message)]
    # The user's traceback as Keras shows it: no mpprof frame.
    frames = [f.filename for f in traceback.extract_tb(raised.__traceback__)]
    assert not [f for f in frames if "/mpprof/" in f], frames


def test_vit_with_a_float32_head_trains(vit_runs):
    run, _, _ = vit_runs["healthy"]
    assert _codes(run) == {"MP011"}


# ---------------------------------------------------------------------------
# examples/generative/vae.py (fchollet), its Keras 3 version as published:
# Sampling with keras.random and ops, a custom train_step with
# tf.GradientTape (the example runs on TensorFlow). Under mixed_float16 its
# `ops.exp(0.5 * z_log_var) * epsilon` multiplies a float16 tf.Tensor by a
# float32 one: with Keras 3.15 TensorFlow raises already as the functional
# encoder is built (before any fit, so mpprof never sees it); the tests use
# the cast that fixes it, and the dtype mix inside fit is tried below on a
# noise layer that only draws in training.


class Sampling(layers.Layer):
    """Uses (z_mean, z_log_var) to sample z, the vector encoding a digit."""

    def __init__(self, cast=False, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)
        self.cast = cast  # the fix MP020 names; False: as published

    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch = ops.shape(z_mean)[0]
        dim = ops.shape(z_mean)[1]
        epsilon = keras.random.normal(shape=(batch, dim), seed=self.seed_generator)
        if self.cast:
            epsilon = keras.ops.cast(epsilon, self.compute_dtype)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


def _vae_parts(cast):
    latent_dim = 2
    encoder_inputs = keras.Input(shape=(28, 28, 1))
    x = layers.Conv2D(32, 3, activation="relu", strides=2, padding="same")(encoder_inputs)
    x = layers.Conv2D(64, 3, activation="relu", strides=2, padding="same")(x)
    x = layers.Flatten()(x)
    x = layers.Dense(16, activation="relu")(x)
    z_mean = layers.Dense(latent_dim, name="z_mean")(x)
    z_log_var = layers.Dense(latent_dim, name="z_log_var")(x)
    z = Sampling(cast=cast)([z_mean, z_log_var])
    encoder = keras.Model(encoder_inputs, [z_mean, z_log_var, z], name="encoder")
    latent_inputs = keras.Input(shape=(latent_dim,))
    x = layers.Dense(7 * 7 * 64, activation="relu")(latent_inputs)
    x = layers.Reshape((7, 7, 64))(x)
    x = layers.Conv2DTranspose(64, 3, activation="relu", strides=2, padding="same")(x)
    x = layers.Conv2DTranspose(32, 3, activation="relu", strides=2, padding="same")(x)
    decoder_outputs = layers.Conv2DTranspose(1, 3, activation="sigmoid", padding="same")(x)
    decoder = keras.Model(latent_inputs, decoder_outputs, name="decoder")
    return encoder, decoder


class VAE(keras.Model):
    def __init__(self, encoder, decoder, scale_loss=False, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.scale = scale_loss  # MP018's fix; False: as published
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker,
                self.kl_loss_tracker]

    def train_step(self, data):
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = ops.mean(
                ops.sum(
                    keras.losses.binary_crossentropy(data, reconstruction),
                    axis=(1, 2),
                )
            )
            kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
            kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
            scaled = self.optimizer.scale_loss(total_loss) if self.scale else total_loss
        grads = tape.gradient(scaled, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights, strict=True))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {
            "loss": self.total_loss_tracker.result(),
            "reconstruction_loss": self.reconstruction_loss_tracker.result(),
            "kl_loss": self.kl_loss_tracker.result(),
        }

    def call(self, x):
        z_mean, z_log_var, z = self.encoder(x)
        return self.decoder(z)


@pytest.fixture(scope="module")
def vae_runs(tmp_path_factory):
    runs = {}
    for name, cast, scale in (("no_scale_loss", True, False), ("healthy", True, True)):
        _policy("mixed_float16")
        x = mnist_data(BATCH * 2)[0]
        vae = VAE(*_vae_parts(cast), scale_loss=scale)
        vae.compile(optimizer=keras.optimizers.Adam())
        runs[name] = _fit(tmp_path_factory.mktemp(f"vae_{name}"), vae, x, steps=2)
    keras.mixed_precision.set_dtype_policy("float32")
    return runs


class TrainingNoise(layers.Layer):
    """The VAE's sampling pattern in a layer that only draws in training (as
    GaussianNoise does): float32 noise times float16 activations reaches
    TensorFlow only once fit traces the step."""

    def call(self, x, training=False):
        if training:
            epsilon = keras.random.normal(ops.shape(x))
            return x + ops.exp(0.5 * x) * epsilon
        return x


def test_a_float32_float16_mix_in_fit_is_diagnosed(tmp_path):
    _policy("mixed_float16")
    x, y = mnist_data(BATCH * 2)
    model = keras.Sequential([keras.Input((28, 28, 1)), layers.Flatten(),
                              layers.Dense(16), TrainingNoise(),
                              layers.Dense(10, activation="softmax", dtype="float32")])
    model.compile(loss="categorical_crossentropy", optimizer="adam")
    run, raised, caught = _fit(tmp_path, model, x, y, steps=2, expect_error=True)
    finding = _only(run, "MP020")
    assert finding.evidence["kind"] == "mixed_floats"
    assert "keras.ops.cast(x, self.compute_dtype)" in finding.fix
    assert finding.step == 0
    assert _codes(run) == {"MP020", "MP011"}
    assert not [w for w in caught if "training goes on" in str(w.message)]
    frames = [f.filename for f in traceback.extract_tb(raised.__traceback__)]
    assert not [f for f in frames if "/mpprof/" in f], frames
    # Keras' own switch shows every frame again, mpprof's too.
    keras.config.disable_traceback_filtering()
    try:
        with pytest.raises(TypeError) as shown:
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
                      callbacks=[mpprof.MixedPrecisionProfiler(str(tmp_path / "again"))])
    finally:
        keras.config.enable_traceback_filtering()
    frames = [f.filename for f in traceback.extract_tb(shown.value.__traceback__)]
    assert [f for f in frames if "/mpprof/" in f]


def test_vae_without_scale_loss_is_mp018_for_adam_on_tensorflow(vae_runs):
    run = vae_runs["no_scale_loss"][0]
    finding = _only(run, "MP018")
    assert finding.evidence["update_effect"] == "adaptive"
    assert "1.7x" in finding.fix and "too small" not in finding.fix
    assert "tf.GradientTape" in finding.fix and "scale_loss(loss)" in finding.fix
    assert "stateless_apply" not in finding.fix
    # The loss is computed in the train_step itself: MP006 cannot see it.
    notes = {c.code: c for c in diagnosis.evaluate(run).checks}
    assert notes["MP006"].status == "not measured"
    assert "compute_loss" in notes["MP006"].reason
    assert _codes(run) == {"MP018", "MP011"}


def test_vae_with_scale_loss_is_healthy(vae_runs):
    run = vae_runs["healthy"][0]
    assert _codes(run) == {"MP011"}
    # Projected on a GPU: the decoder's 1-channel output is the task's, the
    # latent Dense layers a tiny share of the GEMM work.
    assert "MP007" not in _codes(run, assume_gpu=True)


def test_headroom_of_a_layer_without_weights_points_upstream(tmp_path):
    """MP004 on a weightless layer (here a Rescaling that multiplies its input)
    names the layer with weights that feeds it, never "growth of its weights"."""
    _policy("mixed_float16")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(BATCH * 2, 16)).astype("float32"), rng.integers(0, 10, BATCH * 2)
    model = keras.Sequential([keras.Input((16,)), layers.Dense(16, name="dense"),
                              layers.Rescaling(2000.0, name="rescaling"),
                              layers.Dense(10, dtype="float32", name="head")])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer="adam")
    run = _fit(tmp_path, model, x, y)[0]
    assert _codes(run) == {"MP004", "MP011"}
    finding = _only(run, "MP004")
    assert finding.layer == "rescaling"
    assert finding.evidence["weightless"] is True and finding.evidence["values_from"] == "dense"
    assert "growth of its weights" not in finding.fix
    assert "keras.layers.Dense(..., dtype=\"float32\")" in finding.fix


def _replayed_fixes(run, capsys) -> dict:
    """`mpprof replay --format json` of the run's captured step: its fixes by kind."""
    import json

    from mpprof import cli

    capsys.readouterr()
    assert cli.main(["replay", os.path.dirname(run.path), "--format", "json"]) == 0
    result = json.loads(capsys.readouterr().out)
    result = result[0] if isinstance(result, list) else result
    assert result["lead_fix"] == "bound_inputs" and result["verified"] is True
    return {fix["kind"]: fix for fix in result["fixes"]}


def _retrains_like_float32(scale, first_conv_dtype=None):
    """The fix applied and retrained (mixed_float16) against the same model in
    float32 on the same batches, judged by the band verification states (at
    least TRIAL_MIN_PROGRESS of float32's loss decrease, mean loss within
    TRIAL_MEAN_BAND) with its own function."""
    from mpprof.replay import verification

    x, y = mnist_data(BATCH * 2, raw_units=True)
    fixed = mnist_retrained_losses("mixed_float16", scale, x, y, BATCH,
                                   first_conv_dtype=first_conv_dtype)
    reference = mnist_retrained_losses("float32", scale, x, y, BATCH)
    assert np.isfinite(fixed).all()
    return verification.judge_trial(fixed, reference)


def test_mnist_raw_units_verified_fix_retrains_like_float32(mnist_runs, capsys):
    """`mpprof replay` on the captured step: the lead fix is bounding the
    inputs (the first op to overflow is the input's cast), verified; applied
    and retrained, it trains like float32."""
    lead = _replayed_fixes(mnist_runs["raw_units"], capsys)["bound_inputs"]
    assert lead["verified"] is True and lead["scale_text"] == "1 / 65535"
    assert any("Rescaling(1 / 65535" in line for line in lead["code"])
    trial = _retrains_like_float32(lead["scale"])
    assert trial.passed, trial.reason


def test_mnist_raw_units_float32_map_is_not_verified_and_does_not_retrain(mnist_runs, capsys):
    """The alternative fix, a float32 conv2d, ends the input cast's overflow
    but leaves the float16 layers after it at raw-unit magnitudes (~3e4,
    under 2x below 65504): "not verified", by the headroom every
    half-precision output must keep (MP004's 16x), with the layer and the
    numbers. The verdict is the retrain's: applied and retrained from the
    start, the map does not train like float32 (its loss scale halves from
    2**15 to 8 before a step applies; its trial from the captured weights,
    which does not count those skips, tracked float32 and once made it
    "verified")."""
    fix = _replayed_fixes(mnist_runs["raw_units"], capsys)["float32_layers"]
    assert fix["float32_layers"] == ["conv2d"]
    assert fix["verified"] is False
    check = fix["verification"]["step"][0]
    assert check["overflow"] is None and check["failed"] == "headroom"
    room = check["headroom"]
    assert room["dtype"] == "float16" and 1 < room["factor"] < 16
    assert room["layer"] != "conv2d"  # computed in float32 by the map
    assert fix["verified_detail"].startswith(
        f"not verified: the output of layer {room['layer']} reaches {room['abs_max']:.3g} in "
        f"float16, only {room['factor']:.3g}x under its max 65504 (at least 16x required")
    trial = _retrains_like_float32(1.0, first_conv_dtype="float32")
    assert not trial.passed, trial.reason
