"""A sweep of many runs: the dashboard's `/runs` and the CLI, time and memory.

Writes (once, into `--cache`) logdirs of 20, 200 and 1,000 small runs (the
synthetic run of `synthetic_logdir.py`, `--steps` steps, 10 layers, 10
numerics samples each, every record the callback writes), then for each, in
a fresh process:

1. `/runs` through TensorBoard's WSGI app with the mpprof plugin: the first
   request, then the median of 10 later ones (nothing changed; the listing's
   2 s reuse is switched off so each walks the logdir), and the process's
   peak RSS: "dashboard", each run's row taken from the digest its fit
   wrote (`mpprof.display.run_digest`, written here as a fit's end writes
   it); "dashboard_without_digests", every run read and diagnosed (runs
   recorded by an mpprof before digests, or `--source` of one); then
   "dashboard_restarted", a new process without digests, as TensorBoard
   restarted on the sweep (the run summaries the previous one saved are
   trusted, `summary_store`);
2. `mpprof diagnose LOGDIR --format json` and `mpprof report LOGDIR`: wall time
   and peak RSS of the command.

    .venv/bin/python benchmarks/bench_many_runs.py [--sizes 20,200,1000]
        [--steps 2000] [--source DIR]

`--source DIR` measures another checkout's mpprof and plugin (e.g. the commit
before this benchmark, for before/after figures).
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

import tiny  # benchmarks/, on the path when run as a script

REPO = pathlib.Path(__file__).resolve().parents[1]

_ROUTES = r"""
import importlib.util, json, resource, statistics, sys, time
source = sys.argv[2]
if source:
    sys.path.insert(0, source)
    spec = importlib.util.spec_from_file_location(
        "tensorboard_plugin_mpprof", source + "/tensorboard_plugin/__init__.py",
        submodule_search_locations=[source + "/tensorboard_plugin"])
    module = importlib.util.module_from_spec(spec)
    sys.modules["tensorboard_plugin_mpprof"] = module
    spec.loader.exec_module(module)
from tensorboard.backend import application
from tensorboard.plugins import base_plugin
from werkzeug import test as werkzeug_test
from tensorboard_plugin_mpprof import routes, run_cache
run_cache._RUN_LIST_TTL_S = 0.0
if sys.argv[3] == "no-digests" and hasattr(routes, "run_digest"):
    routes.run_digest.load_many = lambda runs: {}
plugin = routes.MpprofPlugin(base_plugin.TBContext(logdir=sys.argv[1]))
client = werkzeug_test.Client(application.TensorBoardWSGI([plugin]))
def runs():
    start = time.perf_counter()
    response = client.get("/data/plugin/mpprof/runs")
    assert response.status_code == 200, response.get_data(as_text=True)[:300]
    return time.perf_counter() - start, len(json.loads(response.get_data())["runs"])
first, count = runs()
later = statistics.median(runs()[0] for _ in range(10))
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"runs": count, "first_s": first, "later_s": later, "peak_rss_mb": rss}))
"""


def make_logdir(root: pathlib.Path, runs: int, steps: int) -> pathlib.Path:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from synthetic_logdir import write_synthetic_run

    from mpprof.display import run_digest

    logdir = root / f"sweep_{runs}_{steps}"
    if not (logdir / "done").exists():
        for i in range(runs):
            write_synthetic_run(logdir / f"lr_{i:04d}" / "train", steps=steps, layers=10,
                                samples=10, seed=i)
        (logdir / "done").write_text("")
    # The digests, as each fit's end writes them; again whenever mpprof's code
    # changed (a digest of other code is not trusted).
    marker = logdir / "digests"
    if not marker.exists() or marker.read_text() != run_digest.code_fingerprint():
        for i in range(runs):
            run_digest.write(str(logdir / f"lr_{i:04d}" / "train"))
        marker.write_text(run_digest.code_fingerprint())
    return logdir


def command(args: list[str], env: dict) -> dict:
    """Wall time and peak RSS of this one command (`os.wait4`: its own
    rusage; RUSAGE_CHILDREN would give the largest of every child so far)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        process = subprocess.Popen(args, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    return {"wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024, "rc": process.returncode,
            "stderr": stderr[-300:] if process.returncode not in (0, 1) else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="20,200,1000")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(),
                                                        "mpprof-bench-many-runs"))
    parser.add_argument("--source", default="", help="another checkout to measure")
    parser.add_argument("--no-cli", action="store_true")
    args = tiny.parse_args(parser, sizes="3", steps=200, cache=os.path.join(
        tempfile.gettempdir(), "mpprof-bench-many-runs-tiny"))
    root = pathlib.Path(args.cache)
    root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    if args.source:
        env["PYTHONPATH"] = args.source
    for size in map(int, args.sizes.split(",")):
        logdir = make_logdir(root, size, args.steps)
        line = {"size": size, "steps": args.steps}
        # Each measure in its own process: peak RSS is per process. The first
        # two with no run summaries saved (a first TensorBoard on the sweep),
        # the third as TensorBoard restarted on it (`summary_store`).
        with tempfile.TemporaryDirectory() as first, tempfile.TemporaryDirectory() as saved:
            for key, digests, store in (("dashboard", "digests", first),
                                        ("dashboard_without_digests", "no-digests", saved),
                                        ("dashboard_restarted", "no-digests", saved)):
                routes = subprocess.run(
                    [sys.executable, "-c", _ROUTES, str(logdir), args.source, digests],
                    capture_output=True, text=True, timeout=3600,
                    env={**env, "MPPROF_SUMMARY_CACHE": store})
                line[key] = (json.loads(routes.stdout.strip().splitlines()[-1])
                             if routes.returncode == 0 else {"error": routes.stderr[-500:]})
        if not args.no_cli:
            cli = [sys.executable, "-m", "mpprof.cli"]
            line["diagnose"] = command(cli + ["diagnose", str(logdir), "--format", "json"], env)
            out = root / f"report_{size}.html"
            line["report"] = command(cli + ["report", str(logdir), "-q", "-o", str(out)], env)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
