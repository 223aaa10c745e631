"""The real-model suite: one short mixed_float16 fit per architecture family a
user brings, each profiled with numerics on every step.

Each test checks that fit completes, that the recorded inventory matches the
model's own layers (names, classes, policies, compute/variable dtypes), that
numerics samples were recorded for the layers they should be, and that
`mpprof diagnose --format json` reads the run. Models and data are tiny:
2-6 steps each.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from model_suite import check_model, fit_profiled


@pytest.fixture(autouse=True)
def _mixed_float16():
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_dtype_policy("mixed_float16")


def _rng():
    return np.random.default_rng(0)


def test_keras_applications_mobilenet_v3_small(tmp_path, capsys):
    # minimalistic: 110 layers instead of 164 (no squeeze-excite blocks), the
    # suite's slowest test all the same (tracing two train steps).
    model = keras.applications.MobileNetV3Small(
        input_shape=(32, 32, 3), weights=None, classes=4, include_preprocessing=True,
        minimalistic=True,
    )
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    x = _rng().uniform(0, 255, (8, 32, 32, 3)).astype("float32")
    run = fit_profiled(model, x, np.arange(8) % 4, logdir=tmp_path, batch_size=2)
    checked = check_model(run, model, tmp_path, capsys)
    # Its classifier softmax outputs float16: the loss sees float16.
    assert "MP006" in checked["codes"]


def test_transformer_block(tmp_path, capsys):
    inputs = keras.Input((6,), dtype="int32")
    x = keras.layers.Embedding(32, 16, name="embed")(inputs)
    attended = keras.layers.MultiHeadAttention(2, 8, name="attention")(x, x)
    x = keras.layers.LayerNormalization(name="norm_1")(x + attended)
    feed = keras.layers.Dense(32, activation="relu", name="ffn_in")(x)
    feed = keras.layers.Dense(16, name="ffn_out")(feed)
    x = keras.layers.LayerNormalization(name="norm_2")(x + feed)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    outputs = keras.layers.Dense(2, dtype="float32", name="head")(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    run = fit_profiled(model, _rng().integers(0, 32, (8, 6)), np.arange(8) % 2,
                       logdir=tmp_path, batch_size=2)
    check_model(run, model, tmp_path, capsys)
    measured = run.numerics.layers
    assert {"attention/query", "attention/key", "attention/value",
            "attention/attention_output"} <= set(measured)


@pytest.mark.parametrize("recurrent", ["GRU", "LSTM", "Bidirectional"])
def test_recurrent(tmp_path, capsys, recurrent):
    if recurrent == "Bidirectional":
        layer = keras.layers.Bidirectional(keras.layers.LSTM(8, return_sequences=True),
                                           name="rnn")
    else:
        layer = getattr(keras.layers, recurrent)(8, return_sequences=True, name="rnn")
    model = keras.Sequential([
        keras.layers.Input((5, 3)),
        layer,
        keras.layers.GlobalAveragePooling1D(name="pool"),
        keras.layers.Dense(1, dtype="float32", name="head"),
    ])
    model.compile(optimizer="adam", loss="mse")
    x = _rng().standard_normal((8, 5, 3)).astype("float32")
    run = fit_profiled(model, x, _rng().random((8, 1)), logdir=tmp_path, batch_size=2)
    check_model(run, model, tmp_path, capsys)
    skipped = run.latest("numerics/layout")["skipped"]
    cells = [s["layer"] for s in skipped]
    assert cells and all(cell.endswith("_cell") for cell in cells)
    assert all("runs inside the recurrent layer" in s["reason"] for s in skipped)


def test_conv1d_with_embedding(tmp_path, capsys):
    model = keras.Sequential([
        keras.layers.Input((10,), dtype="int32"),
        keras.layers.Embedding(50, 8, name="embed"),
        keras.layers.Conv1D(8, 3, activation="relu", name="conv"),
        keras.layers.GlobalMaxPooling1D(name="pool"),
        keras.layers.Dense(1, dtype="float32", name="head"),
    ])
    model.compile(optimizer="adam", loss="mse")
    run = fit_profiled(model, _rng().integers(0, 50, (8, 10)), _rng().random((8, 1)),
                       logdir=tmp_path, batch_size=2)
    check_model(run, model, tmp_path, capsys)


def test_batch_normalization(tmp_path, capsys):
    model = keras.Sequential([
        keras.layers.Input((8, 8, 3)),
        keras.layers.Conv2D(8, 3, name="conv"),
        keras.layers.BatchNormalization(name="bn"),
        keras.layers.ReLU(name="relu"),
        keras.layers.GlobalAveragePooling2D(name="pool"),
        keras.layers.Dense(1, dtype="float32", name="head"),
    ])
    model.compile(optimizer="adam", loss="mse")
    run = fit_profiled(model, _rng().random((8, 8, 8, 3)), _rng().random((8, 1)),
                       logdir=tmp_path, batch_size=2)
    inventory = {r["name"]: r for r in run.inventory["layers"]}
    # BatchNormalization computes in float32 inside but outputs float16.
    assert inventory["bn"]["output_dtypes"] == ["float16"]
    check_model(run, model, tmp_path, capsys)


def test_multi_output_with_two_losses(tmp_path, capsys):
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu", name="trunk")(inputs)
    value = keras.layers.Dense(1, dtype="float32", name="value")(hidden)
    label = keras.layers.Dense(1, activation="sigmoid", dtype="float32", name="label")(hidden)
    model = keras.Model(inputs, {"value": value, "label": label})
    model.compile(optimizer="adam", loss={"value": "mse", "label": "binary_crossentropy"},
                  loss_weights={"value": 1.0, "label": 0.5})
    rng = _rng()
    y = {"value": rng.random((8, 1)), "label": (rng.random((8, 1)) > 0.5).astype("float32")}
    run = fit_profiled(model, rng.random((8, 6)), y, logdir=tmp_path, batch_size=2)
    check_model(run, model, tmp_path, capsys)


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
    model = keras.Sequential([
        keras.layers.Input((6,)),
        keras.layers.Dense(8, activation="relu", name="hidden"),
        keras.layers.Dropout(0.25, name="dropout"),
        keras.layers.Dense(1, dtype="float32", name="head"),
    ])
    model.compile(optimizer="adam", loss="mse")
    rng = _rng()
    x, y = rng.random((8, 6), dtype="float32"), rng.random((8, 1), dtype="float32")
    weights = np.linspace(0.5, 1.5, 8).astype("float32")
    train = tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(2)
    validation = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    run = fit_profiled(model, train, logdir=tmp_path, validation_data=validation)
    check_model(run, model, tmp_path, capsys)
    assert model.history.history["val_loss"]


def test_per_layer_dtype_overrides(tmp_path, capsys):
    """Layers given float32, mixed_bfloat16 and float16-variable policies, and a
    sub-model built under another global policy."""
    keras.mixed_precision.set_dtype_policy("mixed_bfloat16")
    block = keras.Sequential([keras.layers.Input((8,)), keras.layers.Dense(8, name="bf16_dense")],
                             name="bf16_block")
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    model = keras.Sequential([
        keras.layers.Input((6,)),
        keras.layers.Dense(8, name="fp16_dense"),
        keras.layers.Dense(8, dtype="float32", name="fp32_island"),
        keras.layers.Dense(8, dtype="mixed_bfloat16", name="bf16_layer"),
        block,
        keras.layers.Dense(1, dtype="float32", name="head"),
    ])
    model.compile(optimizer="adam", loss="mse")
    rng = _rng()
    run = fit_profiled(model, rng.random((8, 6)), rng.random((8, 1)), logdir=tmp_path,
                       batch_size=2)
    check_model(run, model, tmp_path, capsys)
    inventory = {r["name"]: r for r in run.inventory["layers"]}
    dtypes = {name: (r["policy"], r["output_dtypes"]) for name, r in inventory.items()}
    assert dtypes["fp16_dense"] == ("mixed_float16", ["float16"])
    assert dtypes["fp32_island"] == ("float32", ["float32"])
    assert dtypes["bf16_layer"] == ("mixed_bfloat16", ["bfloat16"])
    assert dtypes["bf16_block/bf16_dense"] == ("mixed_bfloat16", ["bfloat16"])
    assert inventory["fp32_island"]["float32_island"] is True


def test_dtype_policy_map(tmp_path, capsys):
    """A DTypePolicyMap resolves each sublayer's policy by its path."""
    policy_map = keras.dtype_policies.DTypePolicyMap(
        default_policy=keras.dtype_policies.DTypePolicy("mixed_float16"),
    )
    policy_map["attention/value"] = keras.dtype_policies.DTypePolicy("float32")
    inputs = keras.Input((4, 8))
    attended = keras.layers.MultiHeadAttention(2, 8, name="attention", dtype=policy_map)(
        inputs, inputs
    )
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(attended)
    model = keras.Model(inputs, keras.layers.Dense(1, dtype="float32", name="head")(pooled))
    model.compile(optimizer="adam", loss="mse")
    rng = _rng()
    run = fit_profiled(model, rng.random((8, 4, 8)), rng.random((8, 1)), logdir=tmp_path,
                       batch_size=2)
    check_model(run, model, tmp_path, capsys)
    inventory = {r["name"]: r for r in run.inventory["layers"]}
    value, query = inventory["attention/value"], inventory["attention/query"]
    assert (value["policy"], value["compute_dtype"], value["output_dtypes"]) == (
        "float32", "float32", ["float32"]
    )
    assert (query["policy"], query["compute_dtype"], query["output_dtypes"]) == (
        "mixed_float16", "float16", ["float16"]
    )


