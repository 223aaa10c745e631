"""One Keras 3 MultiWorkerMirroredStrategy worker with the profiler; prints JSON.

Keras 3's fit does not run across worker processes (keras-team/keras#20585);
mpprof must say so and not make the failure worse. Started by
tests/multi_worker_fit.py's `run_workers` with TF_CONFIG set:

    python tests/keras3_multi_worker_fit.py LOGDIR [--without-mpprof]
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import mpprof


def main(logdir: str, with_mpprof: bool) -> None:
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    with strategy.scope():
        model = keras.Sequential([
            keras.layers.Input((8,)),
            keras.layers.Dense(8, name="dense"),
            keras.layers.Dense(1, dtype="float32", name="dense_1"),
        ])
        model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((64, 8), np.float32), np.ones((64, 1), np.float32)
    callbacks = [mpprof.MixedPrecisionProfiler(logdir, gpu_interval=None)] if with_mpprof else []
    error = None
    try:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=callbacks)
    except Exception as e:  # noqa: BLE001 - the upstream failure is what we report
        error = f"{type(e).__name__}: {e}"
    print(json.dumps({
        "error": error,
        "patched_layers": [
            layer.name for layer in model._flatten_layers(include_self=True)
            if "call" in vars(layer)
        ],
    }))


if __name__ == "__main__":
    main(sys.argv[1], "--without-mpprof" not in sys.argv[2:])
