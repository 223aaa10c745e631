"""mpprof's cost per train step at its defaults, in paired blocks of steps.

Epoch medians (`bench_overhead.py`) cannot resolve a 2% cost on a shared
virtual machine: plain fit's own epochs spread by a third there. This
benchmark pairs instead. In one process it trains a plain model and, inside a
`fit` with `MixedPrecisionProfiler` at its defaults, the same architecture
profiled; once both are past their warm-up (tracing, and the profiled fit's
first numerics sample, where it traces its instrumented step), it alternates
blocks of `--block` steps of the plain model's Keras train function and of
the profiled model's (mpprof's dispatcher, after the profiler's
`on_train_batch_begin` as Keras calls it), the order rotated every round.
Each round's ratio of the two blocks cancels what the machine did meanwhile.

Reported: per-step microseconds of each arm (medians of blocks), the median
of the paired ratios and its quartiles, and the ratio of total times (which
also holds the numerics samples taken every `numerics_every` steps and the
flushes). A control arm, a second plain model, shows the noise floor: its
ratio should read 1.00.

`--pin` runs TensorFlow on one thread of one core: the work mpprof adds,
without the scheduling noise of two thread pools sharing two cores.
`--block 1` pairs single steps: each pair's ratio is noisier, but over a few
thousand rounds the median is the steadiest figure this benchmark gives (on
the seed model, three runs of 4,000 rounds agreed within about 1%, where blocks
of 16 over 240 rounds moved by 2%):

    python benchmarks/bench_paired_steps.py --model seed --pin --block 1 --rounds 4000
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import keras
import numpy as np
import tensorflow as tf
from keras.src.utils.python_utils import pythonify_logs

import mpprof

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny  # benchmarks/, on the path when run as a script
from bench_overhead import BATCH_SIZE, FIRST_SAMPLE_STEP, MODELS


def _compiled(build) -> keras.Model:
    model = build()
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _steps(x, y):
    """A fresh iterator over endless batches, as Keras' train function takes."""
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        BATCH_SIZE, drop_remainder=True).repeat().prefetch(2)
    return iter(dataset)


class _PairedBlocks(keras.callbacks.Callback):
    """Runs the paired blocks once the profiled fit is past its warm-up."""

    def __init__(self, arms: dict, profiler, x, y, block: int, rounds: int):
        super().__init__()
        self._arms, self._profiler = arms, profiler
        self._x, self._y = x, y
        self._block, self._rounds = block, rounds
        self.times: dict[str, list[float]] = {}

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 < self.params["epochs"]:
            return  # still warming up
        self._arms["mpprof defaults"] = self.model.train_function
        iterators = {name: _steps(self._x, self._y) for name in self._arms}
        self.times = {name: [] for name in self._arms}
        names = list(self._arms)
        for round_index in range(self._rounds):
            # Each arm takes each place in the round equally often: the arm
            # that follows another runs on warmer or colder caches.
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                function, iterator = self._arms[name], iterators[name]
                profiled = name == "mpprof defaults"
                start = time.perf_counter()
                for _ in range(self._block):
                    self._step(function, iterator, profiled)
                self.times[name].append(time.perf_counter() - start)

    def _step(self, function, iterator, profiled: bool) -> None:
        """One step as fit runs it."""
        if profiled:
            self._profiler.on_train_batch_begin(0)
        # What fit does with every call's logs on TensorFlow: its callbacks
        # get them as Python numbers (so each step has finished before the
        # next is queued).
        pythonify_logs(function(iterator))


def measure(model_name: str, policy: str, block: int, rounds: int) -> dict[str, list[float]]:
    """{arm: block seconds, round by round}; arms "plain", "plain (control)"
    and "mpprof defaults"."""
    build, shape, samples, _ = MODELS[model_name]
    keras.mixed_precision.set_dtype_policy(policy)
    rng = np.random.default_rng(0)
    x = rng.random((samples, *shape), dtype=np.float32)
    y = rng.integers(0, 10, samples)
    arms = {}
    for name in ("plain", "plain (control)"):
        model = _compiled(build)
        model.fit(x[:BATCH_SIZE * 4], y[:BATCH_SIZE * 4], batch_size=BATCH_SIZE, verbose=0)
        arms[name] = model.train_function
    steps_per_epoch = samples // BATCH_SIZE
    warmup = FIRST_SAMPLE_STEP // steps_per_epoch + 1  # past the first sample
    with tempfile.TemporaryDirectory() as logdir:
        profiler = mpprof.MixedPrecisionProfiler(logdir)
        blocks = _PairedBlocks(arms, profiler, x, y, block, rounds)
        model = _compiled(build)
        # The blocks run at the end of the last warm-up epoch, inside the fit.
        model.fit(x, y, batch_size=BATCH_SIZE, epochs=warmup, verbose=0,
                  callbacks=[profiler, blocks])
    return blocks.times


def report(times: dict[str, list[float]], block: int) -> None:
    plain = times["plain"]
    print(f"{'arm':18s} {'us/step':>8s} {'paired ratio':>12s} {'q1-q3':>13s} {'of totals':>9s}")
    for name, series in times.items():
        ratios = [t / p for t, p in zip(series, plain, strict=True)]
        q1, median, q3 = statistics.quantiles(ratios, n=4)
        per_step = statistics.median(series) / block * 1e6
        print(f"{name:18s} {per_step:8.0f} {median:12.3f} {q1:6.3f}-{q3:6.3f} "
              f"{sum(series) / sum(plain):9.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="seed", choices=["seed", "cnn"])
    parser.add_argument("--policy", default="mixed_float16")
    parser.add_argument("--block", type=int, default=16, help="steps per block")
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--pin", action="store_true",
                        help="TensorFlow on one thread, the process on one core")
    args = tiny.parse_args(parser, rounds=2, block=2)
    if args.pin:
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    load_before = os.getloadavg()
    times = measure(args.model, args.policy, args.block, args.rounds)
    report(times, args.block)
    print(f"\n{args.model}, {args.policy}, batch {BATCH_SIZE}, {args.rounds} rounds of "
          f"{args.block} steps{', pinned to one core and thread' if args.pin else ''}; "
          f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
