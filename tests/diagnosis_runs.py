"""Small real training runs on CPU, each made to show (or not show) findings.

`logdir(name)` trains the run `name` once per test session and returns its
log_dir; the diagnosis, CLI and report tests share them. Each builder says
which finding it must trigger and why it does.
"""

from __future__ import annotations

import atexit
import copy
import functools
import pathlib
import shutil
import tempfile

import keras
import numpy as np
import tensorflow as tf

import mpprof
from mpprof.records import reader, schema
from mpprof.records.writer import RecordWriter

HOSTILE_NAME = "<img src=x onerror=alert(1)>"
HOSTILE_RUN = "<svg onload=alert(2)>"

_ROOT = pathlib.Path(tempfile.mkdtemp(prefix="mpprof-diagnosis-runs-"))
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)


@functools.cache
def logdir(name: str) -> pathlib.Path:
    """The log_dir of run `name` (one of `BUILDERS`), trained on first use."""
    path = _ROOT / name
    try:
        BUILDERS[name](str(path))
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    return path


def read(name: str) -> reader.Run:
    run = HOSTILE_RUN if name == "hostile" else "train"
    return reader.read_run(logdir(name), run)


def _fit(log_dir, model, x, y, *, batch_size=8, epochs=1, probes=(), **profiler):
    profiler.setdefault("gpu_interval", None)  # no sampler thread on CPU
    model.fit(
        x,
        y,
        batch_size=batch_size,
        epochs=epochs,
        verbose=0,
        shuffle=False,
        callbacks=[mpprof.MixedPrecisionProfiler(log_dir=log_dir, **profiler), *probes],
    )


def _classifier(
    policy: str,
    hidden: int = 64,
    inputs: int = 32,
    last_dtype="float32",
    hidden_name=None,
    **compile_kwargs,
) -> keras.Model:
    keras.mixed_precision.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.layers.Input((inputs,)),
            keras.layers.Dense(hidden, activation="relu", name=hidden_name),
            keras.layers.Dense(8, dtype=last_dtype, name="logits"),
        ]
    )
    compile_kwargs.setdefault("optimizer", "adam")
    model.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **compile_kwargs,
    )
    return model


def _classes(samples=64, inputs=32):
    rng = np.random.default_rng(0)
    return rng.random((samples, inputs), dtype=np.float32), rng.integers(0, 8, samples)


def _regression(
    kernel=None,
    head=None,
    *,
    initial_scale=2.0**15,
    learning_rate=0.0,
    loss="mse",
    growth_steps=2000,
    width=16,
) -> keras.Model:
    """Ones in, a fixed target out: every step sees the same gradients.

    `learning_rate=0` keeps the weights (and so the gradients) constant, which
    makes the loss-scale trajectory deterministic.
    """
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    kernel = kernel or "glorot_uniform"
    model = keras.Sequential(
        [
            keras.layers.Input((8,)),
            keras.layers.Dense(width, kernel_initializer=kernel, name="first"),
            keras.layers.Dense(width, kernel_initializer=kernel, name="second"),
            keras.layers.Dense(
                1,
                dtype="float32",
                kernel_initializer=head or "glorot_uniform",
                name="head",
            ),
        ]
    )
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(learning_rate),
        initial_scale=initial_scale,
        dynamic_growth_steps=growth_steps,
    )
    model.compile(optimizer=optimizer, loss=loss)
    return model


def _ones(samples, target):
    return np.ones((samples, 8), np.float32), np.full((samples, 1), target, np.float32)


# Healthy runs: no finding may fire except what applies (MP011 on a CPU).


def healthy_mixed(log_dir):
    """mixed_float16, float32 logits, aligned shapes, numerics sampled."""
    x, y = _classes()
    _fit(log_dir, _classifier("mixed_float16"), x, y, epochs=2, numerics_every=2)


