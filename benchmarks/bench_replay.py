"""Replay captures and replays: what they cost.

The seed's Dense(256)->Dense(10) model in mixed_float16 with its first
kernel initialised to 300, so that its float16 MatMul overflows on every
step (ones-like inputs in [0, 1) times 784 times 300 > 65504): every sampled
step is captured, up to the budget. Measured:

- capture cost on the overflowing step: the seconds the capture took on the
  host (reading the batch and the weights, serializing, writing), per
  capture, and the median time of the sampled train call with
  `replay_budget=2` against `replay_budget=0`;
- disk per capture, for each batch size;
- replay time: `mpprof.replay.replay(LOGDIR)` (TensorFlow already imported),
  and `mpprof replay LOGDIR --format json` on an already replayed capture
  (a fresh process, no TensorFlow);
- healthy runs: the median epoch time of the healthy seed model with
  `replay_budget=2` (the default) against 0 (nothing may change).

    python benchmarks/bench_replay.py --batch-sizes 32 256 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Plain kernels, as the tests and the other benchmarks use.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import keras
import numpy as np
import tiny  # benchmarks/, on the path when run as a script
from bench_overhead import EpochTimer

import mpprof
from mpprof.backends.tensorflow import replay_capture
from mpprof.backends.tensorflow.train_functions import TrainFunctions
from mpprof.replay import files, replay


def seed_model(first_kernel: float | None) -> keras.Model:
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    initializer = (keras.initializers.Constant(first_kernel) if first_kernel is not None
                   else "glorot_uniform")
    model = keras.Sequential([
        keras.layers.Input((784,)),
        keras.layers.Dense(256, activation="relu", kernel_initializer=initializer),
        keras.layers.Dense(10, dtype="float32"),
    ])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class _Clock:
    """Seconds spent in one method of a class, per call."""

    def __init__(self, owner, name: str):
        self.calls: list[float] = []
        self._owner, self._name = owner, name
        self._original = getattr(owner, name)

    def __enter__(self):
        original, calls = self._original, self.calls

        def timed(obj, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(obj, *args, **kwargs)
            finally:
                calls.append(time.perf_counter() - start)

        setattr(self._owner, self._name, timed)
        return self

    def __exit__(self, *exc):
        setattr(self._owner, self._name, self._original)


def capture_run(batch_size: int, budget: int, x, y) -> dict:
    """One fit of the overflowing model; what its captures cost."""
    logdir = tempfile.mkdtemp()
    model = seed_model(first_kernel=300.0)
    profiler = mpprof.MixedPrecisionProfiler(logdir, numerics_every=4, replay_budget=budget,
                                             forensic_spacing=1)
    with _Clock(replay_capture.ReplayCapture, "_write") as write, \
            _Clock(TrainFunctions, "run_instrumented") as sampled:
        model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0, callbacks=[profiler])
    captures = files.find_captures(logdir, "train")
    disk = [sum(os.path.getsize(os.path.join(c.path, n)) for n in os.listdir(c.path))
            for c in captures]
    return {"logdir": logdir, "write_s": write.calls, "sampled_s": sampled.calls[1:],
            "disk": disk, "manifests": [c.manifest for c in captures]}


def healthy_epochs(budget: int, x, y, epochs: int) -> list[float]:
    model = seed_model(first_kernel=None)
    timer = EpochTimer()
    model.fit(x, y, batch_size=32, epochs=epochs + 1, verbose=0, callbacks=[
        timer, mpprof.MixedPrecisionProfiler(tempfile.mkdtemp(), replay_budget=budget)])
    return timer.times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8192)
    args = tiny.parse_args(parser, batch_sizes=[32], repeats=1, epochs=1, samples=1280)
    rng = np.random.default_rng(0)
    x = rng.random((args.samples, 784), dtype=np.float32)
    y = rng.integers(0, 10, args.samples)

    print("Capture on the overflowing step (seed model, first kernel 300, "
          f"{(784 * 256 + 256 + 2570) * 4 / 1e6:.2f} MB of weights):")
    replayed = None
    for batch_size in args.batch_sizes:
        samples = batch_size * 40
        with_capture = capture_run(batch_size, 2, x[:samples], y[:samples])
        without = capture_run(batch_size, 0, x[:samples], y[:samples])
        manifest = with_capture["manifests"][0]
        write_ms = statistics.median(with_capture["write_s"]) * 1e3
        print(f"  batch {batch_size:4d}: capture {write_ms:6.1f} ms each (host); sampled "
              "overflowing call "
              f"{statistics.median(with_capture['sampled_s']) * 1e3:6.1f} ms with "
              f"replay_budget=2, {statistics.median(without['sampled_s']) * 1e3:6.1f} ms with 0; "
              f"disk {statistics.median(with_capture['disk']) / 1e6:.3f} MB per capture "
              f"(batch {manifest['batch_bytes'] / 1e6:.3f} MB, weights "
              f"{manifest['weight_bytes'] / 1e6:.3f} MB)")
        replayed = with_capture["logdir"]

    start = time.perf_counter()
    result = replay(replayed)
    replay_s = time.perf_counter() - start
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "mpprof.cli", "replay", replayed, "--format", "json"],
                   check=True, capture_output=True)
    saved_s = time.perf_counter() - start
    first = result["first_op"] or {}
    print(f"Replay (batch {args.batch_sizes[-1]}): {replay_s:.2f} s in-process "
          f"({first.get('op')} in {first.get('layer')}; verified {result['verified']}); "
          f"`mpprof replay --format json` of the saved result: {saved_s:.2f} s (a fresh "
          "process, no TensorFlow)")

    times = {0: [], 2: []}
    for repeat in range(args.repeats):
        for budget in ((0, 2) if repeat % 2 else (2, 0)):
            times[budget] += healthy_epochs(budget, x, y, args.epochs)
    medians = {budget: statistics.median(t) for budget, t in times.items()}
    print(f"Healthy seed model, {args.samples // 32} steps/epoch, {args.repeats} x "
          f"{args.epochs} timed epochs: median epoch {medians[2] * 1e3:.1f} ms with "
          f"replay_budget=2, {medians[0] * 1e3:.1f} ms with 0 "
          f"(ratio {medians[2] / medians[0]:.3f})")


if __name__ == "__main__":
    main()
