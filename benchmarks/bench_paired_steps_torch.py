"""mpprof's cost per train step on Keras' PyTorch backend, in paired blocks of steps.

The PyTorch counterpart of `bench_paired_steps_jax.py`: in one process it
trains a plain model and, inside a `fit` with `MixedPrecisionProfiler` at its
defaults, the same architecture profiled; once both are warm it alternates
blocks of `--block` steps of the plain model's own train function and of the
profiled one (mpprof's dispatcher, after the profiler's
`on_train_batch_begin`, as fit calls them), the order rotated every round.
PyTorch runs each step eagerly: a block's time is what its steps took,
read twice, on the wall clock and as this process's CPU time (with `--pin`,
one core and one torch thread: the CPU time leaves out the time other
processes of a loaded machine took from it). A control arm, a second plain
model, shows the noise floor (ratio 1.00).

    KERAS_BACKEND=torch python benchmarks/bench_paired_steps_torch.py --rounds 300
    python benchmarks/bench_paired_steps_torch.py --tiny   # a smoke test
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import os
import statistics
import tempfile
import time

os.environ["KERAS_BACKEND"] = "torch"
if "--pin" in os.sys.argv:
    # One core and one torch thread: the work mpprof adds, without the
    # scheduling noise of thread pools sharing a loaded machine's cores.
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})

import keras
import numpy as np
import tiny  # benchmarks/, on the path when run as a script
import torch
from bench_models import SHAPES

import mpprof

BATCH_SIZE = 128
# The profiled fit's first numerics sample, at the profiler's defaults.
FIRST_SAMPLE_STEP = inspect.signature(
    mpprof.MixedPrecisionProfiler).parameters["numerics_every"].default


def _compiled(build) -> keras.Model:
    model = build()
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _batches(x, y) -> list:
    """The batches as Keras' PyTorch fit hands them to its train function:
    a list of one (x, y) of tensors on its device."""
    device = keras.src.backend.torch.core.get_device()
    return [[(torch.as_tensor(x[i:i + BATCH_SIZE], device=device),
              torch.as_tensor(y[i:i + BATCH_SIZE], device=device))]
            for i in range(0, len(x), BATCH_SIZE)]


class _PairedBlocks(keras.callbacks.Callback):
    """Runs the paired blocks at the end of the profiled fit's last epoch."""

    def __init__(self, arms: dict, profiler, batches: list, block: int, rounds: int):
        super().__init__()
        self._arms, self._profiler, self._batches = arms, profiler, batches
        self._block, self._rounds = block, rounds
        self.times: dict[str, list[float]] = {}
        self.cpu_times: dict[str, list[float]] = {}

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 < self.params["epochs"]:
            return
        self._arms["mpprof defaults"] = self.model.train_function
        iterators = {name: itertools.cycle(self._batches) for name in self._arms}
        self.times = {name: [] for name in self._arms}
        self.cpu_times = {name: [] for name in self._arms}
        names = list(self._arms)
        synchronize = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        for round_index in range(self._rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                function, iterator = self._arms[name], iterators[name]
                profiled = name == "mpprof defaults"
                synchronize()
                start, cpu_start = time.perf_counter(), time.process_time()
                for _ in range(self._block):
                    if profiled:
                        self._profiler.on_train_batch_begin(0)
                    function(next(iterator))
                synchronize()
                self.times[name].append(time.perf_counter() - start)
                self.cpu_times[name].append(time.process_time() - cpu_start)


def measure(policy: str, block: int, rounds: int, samples: int = 16384,
            past_first_sample: bool = True, model_name: str = "seed") -> dict:
    """{"wall"|"cpu": {arm: block seconds, round by round}};
    `past_first_sample=False` warms up two epochs only (a smoke test: the
    first sample may fall in the blocks)."""
    keras.mixed_precision.set_dtype_policy(policy)
    rng = np.random.default_rng(0)
    build, shape = SHAPES[model_name]
    x = rng.random((samples, *shape), dtype=np.float32)
    y = rng.integers(0, 10, samples)
    batches = _batches(x, y)
    # Warm-up past the first numerics sample, then the blocks at the last
    # epoch's end. Every arm trains as long first, so that all three step on
    # equally trained weights: with plain arms warmed up for 4 steps only,
    # the profiled arm measured 1.045x on the CPU clock (control 1.015), with
    # equal warm-ups 1.011x (control 1.004), the same day.
    steps_per_epoch = len(batches)
    epochs = FIRST_SAMPLE_STEP // steps_per_epoch + 2 if past_first_sample else 2
    arms = {}
    for name in ("plain", "plain (control)"):
        model = _compiled(build)
        model.fit(x, y, batch_size=BATCH_SIZE, epochs=epochs, verbose=0)
        model.train()  # as fit sets it for each epoch
        arms[name] = model.train_function
    with tempfile.TemporaryDirectory() as logdir:
        profiler = mpprof.MixedPrecisionProfiler(logdir)
        blocks = _PairedBlocks(arms, profiler, batches, block, rounds)
        model = _compiled(build)
        model.fit(x, y, batch_size=BATCH_SIZE, epochs=epochs, verbose=0,
                  callbacks=[profiler, blocks])
    return {"wall": blocks.times, "cpu": blocks.cpu_times}


def report(times: dict[str, list[float]], block: int) -> dict:
    plain = times["plain"]
    result = {}
    print(f"{'arm':18s} {'us/step':>8s} {'paired ratio':>12s} {'q1-q3':>13s} {'of totals':>9s}")
    for name, series in times.items():
        ratios = [t / p for t, p in zip(series, plain, strict=True)]
        q1, median, q3 = statistics.quantiles(ratios, n=4)
        per_step = statistics.median(series) / block * 1e6
        total = sum(series) / sum(plain)
        print(f"{name:18s} {per_step:8.0f} {median:12.3f} {q1:6.3f}-{q3:6.3f} {total:9.3f}")
        result[name] = {"us_per_step": per_step, "paired_ratio": median,
                        "q1": q1, "q3": q3, "ratio_of_totals": total}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="seed", choices=sorted(SHAPES))
    parser.add_argument("--policy", default="mixed_float16")
    parser.add_argument("--block", type=int, default=16, help="steps per block")
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--samples", type=int, default=16384, help="the data set's size")
    parser.add_argument("--pin", action="store_true",
                        help="one core and one torch thread (read before torch runs)")
    args = tiny.parse_args(parser, rounds=2, block=2, samples=512)
    if args.pin:
        torch.set_num_threads(1)
    load_before = os.getloadavg()
    measured = measure(args.policy, args.block, args.rounds, samples=args.samples,
                       past_first_sample=not args.tiny, model_name=args.model)
    for clock, times in measured.items():
        print(f"\n{clock} clock")
        report(times, args.block)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"\n{args.model} model, {args.policy}, batch {BATCH_SIZE}, {args.rounds} rounds of "
          f"{args.block} steps on {device} (torch {torch.__version__}); load average before "
          f"{load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
