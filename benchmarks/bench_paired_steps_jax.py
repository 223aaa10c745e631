"""mpprof's cost per train step on Keras' JAX backend, in paired blocks of steps.

The JAX counterpart of `bench_paired_steps.py` (which needs TensorFlow): in
one process it trains a plain model and, inside a `fit` with
`MixedPrecisionProfiler` at its defaults, the same architecture profiled;
once both are warm it alternates blocks of `--block` steps of the plain
model's own jitted train function and of the profiled one (mpprof's
dispatcher, after the profiler's `on_train_batch_begin`, as fit calls them),
the order rotated every round. A block ends when its last step's state is
ready (`jax.block_until_ready`): JAX dispatches asynchronously, as fit does,
and the block's time is what the device and the host took for it. A control
arm, a second plain model, shows the noise floor (ratio 1.00).

    KERAS_BACKEND=jax python benchmarks/bench_paired_steps_jax.py --rounds 300
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import os
import statistics
import tempfile
import time

os.environ["KERAS_BACKEND"] = "jax"
if "--pin" in os.sys.argv:
    # One core, XLA's CPU client on one thread: the work mpprof adds, without
    # the scheduling noise of thread pools sharing a loaded machine's cores.
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_cpu_multi_thread_eigen=false"
                               " intra_op_parallelism_threads=1")

import jax
import keras
import numpy as np
import tiny  # benchmarks/, on the path when run as a script
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

def _state(model):
    """The model's state as fit passes it (from the variables, left in place)."""
    return model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                optimizer_variables=True, metrics_variables=True)


class _PairedBlocks(keras.callbacks.Callback):
    """Runs the paired blocks at the end of the profiled fit's last epoch."""

    def __init__(self, arms: dict, profiler, batches: list, block: int, rounds: int):
        super().__init__()
        self._arms, self._profiler, self._batches = arms, profiler, batches
        self._block, self._rounds = block, rounds
        self.times: dict[str, list[float]] = {}

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 < self.params["epochs"]:
            return
        model = self._model  # (not self.model: no state sync wanted here)
        self._arms["mpprof defaults"] = (model.train_function, _state(model))
        functions = {name: f for name, (f, _) in self._arms.items()}
        states = {name: s for name, (_, s) in self._arms.items()}
        iterators = {name: itertools.cycle(self._batches) for name in self._arms}
        self.times = {name: [] for name in self._arms}
        names = list(self._arms)
        for round_index in range(self._rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                function, iterator, state = functions[name], iterators[name], states[name]
                profiled = name == "mpprof defaults"
                start = time.perf_counter()
                for _ in range(self._block):
                    if profiled:
                        self._profiler.on_train_batch_begin(0)
                    _, state = function(state, iterator)
                jax.block_until_ready(state)
                self.times[name].append(time.perf_counter() - start)
                states[name] = state
        # The profiled fit goes on from the state the blocks left.
        model._jax_state = dict(zip(("trainable_variables", "non_trainable_variables",
                                     "optimizer_variables", "metrics_variables"),
                                    states["mpprof defaults"], strict=True))
        model._jax_state_synced = False


def measure(policy: str, block: int, rounds: int, samples: int = 16384,
            past_first_sample: bool = True, model_name: str = "seed") -> dict:
    """{arm: block seconds, round by round}; `past_first_sample=False` warms
    up two epochs only (a smoke test: the first sample may fall in the blocks)."""
    keras.mixed_precision.set_dtype_policy(policy)
    rng = np.random.default_rng(0)
    build, shape = SHAPES[model_name]
    x = rng.random((samples, *shape), dtype=np.float32)
    y = rng.integers(0, 10, samples)
    batches = [(x[i:i + BATCH_SIZE], y[i:i + BATCH_SIZE])
               for i in range(0, samples, BATCH_SIZE)]
    arms = {}
    for name in ("plain", "plain (control)"):
        model = _compiled(build)
        model.fit(x[:BATCH_SIZE * 4], y[:BATCH_SIZE * 4], batch_size=BATCH_SIZE, verbose=0)
        arms[name] = (model.train_function, _state(model))
    with tempfile.TemporaryDirectory() as logdir:
        profiler = mpprof.MixedPrecisionProfiler(logdir)
        blocks = _PairedBlocks(arms, profiler, batches, block, rounds)
        model = _compiled(build)
        # Warm-up past the first numerics sample (where the instrumented step
        # is compiled, once per fit), then the blocks at the last epoch's end.
        steps_per_epoch = len(batches)
        epochs = FIRST_SAMPLE_STEP // steps_per_epoch + 2 if past_first_sample else 2
        model.fit(x, y, batch_size=BATCH_SIZE, epochs=epochs, verbose=0,
                  callbacks=[profiler, blocks])
    return blocks.times


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
    parser.add_argument("--pin", action="store_true",
                        help="one core, XLA on one thread (read before jax is imported)")
    args = tiny.parse_args(parser, rounds=2, block=2)
    load_before = os.getloadavg()
    report(measure(args.policy, args.block, args.rounds, model_name=args.model), args.block)
    print(f"\n{args.model} model, {args.policy}, batch {BATCH_SIZE}, {args.rounds} rounds of "
          f"{args.block} steps on {jax.devices()[0].platform}; load average before "
          f"{load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
