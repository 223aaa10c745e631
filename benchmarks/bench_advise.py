"""How long the precision advisor takes: `mpprof advise` on the demo's logdir
without replay (goal: under 2 s), and the replay-verified plan
(`--verify`) of each demo model (goal: under 60 s on 2 cores).

Each command runs as its own process, as a user types it (its imports
included); the figure is the median wall time of `--repeat` runs.

    python benchmarks/bench_advise.py --logdir logs        # after `make demo`
    python benchmarks/bench_advise.py                       # trains the demo's models first
    python benchmarks/bench_advise.py --tiny                # smoke test (TensorFlow, 1 epoch)

Without `--logdir` it trains the demo's faulty model on TensorFlow and on
JAX (examples/attention_overflow.py, which keeps 4 advise batches) into a
temporary directory (`--backends` picks them, `--epochs` its epochs). The
exit status is 1 when a command failed, or (not `--tiny`) a goal was missed.
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

import tiny  # benchmarks/, on the path when run as a script

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


def timed(command: list[str], env: dict, repeat: int) -> tuple[float, int, str]:
    """(median seconds, the last exit status, its output) of `command`."""
    times, status, out = [], 0, ""
    for _ in range(repeat):
        start = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        times.append(time.perf_counter() - start)
        status, out = done.returncode, done.stdout
    return statistics.median(times), status, out


# The demo's runs per backend: (run name, KERAS_BACKEND).
RUNS = {"tensorflow": ("attention_overflow", None), "jax": ("attention_overflow_jax", "jax")}


def train_demo_models(logdir: Path, backends: list[str],
                      epochs: int) -> list[tuple[str, str | None]]:
    runs = [RUNS[backend] for backend in backends]
    for name, backend in runs:
        subprocess.run([sys.executable, str(ROOT / "examples" / "attention_overflow.py"),
                        "--verbose", "0", "--epochs", str(epochs),
                        "--log-dir", str(logdir / name)],
                       env=_env(backend), check=True, capture_output=True)
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", help="the demo's logdir (default: train its models)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--backends", nargs="+", choices=sorted(RUNS),
                        default=["tensorflow", "jax"])
    parser.add_argument("--epochs", type=int, default=2, help="the demo model's epochs")
    args = tiny.parse_args(parser, repeat=1, backends=["tensorflow"], epochs=1)
    if args.logdir:
        logdir = Path(args.logdir)
        runs = [(p.name, "jax" if p.name.endswith("_jax") else None)
                for p in sorted(logdir.iterdir()) if (p / "train").is_dir()]
    else:
        logdir = Path(tempfile.mkdtemp(prefix="mpprof-bench-advise-"))
        runs = train_demo_models(logdir, args.backends, args.epochs)
    mpprof = _mpprof()
    rows = []
    for name, backend in runs:
        run_dir = str(logdir / name)
        advise_s, status, _ = timed([mpprof, "advise", run_dir, "--gpu", "H100"], _env(),
                                    args.repeat)
        verify_s, verify_status, out = timed(
            [mpprof, "advise", run_dir, "--verify", "--format", "json"], _env(backend), 1)
        try:
            verdict = json.loads(out)["verification"]["state"]
        except (ValueError, KeyError, TypeError):
            verdict = None
        rows.append({"run": name, "advise_s": round(advise_s, 3), "advise_exit": status,
                     "verify_s": round(verify_s, 2), "verify_exit": verify_status,
                     "verification": verdict})
    result = {"logdir": str(logdir), "cpus": os.cpu_count(), "load": os.getloadavg(),
              "runs": rows,
              "goals": {"advise_s": GOAL_ADVISE_S, "verify_s": GOAL_VERIFY_S},
              "met": all(r["advise_s"] < GOAL_ADVISE_S and r["verify_s"] < GOAL_VERIFY_S
                         for r in rows)}
    print(json.dumps(result, indent=2))
    failed = any(r["advise_exit"] or r["verify_exit"] or r["verification"] is None
                 for r in rows)
    return 1 if failed or not (result["met"] or args.tiny) else 0


if __name__ == "__main__":
    sys.exit(main())