def healthy_float32(log_dir):
    """Plain float32: no mixed-precision finding applies at all."""
    x, y = _classes()
    _fit(log_dir, _classifier("float32"), x, y, epochs=2, numerics_every=2)


def healthy_bfloat16(log_dir):
    """mixed_bfloat16: no loss scale needed, none of the float16 rules apply."""
    x, y = _classes()
    _fit(log_dir, _classifier("mixed_bfloat16"), x, y, epochs=2, numerics_every=2)


def growth_probes(log_dir):
    """A healthy loss scale that grows every 3 steps and overflows right after.

    Regression to 1000 with the weights frozen: the scale settles where the
    gradients just fit float16, then each growth (doubling) overflows once and
    halves back. Those probe overflows are the loss scale working: MP002 must
    not count them.
    """
    x, y = _ones(8 * 40, 1000.0)
    model = _regression(initial_scale=2.0**9, growth_steps=3)
    _fit(log_dir, model, x, y, numerics_every=None)


# Runs that must trigger findings.


def storm(log_dir):
    """MP002: initial scale 2**30, ~20 halvings before the gradients fit."""
    x, y = _ones(8 * 24, 1000.0)
    _fit(log_dir, _regression(initial_scale=2.0**30), x, y, numerics_every=None)


def storm_sampled(log_dir):
    """The storm with every step sampled: its descent's samples show
    gradients beyond float16, which the initial scale alone puts there; the
    descent ends (the gradients fit) about 25 steps in."""
    x, y = _ones(8 * 40, 1000.0)
    _fit(log_dir, _regression(initial_scale=2.0**30), x, y, numerics_every=1,
         forensic_budget=0)


def collapse(log_dir):
    """MP001: targets of 1e8 overflow float16 gradients even at scale 1."""
    x, y = _ones(8 * 32, 1e8)
    _fit(log_dir, _regression(), x, y, numerics_every=None)


def forward_overflow(log_dir):
    """MP003: kernels of 300: "first" outputs 2,400, "second" 11.5M > 65504."""
    x, y = _ones(8 * 4, 0.0)
    model = _regression(keras.initializers.Constant(300.0))
    _fit(log_dir, model, x, y, numerics_every=1)


def headroom(log_dir):
    """MP004: kernels of 8: "second" outputs 8,192, within 16x of 65504."""
    x, y = _ones(8 * 4, 0.0)
    model = _regression(keras.initializers.Constant(8.0), head="zeros")
    _fit(log_dir, model, x, y, numerics_every=1)


def float32_island_beyond_half_range(log_dir):
    """No MP003: kernels of 8 take "second" to 8,192 (float16 fits) and the
    float32 head, kernel 100, to ~13M: beyond 65504, but within float32."""
    x, y = _ones(8 * 4, 0.0)
    model = _regression(keras.initializers.Constant(8.0), head=keras.initializers.Constant(100.0))
    _fit(log_dir, model, x, y, numerics_every=1)


def underflow(log_dir):
    """MP005: the loss times 1e-6 at scale 1: gradients ~1e-7, subnormal."""

    def tiny_mse(y_true, y_pred):
        return 1e-6 * keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)

    x, y = _ones(8 * 4, 1.0)
    model = _regression(
        initial_scale=1.0,
        loss=tiny_mse,
        growth_steps=10_000,
        head=keras.initializers.Constant(0.5),
    )
    _fit(log_dir, model, x, y, numerics_every=1)


def half_output_misaligned(log_dir):
    """MP006: the last Dense outputs float16; MP007: 100 and 20 are not
    multiples of 8."""
    x, y = _classes(inputs=20)
    model = _classifier(
        "mixed_float16", hidden=100, inputs=20, last_dtype=None, hidden_name="hidden"
    )
    _fit(log_dir, model, x, y, numerics_every=2)


def no_loss_scaling(log_dir):
    """MP008: mixed_float16 compiled with auto_scale_loss=False."""
    x, y = _classes()
    _fit(log_dir, _classifier("mixed_float16", auto_scale_loss=False), x, y)


