"""Overhead of mpprof on training, against plain `model.fit` in the same process.

For each model (the seed's Dense(256)->Dense(10) on MNIST-shaped data, and a
small CNN) and each configuration, a fresh model trains one warm-up epoch
(tracing) and then `--epochs` timed epochs; configurations are interleaved
over `--repeats` rounds. Reported: the median epoch time of each
configuration (over all timed epochs of all repeats) and its ratio to plain
fit, the fastest epoch and its ratio (the least noisy estimate on a shared
machine), and the ratio of total fit time (which includes one-time tracing,
e.g. of the instrumented train function at the first numerics sample).

Configurations: plain fit; mpprof at defaults; mpprof with numerics on every
step; keras.callbacks.TensorBoard(histogram_freq=1); TensorFlow Debugger V2
(`tf.debugging.experimental.enable_dump_debug_info`) in NO_TENSOR and
CONCISE_HEALTH modes.

    python benchmarks/bench_overhead.py --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# oneDNN's float16 kernels are emulated on this kind of CPU (~50x slower
# mixed_float16 steps), which would hide every overhead: use plain kernels.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import keras
import numpy as np
import tensorflow as tf

import mpprof


class EpochTimer(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.times = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.times.append(time.perf_counter() - self._start)


def seed_model() -> keras.Model:
    return keras.Sequential([
        keras.layers.Input((784,)),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(10, dtype="float32"),
    ])


def cnn_model() -> keras.Model:
    return keras.Sequential([
        keras.layers.Input((28, 28, 1)),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(10, dtype="float32"),
    ])


# name: (builder, input shape, samples, initial loss scale or None for the
# default). The "_overflowing" ones start at a loss scale of 2**40: their first
# ~25 steps overflow, as a run whose scale must probe down does, which arms
# forensic numerics samples.
MODELS = {
    "seed": (seed_model, (784,), 32768, None),
    "cnn": (cnn_model, (28, 28, 1), 2048, None),
    "seed_overflowing": (seed_model, (784,), 32768, 2.0**40),
    "cnn_overflowing": (cnn_model, (28, 28, 1), 2048, 2.0**40),
}


def _callbacks(config: str, logdir: str) -> list:
    if config == "mpprof_defaults":
        return [mpprof.MixedPrecisionProfiler(logdir)]
    if config == "mpprof_forensic_unspaced":
        # Forensic samples on every overflowing step (before forensic_spacing).
        return [mpprof.MixedPrecisionProfiler(logdir, forensic_spacing=1)]
    if config == "mpprof_numerics_every_step":
        return [mpprof.MixedPrecisionProfiler(logdir, numerics_every=1)]
    if config == "tensorboard_histograms":
        return [keras.callbacks.TensorBoard(logdir, histogram_freq=1)]
    return []


def run_once(model_name: str, config: str, epochs: int,
             policy: str) -> tuple[list, float, float]:
    """(timed epoch seconds, total fit seconds, warm-up epoch seconds) of one
    fresh fit. The warm-up epoch holds the tracing and, on an overflowing run,
    the overflows of the scale probing down (and their forensic samples)."""
    build, shape, samples, initial_scale = MODELS[model_name]
    keras.mixed_precision.set_dtype_policy(policy)
    rng = np.random.default_rng(0)
    x = rng.random((samples, *shape), dtype=np.float32)
    y = rng.integers(0, 10, samples)
    with tempfile.TemporaryDirectory() as logdir:
        debugger = config.startswith("debugger_")
        if debugger:
            tf.debugging.experimental.enable_dump_debug_info(
                logdir, tensor_debug_mode=config.removeprefix("debugger_").upper(),
                circular_buffer_size=1000,
            )
        try:
            model = build()
            optimizer = "adam" if initial_scale is None else (
                keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(),
                                                    initial_scale=initial_scale))
            model.compile(optimizer=optimizer,
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            timer = EpochTimer()
            start = time.perf_counter()
            model.fit(x, y, batch_size=128, epochs=epochs + 1, verbose=0,
                      callbacks=[*_callbacks(config, logdir), timer])
            total = time.perf_counter() - start
        finally:
            if debugger:
                tf.debugging.experimental.disable_dump_debug_info()
    return timer.times[1:], total, timer.times[0]


CONFIGS = (
    "plain",
    "mpprof_defaults",
    "mpprof_forensic_unspaced",
    "mpprof_numerics_every_step",
    "tensorboard_histograms",
    "debugger_no_tensor",
    "debugger_concise_health",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--models", nargs="+", default=["seed", "cnn"], choices=list(MODELS))
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--policy", default="mixed_float16")
    args = parser.parse_args()
    for model_name in args.models:
        epoch_times = {c: [] for c in args.configs}
        totals = {c: [] for c in args.configs}
        warmups = {c: [] for c in args.configs}
        for _ in range(args.repeats):
            for config in args.configs:
                epochs, total, warmup = run_once(model_name, config, args.epochs, args.policy)
                epoch_times[config].extend(epochs)
                totals[config].append(total)
                warmups[config].append(warmup)
        plain_epoch = statistics.median(epoch_times["plain"])
        plain_fastest = min(epoch_times["plain"])
        plain_total = statistics.median(totals["plain"])
        plain_warmup = statistics.median(warmups["plain"])
        print(f"\n{model_name} ({args.policy}, {args.repeats} repeats x {args.epochs} epochs)")
        print(f"{'configuration':30s} {'epoch s':>9s} {'ratio':>7s} {'added':>8s} "
              f"{'fastest':>8s} {'ratio':>7s} {'fit ratio':>9s} {'warm-up ratio':>13s}")
        for config in args.configs:
            epoch = statistics.median(epoch_times[config])
            fastest = min(epoch_times[config])
            total = statistics.median(totals[config])
            warmup = statistics.median(warmups[config])
            print(f"{config:30s} {epoch:9.3f} {epoch / plain_epoch:7.3f} "
                  f"{epoch - plain_epoch:+8.3f} {fastest:8.3f} {fastest / plain_fastest:7.3f} "
                  f"{total / plain_total:9.3f} {warmup / plain_warmup:13.3f}")


if __name__ == "__main__":
    main()
