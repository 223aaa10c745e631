"""The longest a dead or hung object store stalls a profiled fit (issue 40).

A real fit (tests/hard_stop_fit.py: a flush every second) writes its logdir
to a moto S3 server on 127.0.0.1 through a TCP proxy. After its 30th step
the proxy either stops answering (`hung`: connections accepted, nothing
answered) or refuses every connection (`down`), or goes on answering
(`answering`: the baseline of the same fit), and the fit runs on for
`--steps` steps. With mpprof's default deadlines, this prints, per case, the
longest gap between two steps after the change (the flush that met the
store), the time from the last step to the process's exit (the fit's end:
closing the records), and whether the recording stopped with one warning.

    .venv/bin/python benchmarks/bench_remote_stall.py [--steps 2000]
    .venv/bin/python benchmarks/bench_remote_stall.py --tiny   # a smoke test

`--tiny` runs the hung store only, 40 steps, with a deadline of 2 s instead
of the default's 20 s (`MPPROF_REMOTE_DEADLINE_S`): the same path, seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import tiny  # noqa: E402 - benchmarks/, on the path when run as a script
from s3_server import BUCKET, StallingProxy, s3_endpoint  # noqa: E402

CASES = ("answering", "hung", "down")


def measure(endpoint: str, case: str, steps: int, deadline_s: float | None = None) -> dict:
    """One fit against the store in `case`; `deadline_s`: the remote
    deadline (None: mpprof's default)."""
    with tempfile.TemporaryDirectory() as folder, \
            StallingProxy(int(endpoint.rsplit(":", 1)[1])) as proxy:
        progress, go = pathlib.Path(folder, "progress"), pathlib.Path(folder, "go")
        env = {**os.environ, "AWS_ENDPOINT_URL": proxy.endpoint}
        env.pop("MPPROF_REMOTE_DEADLINE_S", None)  # the defaults
        if deadline_s is not None:
            env["MPPROF_REMOTE_DEADLINE_S"] = str(deadline_s)
        process = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "hard_stop_fit.py"),
             f"s3://{BUCKET}/{case}", str(progress), "--steps", str(steps),
             "--hold-at", "30", str(go)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while not (progress.exists() and len(progress.read_text().splitlines()) >= 30):
            if process.poll() is not None:
                raise RuntimeError(process.stderr.read()[-3000:])
            time.sleep(0.1)
        if case == "hung":
            proxy.stall()
        elif case == "down":
            proxy.refuse()
        time.sleep(1.2)  # the next step's flush is due
        released = time.time()
        go.write_text("")
        _, stderr = process.communicate(timeout=900)
        exited = time.time()
        times = [float(line.split()[1]) for line in progress.read_text().splitlines()]
    after = times[30:]
    gaps = [b - a for a, b in zip([released, *after], after, strict=False)]
    return {
        "case": case, "exit_status": process.returncode, "steps_run": len(times),
        "longest_step_gap_s": round(max(gaps), 2),
        "last_step_to_exit_s": round(exited - times[-1], 2),
        "warnings": stderr.count("mpprof: stopped writing its records"),
        "reason": next((line.strip() for line in stderr.splitlines()
                        if "stopped writing its records" in line), None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="the remote deadline (default: mpprof's own)")
    args = tiny.parse_args(parser, steps=40, cases=["hung"], deadline_s=2.0)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    with s3_endpoint() as endpoint:
        for case in args.cases:
            print(json.dumps(measure(endpoint, case, args.steps, args.deadline_s)), flush=True)


if __name__ == "__main__":
    main()
