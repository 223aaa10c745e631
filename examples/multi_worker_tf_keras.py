"""tf-keras (Keras 2) across two local workers with MultiWorkerMirroredStrategy.

Starts two worker processes on 127.0.0.1 (free ports, one TF_CONFIG each), and
each trains the same mixed_float16 model with the profiler. The chief writes
the model-level records into LOG_DIR/train, every worker its own run
LOG_DIR/train/worker_<i>. Needs tf-keras (`pip install mpprof[tf-keras]`).

    python examples/multi_worker_tf_keras.py --log-dir logs/multi_worker
    mpprof diagnose logs/multi_worker

On real machines, run the worker part (`--worker`) once per host with that
host's TF_CONFIG instead.
"""

import argparse
import json
import os
import socket
import subprocess
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-dir", default="logs/multi_worker")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--worker", action="store_true",
                        help="train as one worker (TF_CONFIG must be set)")
    args = parser.parse_args()
    if args.worker:
        train(args.log_dir, args.epochs)
    else:
        launch(args.workers, [sys.executable, os.path.abspath(__file__), "--worker",
                              "--log-dir", args.log_dir, "--epochs", str(args.epochs)])
        print(f"Done: mpprof diagnose {args.log_dir}   or   tensorboard --logdir {args.log_dir}")


def launch(workers: int, command: list[str], timeout_s: float = 600) -> None:
    """Runs `command` as `workers` local workers; kills them all on any failure."""
    ports = []
    for _ in range(workers):  # free loopback ports, as the OS hands them out
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    processes = []
    try:
        for index in range(workers):
            config = {"cluster": cluster, "task": {"type": "worker", "index": index}}
            env = {**os.environ, "TF_CONFIG": json.dumps(config)}
            processes.append(subprocess.Popen(command, env=env))
        for index, process in enumerate(processes):
            if process.wait(timeout=timeout_s) != 0:
                raise SystemExit(f"worker {index} failed with exit code {process.returncode}")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def train(log_dir: str, epochs: int) -> None:
    # tf-keras must be chosen before TensorFlow is imported.
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import numpy as np
    import tensorflow as tf
    import tf_keras

    import mpprof

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    tf_keras.mixed_precision.set_global_policy("mixed_float16")
    with strategy.scope():
        model = tf_keras.Sequential([
            tf_keras.layers.Input((64,)),
            tf_keras.layers.Dense(128, activation="relu"),
            tf_keras.layers.Dense(1, dtype="float32"),  # float32 output for the loss
        ])
        # An initial scale of 2**30 overflows at first: the records show the
        # scale halving and the skipped steps, the same on every worker.
        optimizer = tf_keras.mixed_precision.LossScaleOptimizer(
            tf_keras.optimizers.SGD(1e-4), initial_scale=2.0**30, dynamic_growth_steps=20
        )
        model.compile(optimizer=optimizer, loss="mse")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2048, 64)).astype("float32")
    y = np.full((2048, 1), 1000.0, dtype="float32")
    model.fit(x, y, batch_size=64, epochs=epochs, verbose=2,
              callbacks=[mpprof.MixedPrecisionProfiler(log_dir=log_dir)])


if __name__ == "__main__":
    main()
