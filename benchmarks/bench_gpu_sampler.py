"""Cost of mpprof's NVML sampler: one sampling round, and its overhead on fit.

No GPU is needed: NVML's C library is replaced by tests/fake_nvml.py, so the
figures are the Python side of the sampler (pynvml's wrappers, ctypes, the
ring buffer); a real driver adds its own call latency (microseconds per
query; GPM metric computation somewhat more).

    .venv/bin/python benchmarks/bench_gpu_sampler.py [--repeats 7] [--steps 96]

Part 1 times `GpuSampler.sample_round()` for 1 GPU (GPM), 1 GPU (basic) and
8 GPUs (GPM). Part 2 runs `model.fit` on CPU, interleaving in one process:
plain fit, mpprof with the sampler off, and mpprof with the sampler at 0.5 s
and 0.1 s (fake GPM GPU), and prints the median time of each and the ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import timeit
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import fake_nvml  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import mpprof  # noqa: E402
from mpprof.collectors import gpu  # noqa: E402


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


def build_model():
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    model = keras.Sequential([
        keras.layers.Input((784,)),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(10, dtype="float32"),
    ])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def time_fit(model, x, y, callbacks) -> float:
    start = time.perf_counter()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=callbacks)
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=96, help="train steps per fit")
    parser.add_argument("--log-dir", default="/tmp/mpprof_bench_gpu")
    args = parser.parse_args(argv)

    print("Part 1: one sampling round, fake NVML library (Python side)")
    hopper = fake_nvml.FakeGpu
    for label, gpus in (
        ("1 GPU, gpm", [hopper()]),
        ("1 GPU, basic", [fake_nvml.ampere_gpu()]),
        ("8 GPUs, gpm", [hopper(uuid=f"GPU-{i}") for i in range(8)]),
    ):
        print(f"  {label:14} {time_rounds(gpus):8.1f} us per round")

    print(f"\nPart 2: fit overhead, {args.steps} steps per fit, medians of "
          f"{args.repeats} interleaved runs")
    model = build_model()
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
        for name, make in configs.items():  # warm up: first traces, caches
            time_fit(model, x, y, make())
        for _ in range(args.repeats):
            for name, make in configs.items():
                times[name].append(time_fit(model, x, y, make()))
    rounds = library.calls["nvmlGpmMetricsGet"]
    medians = {name: statistics.median(t) for name, t in times.items()}
    plain, off = medians["plain fit"], medians["mpprof, sampler off"]
    for name, median in medians.items():
        print(f"  {name:22} {median * 1e3:8.1f} ms  x{median / plain:5.3f} vs plain"
              f"  x{median / off:5.3f} vs sampler off"
              f"  (min {min(times[name]) * 1e3:.1f}, max {max(times[name]) * 1e3:.1f})")
    print(f"  GPM readings taken by the samplers in all fits: {rounds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
