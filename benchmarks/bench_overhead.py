"""Overhead of mpprof on training, against plain `model.fit` in the same process.

For each model (the seed's Dense(256)->Dense(10) on MNIST-shaped data, and a
small CNN) and each configuration, a fresh model trains warm-up epochs (the
tracing; on the seed model also mpprof's first numerics sample, where it
traces its instrumented step: one-time costs, kept in the "fit" column) and
then `--epochs` timed epochs; configurations are interleaved
over `--repeats` rounds. Reported: the median epoch time of each
configuration (over all timed epochs of all repeats), its quartiles (the
spread) and its ratio to plain fit; the same of the process's CPU seconds
per epoch (every thread: on a machine shared with other work, the steadier
measure of added work); the fastest epoch and its ratio, the
ratio of total fit time (which includes one-time tracing, e.g. of the
instrumented train function at the first numerics sample), and the machine's
load average before and after.

`--baseline DIR` measures another mpprof source tree (a `git worktree` of
main) in the same session: each repeat runs every configuration once under
each tree, each in its own process, the trees' order alternating, and a last
table sets each configuration's ratio and added seconds per epoch before and
after side by side.

Epoch medians cannot resolve a cost of a few percent on a shared machine:
`bench_paired_steps.py` measures mpprof's cost per step at its defaults.

Configurations: plain fit; mpprof at defaults; mpprof with numerics on every
step; keras.callbacks.TensorBoard(histogram_freq=1); TensorFlow Debugger V2
(`tf.debugging.experimental.enable_dump_debug_info`) in NO_TENSOR and
CONCISE_HEALTH modes.

    python benchmarks/bench_overhead.py --repeats 5
    git worktree add /tmp/main main
    python benchmarks/bench_overhead.py --baseline /tmp/main --models cnn \
        --configs plain mpprof_numerics_every_step debugger_concise_health
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# oneDNN's float16 kernels are emulated on this kind of CPU (~50x slower
# mixed_float16 steps), which would hide every overhead: use plain kernels.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import keras
import numpy as np
import tensorflow as tf
import tiny  # benchmarks/, on the path when run as a script
from bench_models import cnn_model, seed_model

import mpprof


class EpochTimer(keras.callbacks.Callback):
    """Each epoch's wall seconds (`times`) and this process's CPU seconds
    (`cpu_times`, every thread): on a machine shared with other work the CPU
    seconds a configuration adds are the steadier measure, as others' load
    stretches wall time but not the work done."""

    def __init__(self):
        super().__init__()
        self.times = []
        self.cpu_times = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()
        self._cpu_start = time.process_time()

    def on_epoch_end(self, epoch, logs=None):
        self.times.append(time.perf_counter() - self._start)
        self.cpu_times.append(time.process_time() - self._cpu_start)


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


BATCH_SIZE = 128
# mpprof traces its instrumented step at the first numerics sample (this step
# at the defaults): a one-time cost per fit, like the first trace.
FIRST_SAMPLE_STEP = inspect.signature(
    mpprof.MixedPrecisionProfiler).parameters["numerics_every"].default


def warmup_epochs(steps_per_epoch: int, timed_epochs: int) -> int:
    """One epoch, or as many as it takes to pass the first numerics sample
    when the timed epochs would reach it: the timed epochs then show the
    cost per step, and the "fit" column keeps the one-time costs."""
    if (1 + timed_epochs) * steps_per_epoch <= FIRST_SAMPLE_STEP:
        return 1
    return FIRST_SAMPLE_STEP // steps_per_epoch + 1


def run_once(model_name: str, config: str, epochs: int, policy: str) -> dict:
    """{"epochs", "cpu_epochs": timed epochs' wall and CPU seconds, "totals":
    [total fit seconds], "warmups": [warm-up seconds]} of one fresh fit.
    The warm-up holds the tracing (`warmup_epochs`) and, on an overflowing
    run, the overflows of the scale probing down (and their forensic
    samples)."""
    build, shape, samples, initial_scale = MODELS[model_name]
    warmup = warmup_epochs(-(-samples // BATCH_SIZE), epochs)
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
            model.fit(x, y, batch_size=BATCH_SIZE, epochs=warmup + epochs, verbose=0,
                      callbacks=[*_callbacks(config, logdir), timer])
            total = time.perf_counter() - start
        finally:
            if debugger:
                tf.debugging.experimental.disable_dump_debug_info()
    return {"epochs": timer.times[warmup:], "cpu_epochs": timer.cpu_times[warmup:],
            "totals": [total], "warmups": [sum(timer.times[:warmup])]}


CONFIGS = (
    "plain",
    "mpprof_defaults",
    "mpprof_forensic_unspaced",
    "mpprof_numerics_every_step",
    "tensorboard_histograms",
    "debugger_no_tensor",
    "debugger_concise_health",
)


def collect(args) -> dict:
    """{model: {config: {"epochs", "cpu_epochs", "totals", "warmups"}}}:
    seconds of every fit, the configurations interleaved in each repeat."""
    raw = {}
    for model_name in args.models:
        runs = raw[model_name] = {c: {} for c in args.configs}
        for _ in range(args.repeats):
            for config in args.configs:
                _extend(runs[config], run_once(model_name, config, args.epochs, args.policy))
    return raw


def _extend(into: dict, series: dict) -> None:
    for key, values in series.items():
        into.setdefault(key, []).extend(values)


def collect_against_baseline(args) -> dict[str, dict]:
    """{"baseline": raw, "current": raw}: each repeat runs every configuration
    once under each tree, each in its own process, the trees' order
    alternating from one repeat to the next."""
    trees = {"baseline": os.path.abspath(args.baseline),
             "current": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    merged = {name: {} for name in trees}
    for repeat in range(args.repeats):
        order = list(trees) if repeat % 2 == 0 else list(reversed(trees))
        for name in order:
            command = [sys.executable, os.path.abspath(__file__), "--raw", "--repeats", "1",
                       "--epochs", str(args.epochs), "--policy", args.policy,
                       "--models", *args.models, "--configs", *args.configs]
            env = {**os.environ, "PYTHONPATH": trees[name]}
            output = subprocess.run(command, env=env, check=True, capture_output=True,
                                    text=True).stdout
            raw = json.loads(output.strip().splitlines()[-1])
            for model_name, runs in raw.items():
                for config, series in runs.items():
                    _extend(merged[name].setdefault(model_name, {}).setdefault(config, {}),
                            series)
    return merged


def _quartiles(values: list) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4)
    return q1, q3


def report(raw: dict, title: str) -> None:
    """Prints each model's table: medians, spread and ratios to plain fit."""
    for model_name, runs in raw.items():
        plain = runs["plain"]
        plain_epoch = statistics.median(plain["epochs"])
        plain_cpu = statistics.median(plain["cpu_epochs"])
        plain_fastest = min(plain["epochs"])
        plain_total = statistics.median(plain["totals"])
        plain_warmup = statistics.median(plain["warmups"])
        print(f"\n{title}{model_name}")
        print(f"{'configuration':30s} {'epoch s':>8s} {'q1-q3':>13s} {'ratio':>6s} "
              f"{'added':>7s} {'cpu s':>7s} {'q1-q3':>13s} {'ratio':>6s} {'added':>7s} "
              f"{'fastest':>7s} {'ratio':>6s} {'fit':>6s} {'warm-up':>7s}")
        for config, series in runs.items():
            epoch = statistics.median(series["epochs"])
            q1, q3 = _quartiles(series["epochs"])
            cpu = statistics.median(series["cpu_epochs"])
            cpu_q1, cpu_q3 = _quartiles(series["cpu_epochs"])
            fastest = min(series["epochs"])
            total = statistics.median(series["totals"])
            warmup = statistics.median(series["warmups"])
            print(f"{config:30s} {epoch:8.3f} {q1:6.3f}-{q3:6.3f} {epoch / plain_epoch:6.3f} "
                  f"{epoch - plain_epoch:+7.3f} {cpu:7.3f} {cpu_q1:6.3f}-{cpu_q3:6.3f} "
                  f"{cpu / plain_cpu:6.3f} {cpu - plain_cpu:+7.3f} "
                  f"{fastest:7.3f} {fastest / plain_fastest:6.3f} "
                  f"{total / plain_total:6.3f} {warmup / plain_warmup:7.3f}")


