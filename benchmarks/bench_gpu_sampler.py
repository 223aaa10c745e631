"""Cost of mpprof's NVML sampler: one sampling round, and its overhead on fit.

No GPU is needed: NVML's C library is replaced by tests/fake_nvml.py, so the
figures are the Python side of the sampler (pynvml's wrappers, ctypes, the
ring buffer); a real driver adds its own call latency (microseconds per
query; GPM metric computation somewhat more).

    .venv/bin/python benchmarks/bench_gpu_sampler.py [--repeats 7] [--steps 96] [--rounds 2000]

Part 1 times `GpuSampler.sample_round()` for 1 GPU (GPM), 1 GPU (basic) and
8 GPUs (GPM), and the CPU share that costs at the default and minimum
intervals. Part 2 runs `model.fit` on CPU, interleaving in one process:
plain fit, mpprof with the sampler off, and mpprof with the sampler at 0.5 s
and 0.1 s (fake GPM GPU). Each fit's figure is its median train-step time
(steps after the first few; fit's one-off setup excluded), and each
configuration's figure the median over the repeats; ratios are of those.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import timeit
from pathlib import Path

import tiny  # benchmarks/, on the path when run as a script

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import fake_nvml  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import mpprof  # noqa: E402
from mpprof.recording.nvml import sampler as gpu  # noqa: E402


def time_rounds(gpus, rounds: int = 2000) -> float:
    """Median microseconds per sampling round over 5 batches of `rounds`."""
    library = fake_nvml.FakeNvmlLibrary(gpus)
    with fake_nvml.installed(library):
        sampler = gpu.GpuSampler(600, environ={}, capacity_rows=4096)
        sampler.start()  # the thread waits 600 s: only this loop samples
        timer = timeit.Timer(sampler.sample_round)
        batches = timer.repeat(repeat=5, number=rounds)
        sampler.stop()
    return statistics.median(batches) / rounds * 1e6


def build_model(policy: str):
    # mixed_float16 is emulated on most CPUs (~100 ms a step here): the
    # default mixed_bfloat16 keeps steps short, so more runs fit in the time.
    keras.mixed_precision.set_dtype_policy(policy)
    model = keras.Sequential([
        keras.layers.Input((784,)),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(10, dtype="float32"),
    ])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class _StepTimer(keras.callbacks.Callback):
    """Times every train step from batch begin to batch end."""

    def __init__(self):
        super().__init__()
        self.times = []

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._start)


def time_fit(model, x, y, callbacks, skip: int = 5) -> float:
    """Median step time of one fit, skipping its first `skip` steps."""
    timer = _StepTimer()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[timer, *callbacks])
    return statistics.median(timer.times[skip:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=2048, help="train steps per fit")
    parser.add_argument("--rounds", type=int, default=2000,
                        help="sampling rounds per timed batch of part 1 (5 batches)")
    parser.add_argument("--policy", default="mixed_bfloat16")
    parser.add_argument("--log-dir", default="/tmp/mpprof_bench_gpu")
    parser.add_argument("--tf-threads", type=int, default=1,
                        help="TensorFlow intra/inter-op threads (0: TF's default); "
                        "1 keeps spinning thread pools from drowning the figures "
                        "on a shared machine")
    args = tiny.parse_args(parser, argv, repeats=1, steps=16, rounds=20)
    if args.tf_threads:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(args.tf_threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.tf_threads)

    print("Part 1: one sampling round, fake NVML library (Python side)")
    hopper = fake_nvml.FakeGpu
    for label, gpus in (
        ("1 GPU, gpm", [hopper()]),
        ("1 GPU, basic", [fake_nvml.ampere_gpu()]),
        ("8 GPUs, gpm", [hopper(uuid=f"GPU-{i}") for i in range(8)]),
    ):
        cost = time_rounds(gpus, args.rounds)
        print(f"  {label:14} {cost:8.1f} us per round = "
              f"{cost / 1e6 / gpu.DEFAULT_INTERVAL_S:.4%} of one core at "
              f"{gpu.DEFAULT_INTERVAL_S} s, "
              f"{cost / 1e6 / gpu.MIN_INTERVAL_S:.4%} at {gpu.MIN_INTERVAL_S} s")

    print(f"\nPart 2: fit overhead, {args.steps} steps per fit, medians of "
          f"{args.repeats} interleaved runs, {args.policy}, "
          f"TF threads {args.tf_threads or 'default'}")
    model = build_model(args.policy)
    rng = np.random.default_rng(0)
    x = rng.random((32 * args.steps, 784), dtype=np.float32)
    y = rng.integers(0, 10, 32 * args.steps)
    library = fake_nvml.FakeNvmlLibrary([hopper()])
    configs = {
        "plain fit": lambda: [],
        "mpprof, sampler off": lambda: [
            mpprof.MixedPrecisionProfiler(args.log_dir, gpu_interval=None)],
        "mpprof, sampler 0.5 s": lambda: [
            mpprof.MixedPrecisionProfiler(args.log_dir, gpu_interval=0.5)],
        "mpprof, sampler 0.1 s": lambda: [
            mpprof.MixedPrecisionProfiler(args.log_dir, gpu_interval=0.1)],
    }
    times = {name: [] for name in configs}
    with fake_nvml.installed(library):
        for make in configs.values():  # warm up: first traces, caches
            time_fit(model, x, y, make())
        for _ in range(args.repeats):
            for name, make in configs.items():
                times[name].append(time_fit(model, x, y, make()))
    rounds = library.calls["nvmlGpmMetricsGet"]
    medians = {name: statistics.median(t) for name, t in times.items()}
    plain, off = medians["plain fit"], medians["mpprof, sampler off"]
    for name, median in medians.items():
        print(f"  {name:22} {median * 1e3:7.2f} ms/step  x{median / plain:5.3f} vs "
              f"plain  x{median / off:5.3f} vs sampler off  (runs: "
              + ", ".join(f"{t * 1e3:.2f}" for t in times[name]) + ")")
    print(f"  GPM readings taken by the samplers in all fits: {rounds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
