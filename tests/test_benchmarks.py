"""Every benchmark still runs: each `benchmarks/*.py --tiny`, in a fresh process.

A benchmark measures code that changes under it; one that no longer runs
(a constructor that gained an argument, a renamed module) would be found
only when its figures are next needed, and the figures the docs quote could
no longer be reproduced. `--tiny` (benchmarks/tiny.py) runs the same code
paths at sizes of seconds; the figures it prints mean nothing and are not
checked, only that the benchmark ran to its end.
"""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import subprocess
import sys

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
# Modules of the benchmarks, not benchmarks.
LIBRARIES = {"tiny", "bench_models", "device_checks"}
# Smoke-tested elsewhere, with its output checked: tests/jax/test_jax_backend.py.
TESTED_ELSEWHERE = {"gpu_check_jax"}
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem not in LIBRARIES)


def test_every_script_is_a_benchmark_with_a_tiny_mode():
    assert len(SCRIPTS) >= 15
    for name in SCRIPTS:
        text = (BENCHMARKS / f"{name}.py").read_text()
        assert 'if __name__ == "__main__":' in text, name
        assert "tiny" in text, f"{name} has no --tiny mode"


def _run_tiny(name: str, scratch: pathlib.Path) -> str | None:
    """Runs `name --tiny` in `scratch`; None, or why it failed."""
    scratch.mkdir()
    extra = [str(scratch / "logs")] if name == "synthetic_logdir" else []
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0",
           "TMPDIR": str(scratch)}
    try:
        result = subprocess.run(
            [sys.executable, str(BENCHMARKS / f"{name}.py"), "--tiny", *extra],
            cwd=scratch, env=env, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        return f"{name}: still running after 900 s"
    if result.returncode != 0:
        return f"{name} exited {result.returncode}:\n{result.stderr[-3000:]}"
    return None


def test_every_benchmark_runs_tiny(tmp_path):
    """One test for all: two at a time (each is mostly a framework's import
    and tracing), every failure reported together."""
    names = [name for name in SCRIPTS if name not in TESTED_ELSEWHERE]
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        failures = [f for f in pool.map(lambda n: _run_tiny(n, tmp_path / n), names) if f]
    assert not failures, "\n\n".join(failures)
