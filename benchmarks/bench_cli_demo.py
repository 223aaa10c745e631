"""Wall time of `mpprof diagnose` on the demo logdir, as a user's shell sees it.

Trains the two demo runs of `make demo` (examples/mnist_mixed_float16.py and
examples/overflow_storm.py) into a temporary logdir unless `--logdir` is
given, then times the installed `mpprof diagnose LOGDIR` with /usr/bin/time
`--repeats` times (a fresh process each: Python start-up and imports
included) and prints the median and the peak resident memory.

Goal (issue 15): under 1 s, which leaves no room for importing TensorFlow
(~3.3 s here): reading a local logdir must not.

    .venv/bin/python benchmarks/bench_cli_demo.py [--logdir LOGDIR] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

import tiny  # benchmarks/, on the path when run as a script

REPO = pathlib.Path(__file__).resolve().parents[1]
GOAL_S = 1.0
DEMO_RUNS = ("mnist_mixed_float16", "overflow_storm")


def train_demo(logdir: pathlib.Path, epochs: int | None = None) -> None:
    """The runs `make demo` records, with the plain CPU kernels it uses
    (`epochs`: fewer than the examples' own)."""
    env = {**os.environ, "TF_ENABLE_ONEDNN_OPTS": "0", "TF_CPP_MIN_LOG_LEVEL": "2"}
    for name in DEMO_RUNS:
        subprocess.run(
            [sys.executable, str(REPO / "examples" / f"{name}.py"), "--log-dir",
             str(logdir / name), *([] if epochs is None else ["--epochs", str(epochs)])],
            check=True, env=env, stdout=subprocess.DEVNULL,
        )


def time_command(command: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS in MB) of `command`, as /usr/bin/time reports them."""
    with tempfile.NamedTemporaryFile("r") as report:
        subprocess.run(
            ["/usr/bin/time", "-o", report.name, "-f", "%e %M", *command],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wall, rss_kb = report.read().split()
    return float(wall), float(rss_kb) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", help="a recorded logdir (default: train the demo runs)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=None,
                        help="epochs of each demo run (default: the example's)")
    args = tiny.parse_args(parser, repeats=1, epochs=1)
    with tempfile.TemporaryDirectory(prefix="mpprof-demo-") as scratch:
        logdir = pathlib.Path(args.logdir or scratch)
        if args.logdir is None:
            print(f"training the demo runs into {logdir} ...", flush=True)
            train_demo(logdir, args.epochs)
        mpprof = str(pathlib.Path(sys.executable).with_name("mpprof"))
        runs = [time_command([mpprof, "diagnose", str(logdir)]) for _ in range(args.repeats)]
    walls = [wall for wall, _ in runs]
    median = statistics.median(walls)
    print(
        f"mpprof diagnose (demo logdir): median {median:.2f} s of {args.repeats} "
        f"(min {min(walls):.2f}, max {max(walls):.2f}; goal < {GOAL_S:g} s), "
        f"peak RSS {max(rss for _, rss in runs):.0f} MB"
    )
    print("goal met" if median < GOAL_S else "GOAL MISSED")
    print(json.dumps({"median_s": median, "walls_s": walls}))


if __name__ == "__main__":
    main()
