"""The real-model suite's architecture families, each defined once and run on
every Keras 3 backend: tests/models/test_model_families.py (TensorFlow),
tests/jax/test_model_families_jax.py (JAX) and
tests/torch/test_model_families_torch.py (PyTorch) fit each under the
profiler and apply the same checks (`model_suite.check_model`) plus the
family's own.

Backend-neutral: Keras 3 layers, numpy data and keras-hub only (no
TensorFlow op). The families whose code is TensorFlow's own (a custom
`train_step` with `tf.GradientTape`, a GAN, a `tf.data` pipeline) stay in the
TensorFlow module.

Each family is a function returning a `Family`: the compiled model, its data,
fit arguments and the checks only it needs (given the run read back and
`check_model`'s summary). Models and data are tiny: 2-6 steps each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import keras
import numpy as np


@dataclasses.dataclass
class Family:
    """One model to fit under the profiler.

    Args:
        model: the compiled model.
        x: its inputs.
        y: its targets (None: the data holds them).
        fit_kwargs: more `model.fit` arguments (batch_size, validation_data...).
        check: the family's own checks, `check(run, summary)` with the run
            read back and `model_suite.check_model`'s summary.
    """

    model: keras.Model
    x: object
    y: object = None
    fit_kwargs: dict = dataclasses.field(default_factory=lambda: {"batch_size": 2})
    check: Callable | None = None


def _rng():
    return np.random.default_rng(0)


def _inventory(run) -> dict[str, dict]:
    return {r["name"]: r for r in run.inventory["layers"]}


def mobilenet_v3_small() -> Family:
    # minimalistic: 110 layers instead of 164 (no squeeze-excite blocks), the
    # suite's slowest model all the same (tracing two train steps).
    model = keras.applications.MobileNetV3Small(
        input_shape=(32, 32, 3), weights=None, classes=4, include_preprocessing=True,
        minimalistic=True,
    )
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    x = _rng().uniform(0, 255, (8, 32, 32, 3)).astype("float32")

    def check(run, summary):
        # Its classifier softmax outputs float16: the loss sees float16.
        assert "MP006" in summary["codes"]

    return Family(model, x, np.arange(8) % 4, check=check)


def transformer_block() -> Family:
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

    def check(run, summary):
        assert {"attention/query", "attention/key", "attention/value",
                "attention/attention_output"} <= set(summary["measured"])

    return Family(model, _rng().integers(0, 32, (8, 6)), np.arange(8) % 2, check=check)


def recurrent(kind: str) -> Family:
    """A GRU, an LSTM or a Bidirectional LSTM returning sequences. Its cells
    run inside the recurrent layer's loop: `check_model` expects them listed
    as skipped, measured at their RNN."""
    if kind == "Bidirectional":
        layer = keras.layers.Bidirectional(keras.layers.LSTM(8, return_sequences=True),
                                           name="rnn")
    else:
        layer = getattr(keras.layers, kind)(8, return_sequences=True, name="rnn")
    model = keras.Sequential([
        keras.layers.Input((5, 3)),
        layer,
        keras.layers.GlobalAveragePooling1D(name="pool"),
        keras.layers.Dense(1, dtype="float32", name="head"),
    ])
    model.compile(optimizer="adam", loss="mse")
    x = _rng().standard_normal((8, 5, 3)).astype("float32")

    def check(run, summary):
        # The look-alike of check_model's generic expectation: here it must
        # have found cells to expect.
        assert summary["skipped"], "no recurrent cell listed as skipped"

    return Family(model, x, _rng().random((8, 1)), check=check)


def conv1d_with_embedding() -> Family:
    model = keras.Sequential([
        keras.layers.Input((10,), dtype="int32"),
        keras.layers.Embedding(50, 8, name="embed"),
        keras.layers.Conv1D(8, 3, activation="relu", name="conv"),
        keras.layers.GlobalMaxPooling1D(name="pool"),
        keras.layers.Dense(1, dtype="float32", name="head"),
    ])
    model.compile(optimizer="adam", loss="mse")
    return Family(model, _rng().integers(0, 50, (8, 10)), _rng().random((8, 1)))


def batch_normalization() -> Family:
    model = keras.Sequential([
        keras.layers.Input((8, 8, 3)),
        keras.layers.Conv2D(8, 3, name="conv"),
        keras.layers.BatchNormalization(name="bn"),
        keras.layers.ReLU(name="relu"),
        keras.layers.GlobalAveragePooling2D(name="pool"),
        keras.layers.Dense(1, dtype="float32", name="head"),
    ])
    model.compile(optimizer="adam", loss="mse")

    def check(run, summary):
        # BatchNormalization computes in float32 inside but outputs float16.
        assert _inventory(run)["bn"]["output_dtypes"] == ["float16"]

    return Family(model, _rng().random((8, 8, 8, 3)), _rng().random((8, 1)), check=check)


def multi_output_with_two_losses() -> Family:
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu", name="trunk")(inputs)
    value = keras.layers.Dense(1, dtype="float32", name="value")(hidden)
    label = keras.layers.Dense(1, activation="sigmoid", dtype="float32", name="label")(hidden)
    model = keras.Model(inputs, {"value": value, "label": label})
    model.compile(optimizer="adam", loss={"value": "mse", "label": "binary_crossentropy"},
                  loss_weights={"value": 1.0, "label": 0.5})
    rng = _rng()
    y = {"value": rng.random((8, 1)), "label": (rng.random((8, 1)) > 0.5).astype("float32")}
    return Family(model, rng.random((8, 6)), y)


def dropout_regressor() -> tuple[keras.Model, tuple[np.ndarray, ...]]:
    """A Dense/Dropout regressor and its (x, y, sample weights): the TensorFlow
    module feeds them through `tf.data`, `with_sample_weight_and_validation`
    as numpy arrays."""
    model = keras.Sequential([
        keras.layers.Input((6,)),
        keras.layers.Dense(8, activation="relu", name="hidden"),
        keras.layers.Dropout(0.25, name="dropout"),
        keras.layers.Dense(1, dtype="float32", name="head"),
    ])
    model.compile(optimizer="adam", loss="mse")
    rng = _rng()
    x, y = rng.random((8, 6), dtype="float32"), rng.random((8, 1), dtype="float32")
    return model, (x, y, np.linspace(0.5, 1.5, 8).astype("float32"))


def with_sample_weight_and_validation() -> Family:
    model, (x, y, weights) = dropout_regressor()

    def check(run, summary):
        assert model.history.history["val_loss"]

    return Family(model, x, y, {"batch_size": 2, "sample_weight": weights,
                                "validation_data": (x, y)}, check=check)


def per_layer_dtype_overrides() -> Family:
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

    def check(run, summary):
        inventory = _inventory(run)
        dtypes = {name: (r["policy"], r["output_dtypes"]) for name, r in inventory.items()}
        assert dtypes["fp16_dense"] == ("mixed_float16", ["float16"])
        assert dtypes["fp32_island"] == ("float32", ["float32"])
        assert dtypes["bf16_layer"] == ("mixed_bfloat16", ["bfloat16"])
        assert dtypes["bf16_block/bf16_dense"] == ("mixed_bfloat16", ["bfloat16"])
        assert inventory["fp32_island"]["float32_island"] is True

    rng = _rng()
    return Family(model, rng.random((8, 6)), rng.random((8, 1)), check=check)


def dtype_policy_map() -> Family:
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

    def check(run, summary):
        inventory = _inventory(run)
        value, query = inventory["attention/value"], inventory["attention/query"]
        assert (value["policy"], value["compute_dtype"], value["output_dtypes"]) == (
            "float32", "float32", ["float32"]
        )
        assert (query["policy"], query["compute_dtype"], query["output_dtypes"]) == (
            "mixed_float16", "float16", ["float16"]
        )

    rng = _rng()
    return Family(model, rng.random((8, 4, 8)), rng.random((8, 1)), check=check)


def keras_hub_backbone(backbone: str) -> Family:
    """A keras-hub BertBackbone or GPT2Backbone built from a config (random
    weights, no download), called as a nested model."""
    import keras_hub  # a dev dependency: a failed import fails the test

    config = {"vocabulary_size": 32, "num_layers": 1, "num_heads": 2, "hidden_dim": 16,
              "intermediate_dim": 32, "max_sequence_length": 8}
    network = getattr(keras_hub.models, backbone)(**config)
    token_ids = keras.Input((8,), dtype="int32", name="token_ids")
    padding_mask = keras.Input((8,), dtype="int32", name="padding_mask")
    features = {"token_ids": token_ids, "padding_mask": padding_mask}
    if backbone == "BertBackbone":
        features["segment_ids"] = keras.Input((8,), dtype="int32", name="segment_ids")
        pooled = network(features)["pooled_output"]
    else:
        pooled = keras.layers.GlobalAveragePooling1D(name="pool")(network(features))
    model = keras.Model(features, keras.layers.Dense(1, dtype="float32", name="head")(pooled))
    model.compile(optimizer="adam", loss="mse")
    rng = _rng()
    x = {"token_ids": rng.integers(0, 32, (8, 8)), "padding_mask": np.ones((8, 8), "int32")}
    if backbone == "BertBackbone":
        x["segment_ids"] = np.zeros((8, 8), "int32")
    return Family(model, x, rng.random((8, 1)))


def keras_hub_vit_backbone() -> Family:
    """ViTBackbone calls its position embedding on an eager constant the
    layer keeps (`position_ids`): no op to follow, and no collector fails."""
    import keras_hub

    network = keras_hub.models.ViTBackbone(image_shape=(16, 16, 3), patch_size=4, num_layers=1,
                                           num_heads=2, hidden_dim=16, mlp_dim=32)
    images = keras.Input((16, 16, 3))
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(network(images))
    model = keras.Model(images, keras.layers.Dense(1, dtype="float32", name="head")(pooled))
    model.compile(optimizer="adam", loss="mse")

    def check(run, summary):
        assert run.context["collectors"]["precision"]["state"] == "ok"

    rng = _rng()
    return Family(model, rng.random((8, 16, 16, 3)), rng.random((8, 1)), check=check)


# Every family each backend runs, by test id.
FAMILIES: dict[str, Callable[[], Family]] = {
    "mobilenet_v3_small": mobilenet_v3_small,
    "transformer_block": transformer_block,
    "gru": lambda: recurrent("GRU"),
    "lstm": lambda: recurrent("LSTM"),
    "bidirectional_lstm": lambda: recurrent("Bidirectional"),
    "conv1d_with_embedding": conv1d_with_embedding,
    "batch_normalization": batch_normalization,
    "multi_output_with_two_losses": multi_output_with_two_losses,
    "sample_weight_and_validation": with_sample_weight_and_validation,
    "per_layer_dtype_overrides": per_layer_dtype_overrides,
    "dtype_policy_map": dtype_policy_map,
    "bert_backbone": lambda: keras_hub_backbone("BertBackbone"),
    "gpt2_backbone": lambda: keras_hub_backbone("GPT2Backbone"),
    "vit_backbone": keras_hub_vit_backbone,
}
