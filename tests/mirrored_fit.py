"""Runs a profiled fit under MirroredStrategy on two logical CPUs; prints JSON.

Run as a script (logical devices must be set before TensorFlow starts):
    python tests/mirrored_fit.py LOGDIR
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf
from logical_cpus import split_cpu_in_two

split_cpu_in_two()

import keras  # noqa: E402
import numpy as np  # noqa: E402

import mpprof  # noqa: E402
from mpprof.records import reader  # noqa: E402


def main(logdir: str) -> None:
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = keras.Sequential([
            keras.layers.Input((8,)),
            keras.layers.Dense(8, name="dense"),
            keras.layers.Dense(1, dtype="float32", name="dense_1"),
        ])
        optimizer = keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(1e-6), initial_scale=2.0**30, dynamic_growth_steps=4
        )
        model.compile(optimizer=optimizer, loss="mse")
    x = np.ones((128, 8), np.float32)
    x[::2] *= 0.5  # the two replicas see different values
    y = np.full((128, 1), 1000.0, np.float32)
    scales = []
    probe = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: scales.append(
            float(model.optimizer.dynamic_scale.numpy())
        )
    )
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False,
              callbacks=[mpprof.MixedPrecisionProfiler(logdir, numerics_every=3), probe])
    run = reader.read_run(logdir, "train")
    numerics = run.numerics
    first = model.get_layer("dense")
    print(json.dumps({
        "replicas": run.context["num_replicas"],
        "strategy": run.context["distribution_strategy"],
        "overflow_steps": run.loss_scale.overflow_steps.tolist(),
        "scale_after": run.loss_scale.scale_after(np.arange(len(scales))).tolist(),
        "probe_scales": scales,
        "iterations": int(model.optimizer.iterations.numpy()),
        "steps_run": run.loss_scale.steps_run,
        "numerics_layers": numerics.layers,
        "forward_count": numerics.forward["count"][:, 0].tolist(),
        "forward_abs_max": numerics.forward["abs_max"][:, 0].tolist(),
        "expected_abs_max": float(np.max(np.abs(np.asarray(first(x)).astype(np.float32)))),
    }))


if __name__ == "__main__":
    main(sys.argv[1])