def policy_after_build(log_dir):
    """MP009: the model is built under float32, the policy set afterwards."""
    model = _classifier("float32")
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    x, y = _classes()
    _fit(log_dir, model, x, y)


def nan_weights(log_dir):
    """MP012: a NaN in the data of a float32 run: NaN loss, then NaN weights."""
    x, y = _classes()
    x[3, 0] = np.nan
    keras.mixed_precision.set_dtype_policy("float32")
    _fit(log_dir, _classifier("float32", optimizer=keras.optimizers.SGD(0.1)), x, y)


def _tiny_loss_model(policy, scale, width=16):
    """tanh -> relu (half precision, `width` units) -> float32 readout, the
    loss times `scale`."""

    def shrunk_mse(y_true, y_pred):
        return scale * keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)

    keras.mixed_precision.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.layers.Input((16,)),
        keras.layers.Dense(width + 8, activation="tanh", name="encoder"),
        keras.layers.Dense(width, activation="relu", name="features"),
        keras.layers.Dense(2, dtype="float32", name="readout"),
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=shrunk_mse)
    return model


def _tiny_loss_data(samples=40):
    rng = np.random.default_rng(1)
    return rng.normal(size=(samples, 16)).astype(np.float32), rng.normal(
        size=(samples, 2)
    ).astype(np.float32)


# Units and batch of the "_sampled" runs: each layer's output and incoming
# gradient, 64 x 128 values, is larger than the sample its shares are
# estimated from (tensor_statistics.SAMPLE_VALUES, 4,096).
_WIDE, _WIDE_BATCH = 128, 64


def flushed_gradients(log_dir):
    """MP005: the loss times 1e-13 at the default scale 2**15: the gradient
    reaching the float32 readout is ~1e-9, and cast to float16 on its way into
    "features" it flushes to zero (float16's smallest subnormal is 6e-8)."""
    _fit(log_dir, _tiny_loss_model("mixed_float16", 1e-13), *_tiny_loss_data(),
         batch_size=8, numerics_every=1)


def unshrunk_gradients(log_dir):
    """No MP005: the same model with the loss as it is."""
    _fit(log_dir, _tiny_loss_model("mixed_float16", 1.0), *_tiny_loss_data(),
         batch_size=8, numerics_every=1)


def flushed_gradients_sampled(log_dir):
    """MP005 from estimated shares: `flushed_gradients` with 128 units, so
    every layer's shares come from a sample of its values."""
    _fit(log_dir, _tiny_loss_model("mixed_float16", 1e-13, width=_WIDE),
         *_tiny_loss_data(5 * _WIDE_BATCH), batch_size=_WIDE_BATCH, numerics_every=1)


def unshrunk_gradients_sampled(log_dir):
    """No MP005 from estimated shares: the same wide model, the loss as it is."""
    _fit(log_dir, _tiny_loss_model("mixed_float16", 1.0, width=_WIDE),
         *_tiny_loss_data(5 * _WIDE_BATCH), batch_size=_WIDE_BATCH, numerics_every=1)


def flushed_gradients_bf16(log_dir):
    """No MP005: the same tiny loss in bfloat16, which has float32's range."""
    _fit(log_dir, _tiny_loss_model("mixed_bfloat16", 1e-13), *_tiny_loss_data(),
         batch_size=8, numerics_every=1)


def flushed_gradients_two_samples(log_dir):
    """MP005 not measured: the tiny loss, but only 2 ordinary samples."""
    x, y = _tiny_loss_data()
    _fit(log_dir, _tiny_loss_model("mixed_float16", 1e-13), x[:24], y[:24],
         batch_size=8, numerics_every=1)


