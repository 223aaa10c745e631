"""What a SIGKILL costs: records lost when a profiled fit is killed outright.

Runs tests/hard_stop_fit.py (a fit whose every step overflows, so every step
is one loss-scale event on disk once flushed; `flush_every_seconds=1`,
`flush_every_steps=100000`) several times, kills it with SIGKILL at a random
moment, and reports how much was lost: the steps that had finished before
the kill but whose overflow is not on disk, and how long before the kill the
oldest of them finished (the bound the README states is the flush interval).

    python benchmarks/bench_hard_stop.py --trials 5
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import tiny  # benchmarks/, on the path when run as a script

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
sys.path.insert(0, TESTS)

from hard_stop_fit import FLUSH_EVERY_SECONDS  # noqa: E402

from mpprof.records import reader  # noqa: E402


def _progress(path: str) -> list[tuple[int, float]]:
    rows = []
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 2:
                rows.append((int(parts[0]), float(parts[1])))
    return rows


def trial(delay_s: float) -> tuple[int, float, int]:
    """(steps lost, seconds between the oldest lost step and the kill, steps done)."""
    with tempfile.TemporaryDirectory() as root:
        logdir, progress = os.path.join(root, "logs"), os.path.join(root, "progress.txt")
        process = subprocess.Popen(
            [sys.executable, os.path.join(TESTS, "hard_stop_fit.py"), logdir, progress],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        while not os.path.exists(progress) or len(_progress(progress)) < 20:
            time.sleep(0.05)
        time.sleep(delay_s)
        killed_at = time.time()
        process.send_signal(signal.SIGKILL)
        process.wait()
        done = [(step, t) for step, t in _progress(progress) if t <= killed_at]
        on_disk = set(reader.read_run(logdir, "train").loss_scale.overflow_steps.astype(int))
        lost = [(step, t) for step, t in done if step - 1 not in on_disk]
        oldest = killed_at - min(t for _, t in lost) if lost else 0.0
        return len(lost), oldest, len(done)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    args = tiny.parse_args(parser, trials=1)
    rng = random.Random(0)
    worst = 0.0
    print(f"flush_every_seconds={FLUSH_EVERY_SECONDS}")
    print(f"{'trial':>5s} {'steps done':>10s} {'steps lost':>10s} "
          f"{'oldest lost, s before kill':>27s}")
    for index in range(args.trials):
        lost, oldest, done = trial(rng.uniform(1.0, 4.0))
        worst = max(worst, oldest)
        print(f"{index:5d} {done:10d} {lost:10d} {oldest:27.2f}")
    print(f"worst: the oldest lost step finished {worst:.2f} s before the kill "
          f"(bound: {FLUSH_EVERY_SECONDS} s plus one step)")


if __name__ == "__main__":
    main()
