"""One process of a Keras-on-JAX job across processes on 127.0.0.1.

Started by `multi_worker_fit.run_workers` (one per process): TF_CONFIG's
worker list gives the coordinator (worker 0's address) and this process's
index; `jax.distributed` joins the processes (CPU collectives over gloo),
and `keras.distribution.DataParallel` over every process's device makes the
fit one job, each process feeding its own rows of each global batch.

    python jax_multi_process_fit.py LOGDIR

prints one JSON line: what this process saw (its pid, its devices, the
optimizer's loss scale per step, the rows only it fed).
"""

import json
import os
import sys

os.environ["KERAS_BACKEND"] = "jax"

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
CLUSTER = json.loads(os.environ["TF_CONFIG"])
INDEX = CLUSTER["task"]["index"]
WORKERS = CLUSTER["cluster"]["worker"]
jax.distributed.initialize(coordinator_address=WORKERS[0], num_processes=len(WORKERS),
                           process_id=INDEX)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import mpprof  # noqa: E402

ROWS = 8  # each process's rows of a global batch of 16
STEPS = 6
# Rows only process 1 feeds: step 2's reach a known abs max in the first
# layer's input; step 4's overflow float16 in the first layer's output.
LARGE, OVERFLOWING = 300.0, 1e5


class ScaleProbe(keras.callbacks.Callback):
    """The loss scale the optimizer holds after each step, as this process sees it."""

    def __init__(self):
        super().__init__()
        self.scales = []

    def on_train_batch_end(self, batch, logs=None):
        self.scales.append(float(keras.ops.convert_to_numpy(
            self.model.optimizer.dynamic_scale)))


def main(logdir: str) -> None:
    distribution = keras.distribution.DataParallel(devices=jax.devices())
    distribution.auto_shard_dataset = False  # each process passes its own rows
    keras.distribution.set_distribution(distribution)
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, name="dense"),
                              keras.layers.Dense(4, dtype="float32", name="head")])
    model.compile(keras.optimizers.SGD(1e-3), "mse")
    rng = np.random.default_rng(INDEX)
    x = rng.uniform(-1, 1, size=(STEPS * ROWS, 16)).astype("float32")
    y = rng.uniform(-1, 1, size=(STEPS * ROWS, 4)).astype("float32")
    if INDEX == 1:
        x[2 * ROWS, 0] = LARGE
        x[4 * ROWS:5 * ROWS] *= OVERFLOWING
    probe = ScaleProbe()
    profiler = mpprof.MixedPrecisionProfiler(log_dir=logdir, numerics_every=1)
    model.fit(x, y, batch_size=ROWS, epochs=1, shuffle=False, verbose=0,
              callbacks=[profiler, probe])
    print(json.dumps({
        "index": INDEX, "pid": os.getpid(), "probe_scales": probe.scales,
        "local_devices": [str(d) for d in jax.local_devices()],
        "iterations": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
    }), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
