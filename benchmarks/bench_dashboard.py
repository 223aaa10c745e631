"""Dashboard speed on a large run: route latency and page load (medians).

Writes (once) the synthetic run of `synthetic_logdir.py` (1M steps, 200
layers x 1,000 numerics samples, 40,000 GPU samples), then:

1. Route latency, in process (TensorBoard's WSGI app over a
   MultiplexerDataProvider, as `tensorboard` serves it): the first request
   of each route (the run is read from disk), then the median of `--repeats`
   later ones (the run and its payloads come from the plugin's cache); the
   client accepts gzip, as browsers do.
2. Page load, in a real `tensorboard --logdir` and headless Chromium: time
   from navigation to the overview usable (run list, finding counts and the
   worst run's findings drawn; the overview does not wait for plotly.js, which
   is fetched after it), when plotly.js was requested, and each chart view
   drawn after a tab click; median over `--pages` page loads (the first one
   reads and diagnoses the run cold). Goal: overview usable in < 1.5 s.

    .venv/bin/python benchmarks/bench_dashboard.py [--logdir DIR] [--repeats 15] [--pages 5]
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
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from browser import load_page  # noqa: E402
from synthetic_logdir import write_synthetic_run  # noqa: E402
from test_plugin_routes import tensorboard_client  # noqa: E402

RUN = "synthetic_large/train"
ROUTES = {
    "runs": {},
    "context": {"run": RUN},
    "findings": {"run": RUN},
    "inventory": {"run": RUN},
    "loss_scale": {"run": RUN, "points": 2000},
    "numerics (headroom)": {
        "run": RUN,
        "direction": "forward",
        "stat": "headroom",
        "columns": 1400,
    },
    "numerics (gradient underflow)": {
        "run": RUN,
        "direction": "backward",
        "stat": "underflow_frac",
        "columns": 1400,
    },
    "layer_history": {"run": RUN, "layer": "block_100/dense"},
    "histogram": {"run": RUN, "layer": "block_100/dense", "direction": "forward"},
    "gpu": {"run": RUN},
    "index.js": None,
    "plotly.min.js": None,
}
VIEWS = ("loss_scale", "numerics", "histograms", "inventory", "gpu")
OVERVIEW_GOAL_MS = 1500


def bench_routes(logdir: str, repeats: int) -> None:
    client = tensorboard_client(logdir)
    print(f"\nRoute latency (ms), {repeats} warm repeats; response size (KB, gzipped)")
    print(f"{'route':32s} {'first':>8s} {'median':>8s} {'size':>8s}")
    for name, params in ROUTES.items():
        path = "/data/plugin/mpprof/" + name.split(" ")[0]
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            response = client.get(
                path, query_string=params or {}, headers={"Accept-Encoding": "gzip"}
            )
            body = response.get_data()
            times.append(1000 * (time.perf_counter() - start))
            assert response.status_code == 200, (name, body[:200])
        print(
            f"{name:32s} {times[0]:8.1f} {statistics.median(times[1:]):8.1f} "
            f"{len(body) / 1024:8.0f}"
        )


def bench_page(logdir: str, pages: int) -> None:
    process = subprocess.Popen(
        [
            str(pathlib.Path(sys.executable).with_name("tensorboard")),
            "--logdir",
            logdir,
            "--port",
            "0",
            "--host",
            "127.0.0.1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = None
        for line in process.stderr:
            if " at http://127.0.0.1:" in line:
                url = line.split(" at ")[1].split(" ")[0]
                break
        ready = "performance.getEntriesByName('mpprof:overview:ready')[0]?.startTime"
        evaluate = {
            "overview": ready,
            # The dashboard marks when it asks for plotly.js; an older one
            # asked before anything else (its resource timing, when loaded).
            "plotly requested": "performance.getEntriesByName('mpprof:plotly:requested')[0]"
            "?.startTime ?? performance.getEntriesByType('resource')"
            ".find((e) => e.name.endsWith('plotly.min.js'))?.startTime ?? -1",
        }
        for view in VIEWS:
            evaluate[view] = f"""(async () => {{
                const start = performance.now();
                const tab = document.querySelector('.tabs [data-view="{view}"]');
                if (!tab) return null;
                tab.click();
                const main = document.querySelector('main.view');
                while (!(main.dataset.view === "{view}" && main.dataset.state !== "loading"))
                    await new Promise((resolve) => setTimeout(resolve, 5));
                return performance.now() - start;
            }})()"""
        results = []
        for _ in range(pages):
            page = load_page(
                url + "data/plugin_entry.html?name=mpprof",
                wait_for=ready,
                evaluate=evaluate,
                timeout=120,
                settle=0,
            )
            results.append(page.values)
        print(f"\nPage load (ms), {pages} loads in headless Chromium (first: cold run read)")
        print(f"{'until':32s} {'first':>8s} {'median':>8s}")
        for key in ("overview", "plotly requested", *VIEWS):
            label = {
                "overview": "overview usable",
                "plotly requested": "plotly.min.js requested at",
            }.get(key, f"{key} view after click")
            values = [r.get(key) for r in results]
            if None in values:  # a view this version of the dashboard lacks
                continue
            print(f"{label:32s} {values[0]:8.0f} {statistics.median(values):8.0f}")
        median = statistics.median(r["overview"] for r in results)
        verdict = "met" if median < OVERVIEW_GOAL_MS else "NOT met"
        print(f"goal: overview usable < {OVERVIEW_GOAL_MS} ms (median): {verdict}")
    finally:
        process.terminate()
        process.wait(timeout=20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", help="where the synthetic run is (written if missing)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--pages", type=int, default=5)
    parser.add_argument(
        "--pages-only", action="store_true", help="skip the route latencies"
    )
    parser.add_argument("--steps", type=int, default=1_000_000,
                        help="steps of the synthetic run")
    args = tiny.parse_args(parser, repeats=1, pages=0, steps=2000)
    logdir = args.logdir or os.path.join(
        tempfile.gettempdir(), "mpprof-bench-dashboard" + ("-tiny" if args.tiny else ""))
    run_dir = os.path.join(logdir, RUN)
    if not os.path.isdir(run_dir):
        start = time.perf_counter()
        write_synthetic_run(run_dir, steps=args.steps)
        print(f"wrote {run_dir} in {time.perf_counter() - start:.1f} s")
    size = sum(p.stat().st_size for p in pathlib.Path(run_dir).iterdir())
    print(f"logdir {logdir}: {size / 1e6:.0f} MB of mpprof events")
    print(json.dumps({"steps": args.steps, "layers": 200, "numerics_samples": 1000}))
    if not args.pages_only:
        bench_routes(logdir, args.repeats)
    if args.pages:  # the tiny run: no browser
        bench_page(logdir, args.pages)


if __name__ == "__main__":
    main()