def compare(merged: dict[str, dict]) -> None:
    """Prints, per model and configuration, the ratio of medians to plain fit
    and the added seconds per epoch under each tree (each tree's own plain
    fit), in wall and in CPU seconds."""
    print("\nthis tree against the baseline: ratio of median epochs to plain fit, "
          "added s/epoch")
    for model_name, runs in merged["current"].items():
        print(f"\n{model_name}")
        print(f"{'configuration':30s} {'wall before':>11s} {'after':>6s} {'added before':>12s} "
              f"{'after':>7s} {'cpu before':>10s} {'after':>6s} {'added before':>12s} "
              f"{'after':>7s}")
        for config in runs:
            row = []
            for key in ("epochs", "cpu_epochs"):
                before, after = (
                    {c: statistics.median(s[key]) for c, s in merged[tree][model_name].items()}
                    for tree in ("baseline", "current")
                )
                row.append((before[config] / before["plain"], after[config] / after["plain"],
                            before[config] - before["plain"], after[config] - after["plain"]))
            (wr0, wr1, wa0, wa1), (cr0, cr1, ca0, ca1) = row
            print(f"{config:30s} {wr0:11.3f} {wr1:6.3f} {wa0:+12.3f} {wa1:+7.3f} "
                  f"{cr0:10.3f} {cr1:6.3f} {ca0:+12.3f} {ca1:+7.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--models", nargs="+", default=["seed", "cnn"], choices=list(MODELS))
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--policy", default="mixed_float16")
    parser.add_argument("--baseline", metavar="DIR",
                        help="another mpprof source tree (e.g. a `git worktree` of main) "
                             "to measure in the same session, interleaved with this one")
    parser.add_argument("--raw", action="store_true",
                        help="print every fit's seconds as one JSON line instead of tables")
    args = tiny.parse_args(parser, repeats=1, epochs=1, models=["cnn"],
                           configs=["plain", "mpprof_defaults"])
    if "plain" not in args.configs:
        parser.error("--configs must include plain: every ratio is to plain fit")
    load_before = os.getloadavg()
    if args.baseline:
        merged = collect_against_baseline(args)
        report(merged["baseline"], "baseline: ")
        report(merged["current"], "this tree: ")
        compare(merged)
    elif args.raw:
        print(json.dumps(collect(args)))
        return
    else:
        report(collect(args), "")
    print(f"\n{args.policy}, {args.repeats} repeats x {args.epochs} timed epochs; "
          f"load average (1, 5, 15 min) before {_load(load_before)}, "
          f"after {_load(os.getloadavg())}")


def _load(averages) -> str:
    return ", ".join(f"{a:.2f}" for a in averages)


if __name__ == "__main__":
    main()
