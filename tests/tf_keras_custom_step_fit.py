"""Profiled tf-keras fits with custom train steps, run as a script; prints one JSON line.

    python tests/tf_keras_custom_step_fit.py LOGDIR

Each fit writes into LOGDIR/NAME; the JSON line maps NAME to what the probe
saw and what the reader found:

    gan         a GAN whose step applies its own LossScaleOptimizers, d_opt
                (new Adam; get_scaled_loss, get_unscaled_gradients,
                apply_gradients) and g_opt (legacy Adam; minimize), while
                `compile()` made an unused default optimizer
    spare       a compiled LossScaleOptimizer with tf-keras's own train step,
                and an unused LossScaleOptimizer held in a model attribute
    scaled_nan  a custom step through get_scaled_loss, NaN target at step 5
                of each epoch
    raw_nan     as scaled_nan, but the gradients are taken of the raw loss:
                the loss never reaches the optimizer

A probe callback reads every optimizer's loss scale, counter and iterations
after every batch on the host: the ground truth the records are compared with.
"""

import json
import os
import sys

os.environ["TF_USE_LEGACY_KERAS"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
import tf_keras

import mpprof
from mpprof import diagnosis
from mpprof.records import reader

EPOCHS = 2
BATCH = 8
SAMPLES = 64
LSO = tf_keras.mixed_precision.LossScaleOptimizer
layers = tf_keras.layers


class Probe(tf_keras.callbacks.Callback):
    """Each named optimizer's scale, counter and iterations after every batch."""

    def __init__(self, names):
        super().__init__()
        self.seen = {name: {"scales": [], "counters": [], "iterations": []} for name in names}

    def on_train_batch_end(self, batch, logs=None):
        for name, seen in self.seen.items():
            optimizer = getattr(self.model, name)
            seen["scales"].append(float(optimizer.loss_scale.numpy()))
            seen["counters"].append(int(optimizer.dynamic_counter.numpy()))
            seen["iterations"].append(int(optimizer.iterations.numpy()))

    def skipped(self, name, initial_scale):
        """Steps `name` skipped: its counter reset without the scale growing."""
        seen = self.seen[name]
        before = [initial_scale] + seen["scales"][:-1]
        return [step for step, (b, a, c) in enumerate(zip(before, seen["scales"],
                                                          seen["counters"], strict=True))
                if c == 0 and a <= b]


class Gan(tf_keras.Model):
    def __init__(self):
        super().__init__()
        self.gen = tf_keras.Sequential([layers.Input((4,)), layers.Dense(16, activation="relu"),
                                        layers.Dense(8, dtype="float32")], name="gen")
        self.disc = tf_keras.Sequential([layers.Input((8,)), layers.Dense(16, activation="relu"),
                                         layers.Dense(1, dtype="float32")], name="disc")
        self.bce = tf_keras.losses.BinaryCrossentropy(from_logits=True)

    def compile(self, g_opt, d_opt):
        super().compile()  # an unused default optimizer
        self.g_opt, self.d_opt = g_opt, d_opt

    def call(self, z):
        return self.disc(self.gen(z))

    def train_step(self, real):
        n = tf.shape(real)[0]
        z = tf.random.stateless_normal((n, 4), seed=(1, 2))
        ones, zeros = tf.ones((n, 1)), tf.zeros((n, 1))
        with tf.GradientTape() as tape:
            fake = self.gen(z, training=True)
            d_loss = (self.bce(ones, self.disc(real, training=True))
                      + self.bce(zeros, self.disc(fake, training=True)))
            scaled = self.d_opt.get_scaled_loss(d_loss)
        grads = self.d_opt.get_unscaled_gradients(
            tape.gradient(scaled, self.disc.trainable_variables))
        self.d_opt.apply_gradients(zip(grads, self.disc.trainable_variables, strict=True))
        with tf.GradientTape() as tape:
            g_loss = self.bce(ones, self.disc(self.gen(z, training=True), training=True))
        self.g_opt.minimize(g_loss, self.gen.trainable_variables, tape=tape)
        return {"d_loss": d_loss, "g_loss": g_loss}


class CustomStep(tf_keras.Model):
    """Takes its own gradients; `scaled` says whether it scales the loss."""

    scaled = True

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compiled_loss(y, self(x, training=True))
            if self.scaled:
                scaled = self.optimizer.get_scaled_loss(loss)
        if self.scaled:
            grads = self.optimizer.get_unscaled_gradients(
                tape.gradient(scaled, self.trainable_variables))
        else:
            grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        return {"loss": loss}


def dense_net(cls=tf_keras.Model):
    inputs = layers.Input((8,))
    hidden = layers.Dense(16, activation="relu", name="dense")(inputs)
    return cls(inputs, layers.Dense(1, dtype="float32", name="dense_1")(hidden))


def fit(name, logdir):
    """Fits `name`'s model; returns its optimizers' initial scales, the probe,
    the model and the fit's data."""
    tf_keras.utils.set_random_seed(0)
    tf_keras.mixed_precision.set_global_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.random((SAMPLES, 8), dtype=np.float32)
    y = rng.random((SAMPLES, 1), dtype=np.float32)
    if name == "gan":
        model = Gan()
        initial = {"d_opt": 2.0**20, "g_opt": 2.0**18}
        model.compile(
            g_opt=LSO(tf_keras.optimizers.legacy.Adam(1e-3), initial_scale=initial["g_opt"],
                      dynamic_growth_steps=3),
            d_opt=LSO(tf_keras.optimizers.Adam(1e-3), initial_scale=initial["d_opt"],
                      dynamic_growth_steps=2))
        data = {"x": x}
    elif name == "spare":
        model = dense_net()
        model.spare = LSO(tf_keras.optimizers.SGD(0.01), initial_scale=2.0**4)
        initial = {"optimizer": 2.0**30}
        model.compile(optimizer=LSO(tf_keras.optimizers.SGD(1e-6), initial_scale=2.0**30,
                                    dynamic_growth_steps=2), loss="mse")
        data = {"x": x, "y": y * 1000}
    else:
        model = dense_net(CustomStep)
        model.scaled = name == "scaled_nan"
        initial = {"optimizer": 2.0**15}
        model.compile(optimizer=LSO(tf_keras.optimizers.SGD(0.01)), loss="mse")
        y[5 * BATCH] = np.nan  # step 5 of each epoch
        data = {"x": x, "y": y}
    probe = Probe(initial)
    profiler = mpprof.MixedPrecisionProfiler(logdir, numerics_every=2, gpu_interval=None)
    model.fit(**data, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=[profiler, probe])
    return initial, probe, model


def describe(name, logdir):
    initial, probe, model = fit(name, logdir)
    run = reader.read_run(logdir, "train")
    series = {}
    for series_name, loss_scale in (run.loss_scales or {}).items():
        series[series_name] = {
            "steps_run": loss_scale.steps_run,
            "overflow_steps": loss_scale.overflow_steps.tolist(),
            "scale_after": loss_scale.scale_after(np.arange(loss_scale.steps_run)).tolist(),
            "final_scale": loss_scale.final_scale,
        }
    checks = {c.code: c.status for c in diagnosis.evaluate(run).checks}
    return {
        "steps": EPOCHS * SAMPLES // BATCH,
        "probe": {opt: {**seen, "skipped": probe.skipped(opt, initial[opt])}
                  for opt, seen in probe.seen.items()},
        "optimizers": run.context["optimizers"],
        "loss_scale": run.context["collectors"]["loss_scale"],
        "primary_is_plain": run.loss_scales.get(
            run.context["collectors"]["loss_scale"].get("primary")) is run.loss_scale,
        "series": series,
        "health": run.health,
        "numerics_steps": None if run.numerics is None else run.numerics.steps.tolist(),
        "findings": [f.to_dict() for f in diagnosis.diagnose(run)],
        "checks": {code: checks[code] for code in ("MP012", "MP018")},
        "warnings": run.warnings,
        "patched_after_fit": sorted(
            {opt for opt in initial for method in
             ("apply_gradients", "minimize", "get_scaled_loss")
             if method in vars(getattr(model, opt))}),
    }


if __name__ == "__main__":
    root = sys.argv[1]
    names = ["gan", "spare", "scaled_nan", "raw_nan"]
    print(json.dumps({name: describe(name, os.path.join(root, name)) for name in names}))
