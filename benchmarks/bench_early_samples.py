"""What the early numerics samples cost a fit: each fit at the defaults samples
its steps 1, 10 and 100 (`mpprof.recording.sampling.EARLY_SAMPLE_STEPS`), so
that a fit shorter than `numerics_every` is not blind.

Fits of `--steps` steps, each of a fresh model, alternate between mpprof at its
defaults and mpprof with sampling off (`numerics_every=None`): the two differ
only by the samples, whose cost per fit is one trace/compile of the
instrumented step and three instrumented steps. Reported: the median fit
time of each arm, their difference (the early samples' one-time cost) and
the ratio. Per-step costs at the defaults are `bench_paired_steps*.py`'s.

    KERAS_BACKEND=jax python benchmarks/bench_early_samples.py --steps 200
    python benchmarks/bench_early_samples.py --steps 200   # TensorFlow
    python benchmarks/bench_early_samples.py --tiny        # a smoke test
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import keras
import numpy as np
import tiny  # benchmarks/, on the path when run as a script
from bench_models import SHAPES

import mpprof

BATCH_SIZE = 128


def one_fit(model_name: str, steps: int, sampling: bool) -> float:
    build, shape = SHAPES[model_name]
    model = build()
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.random((steps * BATCH_SIZE, *shape), dtype=np.float32)
    y = rng.integers(0, 10, steps * BATCH_SIZE)
    with tempfile.TemporaryDirectory() as logdir:
        # The defaults: numerics_every left out (an interval passed, even 500,
        # has no early samples).
        kwargs = {} if sampling else {"numerics_every": None}
        profiler = mpprof.MixedPrecisionProfiler(logdir, gpu_interval=None, **kwargs)
        start = time.perf_counter()
        model.fit(x, y, batch_size=BATCH_SIZE, epochs=1, verbose=0, callbacks=[profiler])
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="seed", choices=sorted(SHAPES))
    parser.add_argument("--policy", default="mixed_float16")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    # Fits of 12 steps still take the samples at steps 1 and 10.
    args = tiny.parse_args(parser, steps=12, repeats=1)
    keras.mixed_precision.set_dtype_policy(args.policy)
    arms = {"sampling off": False, "defaults": True}
    times = {name: [] for name in arms}
    one_fit(args.model, 4, False)  # the framework's own first-use costs
    for repeat in range(args.repeats):
        order = list(arms) if repeat % 2 == 0 else list(reversed(arms))
        for name in order:
            times[name].append(one_fit(args.model, args.steps, arms[name]))
    off, on = (statistics.median(times[name]) for name in arms)
    print(f"{keras.backend.backend()} {args.model} {args.policy}, fits of {args.steps} steps, "
          f"{args.repeats} repeats")
    print(f"  sampling off: {off:.3f} s   defaults (samples at 1, 10, 100): {on:.3f} s")
    print(f"  early samples cost {on - off:+.3f} s per fit, ratio {on / off:.3f}")


if __name__ == "__main__":
    main()
