"""mpprof at the lowest versions it allows: run by `make test-lowest` in
.venv-lowest (`pip install ".[jax]"` with the pins of
tests/lowest/constraints-jax.txt) and .venv-lowest-tf (`pip install
".[tensorflow,tf-keras]"` with those of tests/lowest/constraints-tensorflow.txt),
each pin a lower bound of pyproject.toml.

Trains a few steps with the callback (loss scale, sampled numerics, a replay
capture, an XProf window) on the backend named: Keras 3 on JAX (`jax`), on
TensorFlow (`tensorflow`), or tf-keras (`tf_keras`, Keras 2); then, as a
user would, runs the CLI on the logdir (summary, diagnose, replay, report)
and serves it with `tensorboard --logdir`, asking the tab for its runs and
findings. Exits 1 with what failed; prints the versions it ran with.

Usage: python tests/lowest/check.py WORKDIR [jax|tensorflow|tf_keras]
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import re
import subprocess
import sys
import time
import urllib.request

BACKEND = sys.argv[2] if len(sys.argv) > 2 else "jax"
if BACKEND == "tf_keras":
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
else:
    os.environ["KERAS_BACKEND"] = BACKEND
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

if BACKEND == "tf_keras":
    import tf_keras as keras
else:
    import keras
import numpy as np  # noqa: E402 - after the backend is chosen

import mpprof  # noqa: E402

FRAMEWORKS = {"jax": ("jax", "jaxlib"), "tensorflow": ("tensorflow",),
              "tf_keras": ("tensorflow", "tf-keras")}
PACKAGES = ("keras", *FRAMEWORKS[BACKEND], "tensorboard", "xprof", "plotly", "numpy",
            "nvidia-ml-py", "google-crc32c", "fsspec")
BIN = pathlib.Path(sys.executable).parent


def fit(logdir: pathlib.Path) -> dict:
    """The float16 overflow of tests/jax: kernels of 300 overflow the second
    layer's output on every step, so the sampled steps are captured."""
    if BACKEND == "tf_keras":
        keras.mixed_precision.set_global_policy("mixed_float16")
    else:
        keras.mixed_precision.set_dtype_policy("mixed_float16")
    big = keras.initializers.Constant(300.0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, kernel_initializer=big),
                              keras.layers.Dense(16, kernel_initializer=big, name="second"),
                              keras.layers.Dense(1, dtype="float32", kernel_initializer="ones")])
    scaler = (keras.mixed_precision.LossScaleOptimizer if BACKEND == "tf_keras"
              else keras.optimizers.LossScaleOptimizer)
    model.compile(optimizer=scaler(keras.optimizers.SGD(0.0)), loss="mse")
    model.fit(np.ones((64, 8), "float32"), np.zeros((64, 1), "float32"), batch_size=8,
              verbose=0, callbacks=[mpprof.MixedPrecisionProfiler(
                  str(logdir), gpu_interval=None, numerics_every=2, profile_steps=(3, 4))])
    run = mpprof.reader.read_run(str(logdir), "train")
    return {name: state.get("state") for name, state in run.context["collectors"].items()}


def cli(*args: str) -> str:
    result = subprocess.run([str(BIN / "mpprof"), *args], capture_output=True, text=True,
                            timeout=300)
    if result.returncode not in (0, 1):
        sys.exit(f"mpprof {' '.join(args)} exited {result.returncode}:\n{result.stderr[-3000:]}")
    return result.stdout


def serve(logdir: pathlib.Path) -> dict:
    process = subprocess.Popen(
        [str(BIN / "tensorboard"), "--logdir", str(logdir), "--port", "0", "--host",
         "127.0.0.1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        deadline = time.monotonic() + 120
        lines = []
        while url is None and time.monotonic() < deadline:
            line = process.stderr.readline()
            if not line and process.poll() is not None:
                break
            lines.append(line)
            match = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
            url = match and match.group(1)
        if url is None:
            sys.exit("tensorboard did not start:\n" + "".join(lines[-30:]))

        def get(route: str):
            with urllib.request.urlopen(url + route, timeout=60) as response:
                return json.loads(response.read())

        return {"enabled": get("data/plugins_listing")["mpprof"]["enabled"],
                "runs": [r["run"] for r in get("data/plugin/mpprof/runs")["runs"]],
                "findings": [f["code"] for f in
                             get("data/plugin/mpprof/findings?run=train")["findings"]]}
    finally:
        process.terminate()
        process.wait(timeout=30)


def main() -> None:
    work = pathlib.Path(sys.argv[1])
    logdir = work / "logs"
    started = time.monotonic()
    collectors = fit(logdir)
    failed = {name: state for name, state in collectors.items()
              if state not in ("ok", "absent", "unavailable")}
    if failed or collectors.get("loss_scale") != "ok" or collectors.get("numerics") != "ok":
        sys.exit(f"collectors did not all record: {collectors}")
    if collectors.get("kernels", "ok") != "ok":
        sys.exit(f"the XProf window failed: {collectors}")
    summary = json.loads(cli("summary", str(logdir), "--format", "json"))
    codes = [f["code"] for f in json.loads(cli("diagnose", str(logdir), "--format", "json"))]
    # tf-keras runs are not replayed (docs/replay.md): nothing is captured.
    replay = (json.loads(cli("replay", str(logdir), "--format", "json"))
              if BACKEND != "tf_keras" else None)
    cli("report", str(logdir), "-o", str(work / "report.html"), "-q")
    tab = serve(logdir)
    checks = {
        "loss scale followed": summary[0]["loss_scale"]["overflows"] > 0,
        "MP003 diagnosed": "MP003" in codes,
        "replay names the layer": replay is None or replay.get("first_layer") == "second"
        or "second" in json.dumps(replay),
        "report written": (work / "report.html").stat().st_size > 100_000,
        "tab enabled": tab["enabled"] is True,
        "tab lists the run": tab["runs"] == ["train"],
        "tab diagnoses it": "MP003" in tab["findings"],
    }
    print(json.dumps({
        "python": sys.version.split()[0],
        "versions": {name: importlib.metadata.version(name) for name in PACKAGES},
        "collectors": collectors, "checks": checks,
        "seconds": round(time.monotonic() - started, 1)}, indent=1))
    if not all(checks.values()):
        sys.exit(f"failed: {[name for name, ok in checks.items() if not ok]}")


if __name__ == "__main__":
    main()
