"""Keras 3, MirroredStrategy on 2 logical CPUs, overflow on the second replica only.

Keras 3's LossScaleOptimizer checks the gradients before they are all-reduced
and takes the first replica's verdict: this run shows what it then does and
what mpprof records. Prints one JSON line.

    python tests/keras3_mirrored_split_fit.py LOGDIR
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
from mpprof import diagnosis  # noqa: E402
from mpprof.records import reader  # noqa: E402

GLOBAL_BATCH = 16


def main(logdir: str) -> None:
    keras.utils.set_random_seed(1)
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = keras.Sequential([
            keras.layers.Input((8,)),
            keras.layers.Dense(8, name="dense"),
            keras.layers.Dense(1, dtype="float32", name="dense_1"),
        ])
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(1e-6), initial_scale=2.0**30), loss="mse")
    x = np.ones((4 * GLOBAL_BATCH, 8), np.float32)
    y = np.full((4 * GLOBAL_BATCH, 1), 1000.0, np.float32)
    first_replica = (np.arange(len(x)) % GLOBAL_BATCH) < GLOBAL_BATCH // 2
    x[first_replica], y[first_replica] = 0.0, 0.0  # zero gradients there
    iterations = []
    probe = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: iterations.append(
            int(model.optimizer.iterations.numpy()))
    )
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False,
              callbacks=[mpprof.MixedPrecisionProfiler(logdir, gpu_interval=None), probe])
    run = reader.read_run(logdir, "train")
    # Keras 3 does not advance iterations on a skipped step.
    applied = np.diff(np.concatenate([[0], iterations])) > 0
    print(json.dumps({
        "skipped_by_optimizer": np.flatnonzero(~applied).tolist(),
        "recorded_overflow_steps": run.loss_scale.overflow_steps.tolist(),
        "steps": len(iterations),
        "skip_decided_by": run.context["collectors"]["loss_scale"]["skip_decided_by"],
        "nonfinite_weights": run.health["nonfinite_weights"],
        "codes": [finding.code for finding in diagnosis.diagnose(run)],
    }))


if __name__ == "__main__":
    main(sys.argv[1])
