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


# name: (builder, input shape).
SHAPES = {"seed": (seed_model, (784,)), "cnn": (cnn_model, (28, 28, 1))}
