"""How long the precision advisor takes: `mpprof advise` on the demo's logdir
without replay (goal: under 2 s), and the replay-verified plan
(`--verify`) of each demo model (goal: under 60 s on 2 cores).

Each command runs as its own process, as a user types it (its imports
included); the figure is the median wall time of `--repeat` runs.

    python benchmarks/bench_advise.py --logdir logs        # after `make demo`
    python benchmarks/bench_advise.py                       # trains the demo's models first

Without `--logdir` it trains the demo's faulty model on TensorFlow and on
JAX (examples/attention_overflow.py, which keeps 4 advise batches) into a
temporary directory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOAL_ADVISE_S = 2.0
GOAL_VERIFY_S = 60.0


def _env(backend: str | None = None) -> dict:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    if backend:
        env["KERAS_BACKEND"] = backend
    return env


def _mpprof() -> str:
    found = Path(sys.executable).with_name("mpprof")
    return str(found) if found.exists() else "mpprof"


def timed(command: list[str], env: dict, repeat: int) -> tuple[float, int]:
    """(median seconds, the last exit status) of `command`."""
    times, status = [], 0
    for _ in range(repeat):
        start = time.perf_counter()
        status = subprocess.run(command, env=env, capture_output=True).returncode
        times.append(time.perf_counter() - start)
    return statistics.median(times), status


def train_demo_models(logdir: Path) -> list[tuple[str, str | None]]:
    runs = [("attention_overflow", None), ("attention_overflow_jax", "jax")]
    for name, backend in runs:
        subprocess.run([sys.executable, str(ROOT / "examples" / "attention_overflow.py"),
                        "--verbose", "0", "--log-dir", str(logdir / name)],
                       env=_env(backend), check=True, capture_output=True)
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", help="the demo's logdir (default: train its models)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if args.logdir:
        logdir = Path(args.logdir)
        runs = [(p.name, "jax" if p.name.endswith("_jax") else None)
                for p in sorted(logdir.iterdir()) if (p / "train").is_dir()]
    else:
        logdir = Path(tempfile.mkdtemp(prefix="mpprof-bench-advise-"))
        runs = train_demo_models(logdir)
    mpprof = _mpprof()
    rows = []
    for name, backend in runs:
        run_dir = str(logdir / name)
        advise_s, status = timed([mpprof, "advise", run_dir, "--gpu", "H100"], _env(),
                                 args.repeat)
        verify_s, verify_status = timed(
            [mpprof, "advise", run_dir, "--verify", "--format", "json"], _env(backend), 1)
        rows.append({"run": name, "advise_s": round(advise_s, 3), "advise_exit": status,
                     "verify_s": round(verify_s, 2), "verify_exit": verify_status})
    result = {"logdir": str(logdir), "cpus": os.cpu_count(), "runs": rows,
              "goals": {"advise_s": GOAL_ADVISE_S, "verify_s": GOAL_VERIFY_S},
              "met": all(r["advise_s"] < GOAL_ADVISE_S and r["verify_s"] < GOAL_VERIFY_S
                         for r in rows)}
    print(json.dumps(result, indent=2))
    return 0 if result["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
