"""keras-io's mnist_convnet (examples/vision/mnist_convnet.py), the model code
as published, fed 16-bit images in raw units (the `/ 65535` forgotten): shared
by the verification tests on TensorFlow and JAX."""

import keras
import numpy as np


def mnist_convnet(policy: str, *, rescale: bool = False,
                  float32_layers: tuple[str, ...] = ()) -> keras.Model:
    """keras-io's examples/vision/mnist_convnet.py model, as published
    (keras.layers as `layers`, its names kept), with the fixes applied."""
    keras.mixed_precision.set_dtype_policy(policy)
    layers = keras.layers
    first = [layers.Rescaling(1 / 65535, dtype="float32")] if rescale else []

    def dtype(name):
        return "float32" if name in float32_layers else None

    model = keras.Sequential([
        keras.Input(shape=(28, 28, 1)),
        *first,
        layers.Conv2D(32, kernel_size=(3, 3), activation="relu", name="conv2d",
                      dtype=dtype("conv2d")),
        layers.MaxPooling2D(pool_size=(2, 2), name="max_pooling2d"),
        layers.Conv2D(64, kernel_size=(3, 3), activation="relu", name="conv2d_1",
                      dtype=dtype("conv2d_1")),
        layers.MaxPooling2D(pool_size=(2, 2), name="max_pooling2d_1"),
        layers.Flatten(name="flatten"),
        layers.Dropout(0.5, name="dropout"),
        layers.Dense(10, activation="softmax", name="dense", dtype=dtype("dense")),
    ], name="sequential")
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    return model


def raw_mnist_data(samples: int = 64):
    """Random 16-bit images in raw units (whole numbers 0..65535, as float32)."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 65536, (samples, 28, 28, 1)).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, 10, samples), 10)
    return x, y