def conv_bias_before_batch_norm(log_dir):
    """No MP005: a conv's bias feeding BatchNormalization has a gradient that
    is zero by construction. With the loss times 1e-4 its rounding noise sits
    below float16's normal range (~90% of its values) while every other
    gradient stays normal, as on ResNet50."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.layers.Input((8, 8, 3)),
        keras.layers.Conv2D(8, 3, name="conv"),
        keras.layers.BatchNormalization(name="norm"),
        keras.layers.ReLU(),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(8, dtype="float32", name="logits"),
    ])
    crossentropy = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def shrunk_crossentropy(y_true, y_pred):
        return 1e-4 * crossentropy(y_true, y_pred)

    model.compile(optimizer="adam", loss=shrunk_crossentropy)
    rng = np.random.default_rng(0)
    x, y = rng.random((40, 8, 8, 3), dtype=np.float32), rng.integers(0, 8, 40)
    _fit(log_dir, model, x, y, batch_size=8, numerics_every=1)


def _confident_softmax(softmax_dtype):
    """Logits 12.5 above the true class: its probability is ~5e-7, and the
    crossentropy's gradient -1/(p * batch) = -2.5e5 overflows float16 unless
    the scale drops below ~0.26. Frozen weights (learning rate 0): the same every step."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    bias = np.full(8, 12.5, np.float32)
    bias[0] = 0.0
    model = keras.Sequential([
        keras.layers.Input((4,)),
        keras.layers.Dense(8, kernel_initializer="zeros",
                           bias_initializer=keras.initializers.Constant(bias), name="scores"),
        keras.layers.Activation("softmax", dtype=softmax_dtype, name="probs"),
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="sparse_categorical_crossentropy")
    return model


def half_softmax_gradient_overflow(log_dir):
    """MP001 + MP019 (+ MP006): a float16 softmax head; the gradient overflows
    as it enters "probs", on every step until the scale falls below 1."""
    x, y = np.ones((8 * 20, 4), np.float32), np.zeros(8 * 20, np.int64)
    _fit(log_dir, _confident_softmax(None), x, y, numerics_every=1)


def float32_softmax_confident(log_dir):
    """No MP001/MP019: the same confident model with a float32 softmax."""
    x, y = np.ones((8 * 20, 4), np.float32), np.zeros(8 * 20, np.int64)
    _fit(log_dir, _confident_softmax("float32"), x, y, numerics_every=1)


def overflow_every_step(log_dir):
    """MP001/MP002/MP003: kernels of 300 overflow "second" on every step, so
    every step is skipped and the scale (from 4) halves far below 1."""
    x, y = _ones(8 * 12, 0.0)
    model = _regression(keras.initializers.Constant(300.0), initial_scale=4.0)
    _fit(log_dir, model, x, y, numerics_every=1)


def _attention_run(log_dir, scale):
    """Self-attention over 8 tokens, a float32 readout, the MSE times `scale`."""

    def shrunk_mse(y_true, y_pred):
        return scale * keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)

    keras.mixed_precision.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 16))
    h = keras.layers.MultiHeadAttention(2, key_dim=8, name="attention")(inputs, inputs)
    h = keras.layers.GlobalAveragePooling1D()(h)
    model = keras.Model(inputs, keras.layers.Dense(1, dtype="float32", name="out")(h))
    model.compile(optimizer="adam", loss=shrunk_mse)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 8, 16)), rng.normal(size=(40, 1))
    _fit(log_dir, model, x.astype(np.float32), y.astype(np.float32), numerics_every=1)


def attention_key_bias(log_dir):
    """No MP005: with the loss times 1e-4 only the attention key's bias,
    whose gradient is zero by construction (the softmax over keys ignores a
    constant added to every score), sits below float16's normal range."""
    _attention_run(log_dir, 1e-4)


def attention_underflow(log_dir):
    """MP005 on a nested layer, named by its full path: the loss times 3e-6."""
    _attention_run(log_dir, 3e-6)


