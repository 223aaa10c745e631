"""Added cost of float8 recording (shares included) on a float8 model.

The seed's Dense(256)->Dense(10) quantized with `model.quantize("float8")`
trains one warm-up epoch (tracing) and then `--epochs` timed epochs, under
three interleaved configurations (each round in another order): plain fit;
mpprof with its float8 collectors switched off (they find no float8 layers);
mpprof with float8 recording: the scales and amax histories at each flush,
and the saturation/underflow shares measured in-graph on the steps sampled
every `--numerics-every` steps.
Reported: each configuration's median epoch time and the ratios of medians
of float8 recording to plain fit and to mpprof without it (the cost of float8
recording alone); and the host time the float8 collectors took per epoch
(the batched reads of every scale and amax history, the replays, the reads
of the share table), the direct measure, which the noise of a shared machine
does not blur. The shares' in-graph work shows in the epoch times only. On a
machine whose cores other work takes now and then, epoch times are bimodal
(every configuration's, plain fit's too): the ratio of the fastest epochs is
printed beside the ratio of medians.

    python benchmarks/bench_float8.py --repeats 3 --flush-every-steps 50 --numerics-every 50
"""

from __future__ import annotations

import argparse
import os
import statistics
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
from mpprof.backends import float8_replay
from mpprof.backends import float8_shares as shares_core
from mpprof.backends.tensorflow import float8 as float8_collector
from mpprof.backends.tensorflow import float8_shares


def float8_model() -> keras.Model:
    model = keras.Sequential([
        keras.layers.Input((784,)),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.quantize("float8")
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


# The host-side methods of the float8 collectors, timed.
_TIMED = (
    (float8_collector.Float8State, "install"),
    (float8_collector.Float8State, "flush"),
    (float8_shares.Float8Shares, "install"),
    (float8_shares.Float8Shares, "after_sample"),
)


class _CollectorClock:
    """Seconds spent in the float8 collectors' host-side methods (`_TIMED`)."""

    def __init__(self):
        self.seconds = 0.0
        self._originals = []

    def __enter__(self):
        for owner, name in _TIMED:
            original = getattr(owner, name)
            self._originals.append((owner, name, original))

            def timed(collector, *args, _original=original):
                start = time.perf_counter()
                try:
                    return _original(collector, *args)
                finally:
                    self.seconds += time.perf_counter() - start

            setattr(owner, name, timed)
        return self

    def __exit__(self, *exc):
        for owner, name, original in self._originals:
            setattr(owner, name, original)


def run(config: str, x, y, epochs: int, flush_every_steps: int,
        numerics_every: int) -> tuple[list[float], float]:
    """Timed epoch times of one fresh fit under `config`, and the seconds its
    float8 collectors took (over all epochs, the warm-up one included)."""
    model = float8_model()
    timer = EpochTimer()
    callbacks = [timer]
    find_layers = float8_replay.float8_layers
    if config != "plain":
        callbacks.append(mpprof.MixedPrecisionProfiler(
            log_dir=tempfile.mkdtemp(), flush_every_steps=flush_every_steps,
            numerics_every=numerics_every,
        ))
    if config == "mpprof_no_float8":
        float8_replay.float8_layers = shares_core.float8_layers = lambda model: []
    try:
        with _CollectorClock() as clock:
            model.fit(x, y, batch_size=32, epochs=epochs + 1, verbose=0, callbacks=callbacks)
    finally:
        float8_replay.float8_layers = shares_core.float8_layers = find_layers
    return timer.times[1:], clock.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--flush-every-steps", type=int, default=50)
    parser.add_argument("--numerics-every", type=int, default=50)
    args = tiny.parse_args(parser, repeats=1, epochs=1, samples=256, flush_every_steps=4,
                           numerics_every=4)
    rng = np.random.default_rng(0)
    x = rng.random((args.samples, 784), dtype=np.float32)
    y = rng.integers(0, 10, args.samples)
    configs = ("plain", "mpprof_no_float8", "mpprof_float8")
    times = {config: [] for config in configs}
    collector_seconds = []
    for repeat in range(args.repeats):
        # Each round starts with another configuration: no order effect.
        for config in configs[repeat % 3:] + configs[:repeat % 3]:
            epoch_times, seconds = run(config, x, y, args.epochs, args.flush_every_steps,
                                       args.numerics_every)
            times[config] += epoch_times
            if config == "mpprof_float8":
                collector_seconds.append(seconds / (args.epochs + 1))
    medians = {config: statistics.median(t) for config, t in times.items()}
    steps = args.samples // 32
    print(f"float8 seed model, {steps} steps/epoch, flush every {args.flush_every_steps} "
          f"steps, a sampled step (numerics and float8 shares) every {args.numerics_every} "
          f"steps, {args.repeats} x {args.epochs} timed epochs")
    fastest = {config: min(t) for config, t in times.items()}
    for config in configs:
        print(f"  {config:18s} median epoch {medians[config] * 1e3:8.1f} ms, "
              f"fastest {fastest[config] * 1e3:8.1f} ms")
    print(f"  mpprof with float8 recording / plain fit: "
          f"{medians['mpprof_float8'] / medians['plain']:.3f} (ratio of medians)")
    print(f"  mpprof without float8 / plain fit:        "
          f"{medians['mpprof_no_float8'] / medians['plain']:.3f}")
    print(f"  float8 recording alone (with / without):  "
          f"{medians['mpprof_float8'] / medians['mpprof_no_float8']:.3f}")
    print(f"  fastest epochs, float8 / plain: {fastest['mpprof_float8'] / fastest['plain']:.3f}, "
          f"float8 / without: {fastest['mpprof_float8'] / fastest['mpprof_no_float8']:.3f}")
    per_epoch = statistics.median(collector_seconds)
    print(f"  float8 collectors' host time per epoch: {per_epoch * 1e3:.1f} ms = "
          f"{per_epoch / medians['mpprof_float8']:.2%} of the median epoch")


if __name__ == "__main__":
    main()
