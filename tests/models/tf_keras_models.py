"""tf-keras (Keras 2) models of the real-model suite, as a script; prints one
JSON line.

tf-keras must be chosen before TensorFlow is imported, so these fits run in
their own process:

    python tests/models/tf_keras_models.py LOGDIR

Each family's mixed_float16 fit (the recurrent one with
`steps_per_execution=2`) writes into LOGDIR/FAMILY with numerics on
every step; the JSON line maps each family to what the model itself says
(computed here from tf-keras' own layer attributes): its layers' names,
classes, policies and dtypes, the layers whose numerics should be recorded,
and its trainable variables' names.
"""

import json
import os
import sys

os.environ["TF_USE_LEGACY_KERAS"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tf_keras

import mpprof
from mpprof.backends.layer_records import variable_path

layers = tf_keras.layers


def recurrent_model() -> tf_keras.Model:
    return tf_keras.Sequential([
        layers.Input((5, 3)),
        layers.GRU(8, return_sequences=True, name="gru"),
        layers.Bidirectional(layers.LSTM(4, return_sequences=True), name="bidirectional"),
        layers.GlobalAveragePooling1D(name="pool"),
        layers.Dense(1, dtype="float32", name="head"),
    ])


def conv_batch_norm_model() -> tf_keras.Model:
    inputs = layers.Input((8, 8, 3))
    x = layers.Conv2D(8, 3, name="conv")(inputs)
    x = layers.BatchNormalization(name="bn")(x)
    x = layers.ReLU(name="relu")(x)
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    return tf_keras.Model(inputs, layers.Dense(1, dtype="float32", name="head")(x))


FAMILIES = {"recurrent": recurrent_model, "conv_batch_norm": conv_batch_norm_model}


def sublayers(layer) -> list:
    return [
        child for child in layer._flatten_layers(include_self=False, recursive=False)
        if not isinstance(child, layers.InputLayer)
    ]


def expected(model) -> dict:
    """The model's own view: every nested layer, and the layers to measure."""
    nested, measured = {}, []

    def visit(layer, measuring: bool):
        if id(layer) in nested:
            return
        nested[id(layer)] = [layer.name, type(layer).__name__, layer.dtype_policy.name,
                             layer.compute_dtype, layer.variable_dtype]
        recurrent = isinstance(layer, layers.RNN)
        if measuring and (recurrent or not sublayers(layer)):
            measured.append(layer.name)
        for child in sublayers(layer):
            visit(child, measuring and not recurrent)

    for layer in sublayers(model):
        visit(layer, True)
    return {
        "layers": sorted(nested.values()),
        "measured": sorted(measured),
        "variables": [variable_path(v) for v in model.trainable_variables],
        "model_policy": model.dtype_policy.name,
    }


def fit(family: str, logdir: str) -> dict:
    tf_keras.utils.set_random_seed(0)
    tf_keras.mixed_precision.set_global_policy("mixed_float16")
    model = FAMILIES[family]()
    # steps_per_execution=2: tf-keras runs the whole step inside a
    # tf.while_loop, its gradients too: the layers are measured all the same.
    model.compile(optimizer="adam", loss="mse",
                  steps_per_execution=2 if family == "recurrent" else 1)
    rng = np.random.default_rng(0)
    x = rng.random((8, *model.input_shape[1:]), dtype="float32")
    y = rng.random((8, 1), dtype="float32")
    profiler = mpprof.MixedPrecisionProfiler(
        os.path.join(logdir, family), numerics_every=1, gpu_interval=None
    )
    model.fit(x, y, batch_size=2, epochs=1, verbose=0, callbacks=[profiler])
    return expected(model)


def main(logdir: str) -> None:
    print(json.dumps({family: fit(family, logdir) for family in FAMILIES}))


if __name__ == "__main__":
    main(sys.argv[1])
