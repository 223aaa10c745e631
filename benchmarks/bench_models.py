"""The benchmark models, built with Keras alone (any backend)."""

from __future__ import annotations

import keras


def seed_model() -> keras.Model:
    """The seed model: 784-256-10, float32 logits."""
    return keras.Sequential([
        keras.layers.Input((784,)),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(10, dtype="float32"),
    ])


def cnn_model() -> keras.Model:
    """A small CNN on 28x28x1 inputs."""
    return keras.Sequential([
        keras.layers.Input((28, 28, 1)),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(10, dtype="float32"),
    ])


def small_transformer(sequence: int, vocabulary: int, width: int) -> keras.Model:
    """One attention block over `sequence` tokens of a `vocabulary`, 10
    classes, float32 logits (the device checks' second model)."""
    tokens = keras.Input((sequence,), dtype="int32")
    x = keras.layers.Embedding(vocabulary, width)(tokens)
    attended = keras.layers.MultiHeadAttention(4, width // 4)(x, x)
    x = keras.layers.LayerNormalization()(x + attended)
    hidden = keras.layers.Dense(4 * width, activation="gelu")(x)
    x = keras.layers.LayerNormalization()(x + keras.layers.Dense(width)(hidden))
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(tokens, keras.layers.Dense(10, dtype="float32", name="logits")(x))


def third_dense_model() -> keras.Model:
    """The replay's seed overflow (the device check's and the backend
    contract's): ones through Dense(0.1) twice reach the third Dense at 1.28,
    and its kernel of 5000 takes the float16 product to 1.28 * 16 * 5000 >
    65504 on every step (skipped: the weights stay). Adam at a tiny rate: the
    30-step trial verifying the fix learns from activations of 1e5 without
    diverging."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    constant = keras.initializers.Constant
    model = keras.Sequential([
        keras.layers.Input((8,)),
        keras.layers.Dense(16, kernel_initializer=constant(0.1), name="d1"),
        keras.layers.Dense(16, kernel_initializer=constant(0.1), name="d2"),
        keras.layers.Dense(16, kernel_initializer=constant(5000.0), name="d3"),
        keras.layers.Dense(1, kernel_initializer=constant(1e-6), dtype="float32",
                           name="out"),
    ], name="third_dense")
    model.compile(optimizer=keras.optimizers.Adam(1e-9), loss="mse")
    return model


# name: (builder, input shape).
SHAPES = {"seed": (seed_model, (784,)), "cnn": (cnn_model, (28, 28, 1))}