def _probability_model(policy, head, loss, *, classes=8):
    """Dense(32) then `head` (a list of layers) compiled with `loss`."""
    keras.mixed_precision.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.layers.Input((32,)), keras.layers.Dense(32, activation="relu"), *head]
    )
    model.compile(optimizer="adam", loss=loss)
    return model


def logits_into_sparse_ce(log_dir):
    """MP014: float32 logits (no softmax) into the string loss
    "sparse_categorical_crossentropy", whose from_logits is False."""
    x, y = _classes()
    model = _probability_model(
        "mixed_float16", [keras.layers.Dense(8, dtype="float32", name="scores")],
        "sparse_categorical_crossentropy",
    )
    _fit(log_dir, model, x, y, numerics_every=2)


def logits_into_binary_ce_bf16(log_dir):
    """MP014 under mixed_bfloat16: a linear Dense(1) into BinaryCrossentropy()."""
    x, y = _classes()
    model = _probability_model(
        "mixed_bfloat16", [keras.layers.Dense(1, name="score")],
        keras.losses.BinaryCrossentropy(), classes=1,
    )
    _fit(log_dir, model, x, (y % 2).astype(np.float32)[:, None], numerics_every=2)


def float32_softmax_activation(log_dir):
    """No MP014: the last layer is Activation("softmax", dtype="float32")."""
    x, y = _classes()
    model = _probability_model(
        "mixed_float16",
        [keras.layers.Dense(8), keras.layers.Activation("softmax", dtype="float32")],
        keras.losses.SparseCategoricalCrossentropy(),
    )
    _fit(log_dir, model, x, y)


def sigmoid_into_binary_ce(log_dir):
    """No MP014: Dense(1, activation="sigmoid", float32) into "binary_crossentropy"."""
    x, y = _classes()
    model = _probability_model(
        "mixed_float16",
        [keras.layers.Dense(1, activation="sigmoid", dtype="float32")],
        "binary_crossentropy",
    )
    _fit(log_dir, model, x, (y % 2).astype(np.float32)[:, None])


# Custom train steps. What the train step did with its optimizers (the run
# context's "optimizers") and whether a loss passed through one of them (the
# health record's "loss_watched") are what the profiler recorded while these
# steps were traced: the rules judge the records of a real run, untouched.