@pytest.fixture
def keras_hub():
    """keras-hub is a dev dependency (`pip install -e .[dev]`): a failed
    import fails the tests that use it, never skips them."""
    import keras_hub

    return keras_hub


@pytest.mark.parametrize("backbone", ["BertBackbone", "GPT2Backbone"])
def test_keras_hub_backbone_from_a_config(tmp_path, capsys, keras_hub, backbone):
    """A keras-hub backbone built from a config (random weights, no download),
    called as a nested model."""
    config = {"vocabulary_size": 32, "num_layers": 1, "num_heads": 2, "hidden_dim": 16,
              "intermediate_dim": 32, "max_sequence_length": 8}
    network = getattr(keras_hub.models, backbone)(**config)
    token_ids = keras.Input((8,), dtype="int32", name="token_ids")
    padding_mask = keras.Input((8,), dtype="int32", name="padding_mask")
    features = {"token_ids": token_ids, "padding_mask": padding_mask}
    if backbone == "BertBackbone":
        segment_ids = keras.Input((8,), dtype="int32", name="segment_ids")
        features["segment_ids"] = segment_ids
        pooled = network(features)["pooled_output"]
    else:
        pooled = keras.layers.GlobalAveragePooling1D(name="pool")(network(features))
    model = keras.Model(features, keras.layers.Dense(1, dtype="float32", name="head")(pooled))
    model.compile(optimizer="adam", loss="mse")
    rng = _rng()
    x = {"token_ids": rng.integers(0, 32, (8, 8)), "padding_mask": np.ones((8, 8), "int32")}
    if backbone == "BertBackbone":
        x["segment_ids"] = np.zeros((8, 8), "int32")
    run = fit_profiled(model, x, rng.random((8, 1)), logdir=tmp_path, batch_size=2)
    check_model(run, model, tmp_path, capsys)



def test_keras_hub_vit_backbone_embeds_its_own_position_ids(tmp_path, capsys, keras_hub):
    """ViTBackbone calls its position embedding on an eager constant the
    layer keeps (`position_ids`): no op to follow, and no collector fails."""
    network = keras_hub.models.ViTBackbone(image_shape=(16, 16, 3), patch_size=4, num_layers=1,
                                           num_heads=2, hidden_dim=16, mlp_dim=32)
    images = keras.Input((16, 16, 3))
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(network(images))
    model = keras.Model(images, keras.layers.Dense(1, dtype="float32", name="head")(pooled))
    model.compile(optimizer="adam", loss="mse")
    rng = _rng()
    run = fit_profiled(model, rng.random((8, 16, 16, 3)), rng.random((8, 1)), logdir=tmp_path,
                       batch_size=2)
    assert run.context["collectors"]["precision"]["state"] == "ok"
    check_model(run, model, tmp_path, capsys)
