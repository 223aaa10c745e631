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


# name: (builder, input shape).
SHAPES = {"seed": (seed_model, (784,)), "cnn": (cnn_model, (28, 28, 1))}