class _RawLossStep(keras.Model):
    """keras.io's "customizing fit" step: gradients of the raw loss, then
    `optimizer.apply`; with `scale=True` the loss goes through `scale_loss`."""

    def __init__(self, *args, scale=False, **kwargs):
        super().__init__(*args, name="custom_step", **kwargs)
        self.scale = scale

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            taped = self.optimizer.scale_loss(loss) if self.scale else loss
        grads = tape.gradient(taped, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


class _TwoOptimizerGan(keras.Model):
    """A generator and a critic, each with its own optimizer."""

    def __init__(self, make_optimizer):
        super().__init__(name="gan")
        self.generator = keras.layers.Dense(8, name="generator")
        self.critic = keras.layers.Dense(1, dtype="float32", name="critic")
        self.g_opt, self.d_opt = make_optimizer(), make_optimizer()

    def call(self, x):
        return self.critic(self.generator(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape(persistent=True) as tape:
            loss = keras.ops.mean(keras.ops.square(self(x, training=True) - y))
            scaled = {
                opt: opt.scale_loss(loss) if hasattr(opt, "inner_optimizer") else loss
                for opt in (self.g_opt, self.d_opt)
            }
        for opt, layer in ((self.d_opt, self.critic), (self.g_opt, self.generator)):
            variables = layer.trainable_variables
            opt.apply(tape.gradient(scaled[opt], variables), variables)
        return {"loss": loss}


def _regression_data():
    rng = np.random.default_rng(2)
    return rng.random((32, 8), dtype=np.float32), rng.random((32, 1), dtype=np.float32)


# Ground truth of the custom-step runs, by run name: the loss each step
# returned, as a probe callback saw it in the step's logs during the same fit.
STEP_LOSSES: dict[str, list[float]] = {}


class _StepLosses(keras.callbacks.Callback):
    def __init__(self, losses: list):
        super().__init__()
        self.losses = losses

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def _custom_step_run(log_dir, model):
    """Trains `model` on a small regression set, per-layer numerics on
    every step (so the numerics "loss" is recorded on each)."""
    losses = STEP_LOSSES.setdefault(pathlib.Path(log_dir).name, [])
    _fit(log_dir, model, *_regression_data(), numerics_every=1, probes=[_StepLosses(losses)])


def raw_loss_step(log_dir):
    """MP018: a LossScaleOptimizer whose apply ran but scale_loss never did."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(1, dtype="float32")(keras.layers.Dense(8)(inputs))
    model = _RawLossStep(inputs, outputs)
    model.compile(optimizer="adam", loss="mse")
    _custom_step_run(log_dir, model)


def raw_loss_step_sgd(log_dir):
    """MP018 with SGD: the missing scale divides every update by it."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(1, dtype="float32")(keras.layers.Dense(8)(inputs))
    model = _RawLossStep(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    _custom_step_run(log_dir, model)


def scaled_loss_step(log_dir):
    """No MP018: the same custom step, with the loss through scale_loss."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(1, dtype="float32")(keras.layers.Dense(8)(inputs))
    model = _RawLossStep(inputs, outputs, scale=True)
    model.compile(optimizer="adam", loss="mse")
    _custom_step_run(log_dir, model)


def gan_plain_optimizers(log_dir):
    """MP008: a GAN's two plain Adam optimizers under mixed_float16."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    model = _TwoOptimizerGan(lambda: keras.optimizers.Adam(1e-3))
    model.compile(optimizer="rmsprop", loss="mse", auto_scale_loss=False)
    _custom_step_run(log_dir, model)


def gan_scaled_optimizers(log_dir):
    """No MP008: the GAN's optimizers are LossScaleOptimizers; the compiled
    (plain, never used) RMSprop is not judged."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    model = _TwoOptimizerGan(
        lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
    )
    model.compile(optimizer="rmsprop", loss="mse", auto_scale_loss=False)
    _custom_step_run(log_dir, model)


def rewrite_run(log_dir: pathlib.Path, source: reader.Run, *, context=None,
                name="train") -> None:
    """Writes `source`'s records into `log_dir/name` through the schema writer,
    the context updated with `context`."""
    writer = RecordWriter(log_dir / name)
    for key, found in source.records.items():
        # Keys of named series (a second optimizer's loss scale) are tags
        # without their prefix: split them back into record and series.
        record, series = schema.parse_tag(schema.TAG_PREFIX + key)
        for item in found:
            value = copy.deepcopy(item.value)
            if record == schema.RUN_CONTEXT:
                value.update(context or {})
            if isinstance(value, dict):
                writer.write_json(record, value, item.step)
            else:
                writer.write_array(record, value, item.step, series=series)
    writer.close()


def hostile(log_dir):
    """The forward_overflow run with a layer and the run named like HTML.

    TensorFlow refuses such names in a graph (not a valid scope name), so the
    records of a real run are rewritten through the schema writer, the way a
    crafted logdir would arrive.
    """
    source = reader.read_run(logdir("forward_overflow"), "train")
    writer = RecordWriter(pathlib.Path(log_dir) / HOSTILE_RUN)
    for record, found in source.records.items():
        for item in found:
            if isinstance(item.value, dict):
                writer.write_json(record, _renamed(item.value), item.step)
            else:
                writer.write_array(record, item.value, item.step)
    writer.close()


def _renamed(value, old="second", new=HOSTILE_NAME):
    if isinstance(value, dict):
        return {k: _renamed(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [_renamed(v, old, new) for v in value]
    if isinstance(value, str):
        return "/".join(new if part == old else part for part in value.split("/"))
    return value


BUILDERS = {
    builder.__name__: builder
    for builder in (
        healthy_mixed,
        healthy_float32,
        healthy_bfloat16,
        growth_probes,
        storm,
        storm_sampled,
        collapse,
        forward_overflow,
        headroom,
        float32_island_beyond_half_range,
        underflow,
        half_output_misaligned,
        no_loss_scaling,
        policy_after_build,
        nan_weights,
        flushed_gradients,
        half_softmax_gradient_overflow,
        float32_softmax_confident,
        overflow_every_step,
        unshrunk_gradients,
        flushed_gradients_sampled,
        unshrunk_gradients_sampled,
        flushed_gradients_bf16,
        flushed_gradients_two_samples,
        conv_bias_before_batch_norm,
        attention_key_bias,
        attention_underflow,
        logits_into_sparse_ce,
        raw_loss_step,
        raw_loss_step_sgd,
        scaled_loss_step,
        gan_plain_optimizers,
        gan_scaled_optimizers,
        logits_into_binary_ce_bf16,
        float32_softmax_activation,
        sigmoid_into_binary_ce,
        hostile,
    )
}


# GPU runs: the records of a real CPU run, rewritten through the schema writer
# as if it had run on a GPU (this machine has none).


A100 = {
    "name": "NVIDIA A100-SXM4-40GB",
    "compute_capability": [8, 0],
    "architecture": "Ampere",
    "fp16_tensor_cores": True,
    "bf16": True,
}
P100 = {
    "name": "Tesla P100-PCIE-16GB",
    "compute_capability": [6, 0],
    "architecture": "Pascal",
    "fp16_tensor_cores": False,
    "bf16": False,
}


def write_gpu_run(
    tmp_path,
    source: str,
    gpus: list[dict],
    *,
    gpu_mode="gpm",
    samples=None,
    kernels=None,
    name="train",
    backend=None,
) -> reader.Run:
    """A real run's records, rewritten as if it had run on `gpus` (and, where
    `backend` is given, trained on that Keras backend)."""
    run = read(source)
    context = copy.deepcopy(run.context.record)
    if backend is not None:
        context["keras_backend"] = backend
    context["hardware"] = {"cpu_only": False, "gpus": gpus, "source": "test"}
    context["gpus_visible"] = len(gpus)
    context["collectors"]["gpu"] = {
        "state": "ok",
        "mode": gpu_mode,
        "reason": "test",
        "devices": gpus,
    }
    writer = rewritten(run, tmp_path / name, context)
    if samples is not None:
        writer.write_array(schema.GPU_SAMPLES, samples, 0)
    if kernels is not None:
        writer.write_json(schema.KERNEL_STATS, kernels, 0)
    writer.close()
    return reader.read_run(tmp_path, name)


def rewritten(run: reader.Run, run_dir, context: dict) -> RecordWriter:
    """A writer of `run_dir` holding `run`'s records, its run context
    replaced by `context` (the caller may write more, then closes it)."""
    writer = RecordWriter(run_dir)
    for record, found in run.records.items():
        for item in found:
            if record == schema.RUN_CONTEXT:
                writer.write_json(record, context, item.step)
            elif isinstance(item.value, dict):
                writer.write_json(record, item.value, item.step)
            else:
                writer.write_array(record, item.value, item.step)
    return writer


def gpu_samples(tensor_util: float, gpu_util: float, rows: int = 50) -> np.ndarray:
    columns = schema.GPU_SAMPLE_COLUMNS
    samples = np.full((rows, len(columns)), np.nan)
    samples[:, columns.index("wall_time")] = 1000.0 + 0.5 * np.arange(rows)
    samples[:, columns.index("step")] = np.arange(rows)
    samples[:, columns.index("device")] = 0
    samples[:, columns.index("tensor_util")] = tensor_util
    samples[:, columns.index("gpu_util")] = gpu_util
    return samples
