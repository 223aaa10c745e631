"""`mpprof diagnose` and `mpprof report` on a large run: wall time, peak memory, size.

Writes (once) the synthetic run of `synthetic_logdir.py` (`--steps` steps of
loss scale, default 10M; 200 layers x 1,000 numerics samples; GPU samples),
then runs each command as the user would (`python -m mpprof.cli ...`, a fresh
process, imports included) `--repeats` times and reports the median wall
time, the peak resident memory of the process and the HTML size.

Goals (issues 5 and 15): diagnose < 10 s and < 1 GB peak RSS on 10M steps;
report < 30 s and < 20 MB of HTML.

    .venv/bin/python benchmarks/bench_diagnose_report.py [--steps N] [--logdir DIR]
        [--repeats 3]
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
import time

import tiny  # benchmarks/, on the path when run as a script

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from synthetic_logdir import write_synthetic_run  # noqa: E402

GOALS = {
    "diagnose_s": 10.0, "diagnose_peak_rss_mb": 1000.0, "report_s": 30.0, "report_mb": 20.0
}


def run_measured(command: list[str]) -> tuple[float, float, str]:
    """(wall seconds, peak RSS in MB, stdout) of one run of `command`.

    The child is reaped with os.wait4, which reports its own peak RSS.
    """
    start = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = subprocess.Popen(command, stdout=out, stderr=err)
        _, status, usage = os.wait4(process.pid, 0)
        elapsed = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    if process.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(command)} failed:\n{stderr[-2000:]}")
    return elapsed, usage.ru_maxrss / 1024, stdout  # ru_maxrss is in KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000_000)
    parser.add_argument("--logdir", help="default: a folder of the temp dir named by --steps")
    parser.add_argument("--repeats", type=int, default=3)
    args = tiny.parse_args(parser, steps=2000, repeats=1)

    logdir = pathlib.Path(
        args.logdir or os.path.join(tempfile.gettempdir(), f"mpprof-bench-{args.steps}-steps")
    )
    run_dir = logdir / "synthetic_large" / "train"
    if not run_dir.exists():
        print(f"writing the synthetic run into {run_dir} (once) ...", flush=True)
        start = time.perf_counter()
        write_synthetic_run(run_dir, steps=args.steps)
        print(f"  written in {time.perf_counter() - start:.0f} s", flush=True)
    size_mb = sum(f.stat().st_size for f in run_dir.iterdir()) / 1e6
    print(f"logdir: {logdir} ({size_mb:.0f} MB of event files)")

    cli = [sys.executable, "-m", "mpprof.cli"]
    html = logdir / "report.html"
    results = {}
    for name, command in (
        ("diagnose", cli + ["diagnose", str(logdir), "--format", "json"]),
        ("report", cli + ["report", str(logdir), "-o", str(html), "--quiet"]),
    ):
        runs = [run_measured(command) for _ in range(args.repeats)]
        results[f"{name}_s"] = statistics.median(r[0] for r in runs)
        results[f"{name}_peak_rss_mb"] = max(r[1] for r in runs)
        if name == "diagnose":
            results["findings"] = [f["code"] for f in json.loads(runs[-1][2])]
    results["report_mb"] = html.stat().st_size / 1e6

    print(
        f"diagnose: {results['diagnose_s']:.1f} s (goal < {GOALS['diagnose_s']:g} s), "
        f"peak RSS {results['diagnose_peak_rss_mb']:.0f} MB (goal < "
        f"{GOALS['diagnose_peak_rss_mb']:g} MB), findings {results['findings']}"
    )
    print(
        f"report:   {results['report_s']:.1f} s (goal < {GOALS['report_s']:g} s), "
        f"peak RSS {results['report_peak_rss_mb']:.0f} MB, HTML "
        f"{results['report_mb']:.1f} MB (goal < {GOALS['report_mb']:g} MB)"
    )
    met = all(results[key] < goal for key, goal in GOALS.items())
    print("goals met" if met else "GOALS MISSED")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
