"""The real-model suite on TensorFlow: one short mixed_float16 fit per
architecture family a user brings, each profiled with numerics on every step.

The families both backends run are defined once, in model_families.py
(tests/jax/test_model_families_jax.py runs them on JAX); this module adds
those whose code is TensorFlow's own: custom `train_step`s with
`tf.GradientTape`, a GAN, a `tf.data` pipeline.

Each test checks that fit completes, that the recorded inventory matches the
model's own layers (names, classes, policies, compute/variable dtypes), that
numerics samples were recorded for the layers they should be (and exactly
the recurrent cells listed as skipped), and that `mpprof diagnose --format
json` reads the run. Models and data are tiny: 2-6 steps each.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from model_families import FAMILIES, dropout_regressor
from model_suite import check_model, fit_profiled, run_family


@pytest.fixture(autouse=True)
def _mixed_float16():
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_dtype_policy("mixed_float16")


def _rng():
    return np.random.default_rng(0)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family(tmp_path, capsys, name):
    run_family(FAMILIES[name](), tmp_path, capsys)


class CustomStepModel(keras.Model):
    """A keras.io-style custom `train_step` using `self.optimizer`."""

    def __init__(self, scale_loss: bool, **kwargs):
        super().__init__(**kwargs)
        self.use_scale_loss = scale_loss
        self.hidden = keras.layers.Dense(8, activation="relu", name="hidden")
        self.head = keras.layers.Dense(1, dtype="float32", name="head")

    def call(self, x):
        return self.head(self.hidden(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(self(x, training=True) - y))
            scaled = self.optimizer.scale_loss(loss) if self.use_scale_loss else loss
        gradients = tape.gradient(scaled, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        return {"loss": loss}


@pytest.mark.parametrize("scale_loss", [True, False], ids=["scale_loss", "no_scale_loss"])
def test_custom_train_step(tmp_path, capsys, scale_loss):
    model = CustomStepModel(scale_loss)
    model.compile(optimizer="adam")
    rng = _rng()
    run = fit_profiled(model, rng.random((8, 6)), rng.random((8, 1)), logdir=tmp_path,
                       batch_size=2)
    check_model(run, model, tmp_path, capsys)


class Gan(keras.Model):
    """A keras.io-style GAN: its own two optimizers, `model.optimizer` unused."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # Keras 3's way to draw in a step (as its GAN example does): the
        # state is a variable, so the profiler's sampled steps share it.
        self.seeds = keras.random.SeedGenerator(1)
        self.generator = keras.Sequential([
            keras.layers.Input((4,)),
            keras.layers.Dense(8, activation="relu", name="g_hidden"),
            keras.layers.Dense(6, name="g_out"),
        ], name="generator")
        self.discriminator = keras.Sequential([
            keras.layers.Input((6,)),
            keras.layers.Dense(8, activation="relu", name="d_hidden"),
            keras.layers.Dense(1, dtype="float32", name="d_out"),
        ], name="discriminator")

    def compile(self, g_opt, d_opt):
        super().compile()
        self.g_opt, self.d_opt = g_opt, d_opt
        self.bce = keras.losses.BinaryCrossentropy(from_logits=True)

    def call(self, noise):
        return self.discriminator(self.generator(noise))

    def train_step(self, real):
        batch = tf.shape(real)[0]
        noise = keras.random.normal((batch, 4), seed=self.seeds)
        with tf.GradientTape() as tape:
            fake = self.generator(noise)
            logits = self.discriminator(tf.concat([real, tf.cast(fake, real.dtype)], 0))
            labels = tf.concat([tf.ones((batch, 1)), tf.zeros((batch, 1))], 0)
            d_loss = self.bce(labels, logits)
            scaled = self.d_opt.scale_loss(d_loss)
        weights = self.discriminator.trainable_weights
        self.d_opt.apply(tape.gradient(scaled, weights), weights)
        with tf.GradientTape() as tape:
            g_loss = self.bce(tf.ones((batch, 1)), self(noise))
            scaled = self.g_opt.scale_loss(g_loss)
        weights = self.generator.trainable_weights
        self.g_opt.apply(tape.gradient(scaled, weights), weights)
        return {"d_loss": d_loss, "g_loss": g_loss}


def test_gan_with_two_loss_scale_optimizers(tmp_path, capsys):
    model = Gan()
    model.compile(
        g_opt=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3)),
        d_opt=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3)),
    )
    real = _rng().random((8, 6)).astype("float32")
    run = fit_profiled(model, real, logdir=tmp_path, batch_size=2)
    check_model(run, model, tmp_path, capsys)
    assert not model.optimizer.built  # the case: model.optimizer is never used


def test_tf_data_with_sample_weight_and_validation(tmp_path, capsys):
    model, (x, y, weights) = dropout_regressor()
    train = tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(2)
    validation = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    run = fit_profiled(model, train, logdir=tmp_path, validation_data=validation)
    check_model(run, model, tmp_path, capsys)
    assert model.history.history["val_loss"]
