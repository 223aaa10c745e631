"""Device check of the PyTorch backend, in one script, figures to one JSON file.

Trains, with `MixedPrecisionProfiler` at its defaults (NVML sampler on) and a
`profile_steps` window, the seed model (784-256-10 MLP), the small CNN and a
small transformer, each under mixed_float16 and mixed_bfloat16; reads back
each run (steps, skipped steps, numerics samples, NVML Tensor Core and SM
utilisation medians, the Tensor Core share of the window's CUDA kernels: a
torch.profiler trace classified by XProf's kernel-name heuristic); runs
`mpprof diagnose` on the whole log_dir; trains the seed overflow model (a
third Dense whose float16 product passes 65504), replays its capture with
the PyTorch engine and checks the verdict (layer d3, the map
{third_dense/d3: float32}, verified; the op is the device's: `mm`/`addmm` on
a GPU, the cast of the float32 product on a CPU); measures the paired
overhead of the profiler on the seed model and the CNN
(`bench_paired_steps_torch`); writes it all to `--out`. Sized for at most 8
minutes on one GPU; `--tiny` runs it on a CPU in seconds (CI's smoke test,
tests/test_benchmarks.py: the same code path, tiny sizes).

    python benchmarks/gpu_check_torch.py --out gpu_check_torch.json
    python benchmarks/gpu_check_torch.py --tiny --out /tmp/smoke.json

Exit status 0 when every run recorded its steps and traced its window, the
diagnosis ran and the replay gave the expected verdict.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time

os.environ["KERAS_BACKEND"] = "torch"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_paired_steps_torch
import keras
import numpy as np
import torch
from bench_models import SHAPES, small_transformer, third_dense_model
from device_checks import column_medians, diagnose

import mpprof
from mpprof.records import reader

MODELS = ("seed", "cnn", "transformer")


def _data(name: str, sizes: dict):
    rng = np.random.default_rng(0)
    samples = sizes["samples"]
    y = rng.integers(0, 10, samples)
    if name == "transformer":
        return rng.integers(0, sizes["vocabulary"], (samples, sizes["sequence"])).astype(
            "int32"), y
    return rng.random((samples, *SHAPES[name][1]), dtype=np.float32), y


def build(name: str, policy: str, sizes: dict) -> keras.Model:
    keras.backend.clear_session()
    keras.mixed_precision.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    model = (small_transformer(sizes["sequence"], sizes["vocabulary"], sizes["width"])
             if name == "transformer" else SHAPES[name][0]())
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def train(log_dir: str, name: str, policy: str, sizes: dict) -> dict:
    model = build(name, policy, sizes)
    x, y = _data(name, sizes)
    run_dir = os.path.join(log_dir, f"{name}_{policy}")
    start = time.perf_counter()
    model.fit(x, y, batch_size=sizes["batch"], epochs=sizes["epochs"], verbose=0,
              callbacks=[mpprof.MixedPrecisionProfiler(
                  run_dir, numerics_every=sizes["numerics_every"],
                  profile_steps=sizes["profile_steps"])])
    seconds = time.perf_counter() - start
    run = reader.read_run(run_dir, "train")
    figures = {"model": name, "policy": policy, "fit_seconds": seconds,
               "steps_per_second": sizes["steps"] / seconds,
               "skipped_steps": run.loss_scale.skipped_steps if run.loss_scale else None,
               "steps_run": (run.loss_scale.steps_run if run.loss_scale
                             else run.health.get("checked_step") if run.health else None),
               "numerics_samples": len(run.numerics.steps) if run.numerics else 0,
               "gpu_mode": run.gpu.mode if run.gpu else None,
               "kernels": run.context["collectors"].get("kernels"),
               "tensor_core_share": {key: (run.gpu.kernels or {}).get(key) if run.gpu else None
                                     for key in ("tensor_core_share", "no_gpu_kernels",
                                                 "total_gpu_kernel_us", "tensor_core_us")},
               "hardware": {key: run.context.get("hardware", {}).get(key)
                            for key in ("gpus_visible", "reason")}}
    if run.gpu is not None and len(run.gpu.samples):
        medians = column_medians(run.gpu, ("tensor_util", "hmma_tensor_util", "sm_util",
                                           "gpu_util"))
        figures.update({f"{column}_median": value for column, value in medians.items()})
    return figures


def replay_check(log_dir: str) -> dict:
    """The seed overflow captured on this device and replayed by the PyTorch
    engine: its verdict and how long the replay took."""
    run_dir = os.path.join(log_dir, "replay_third_dense")
    x, y = np.ones((32, 8), "float32"), np.ones((32, 1), "float32")
    keras.backend.clear_session()
    third_dense_model().fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False,
                            callbacks=[mpprof.MixedPrecisionProfiler(run_dir,
                                                                     numerics_every=2)])
    start = time.perf_counter()
    result = mpprof.replay.replay(run_dir, save=False)
    seconds = time.perf_counter() - start
    first = result["first_op"] or {}
    expected_ops = ("mm", "addmm") if torch.cuda.is_available() else ("_to_copy",)
    return {"seconds": seconds, "first_op": first, "policy_map": result["policy_map"],
            "verified": result["verified"], "verified_detail": result["verified_detail"],
            "as_expected": (first.get("layer") == "d3" and first.get("op") in expected_ops
                            and result["policy_map"] == {"third_dense/d3": "float32"}
                            and result["verified"] is True)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check_torch.json")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test sizes")
    parser.add_argument("--log-dir", default=None)
    args = parser.parse_args()
    if args.tiny:
        sizes = {"samples": 64, "batch": 16, "epochs": 1, "sequence": 8, "vocabulary": 50,
                 "width": 16, "numerics_every": 2, "profile_steps": (1, 2)}
        # One batch of bench_paired_steps_torch's 128, the seed model only
        # (the CNN's is the same code; its float16 convolutions take seconds
        # on a CPU).
        paired = {"block": 1, "rounds": 2, "samples": 128, "models": ("seed",)}
    else:
        sizes = {"samples": 128 * 400, "batch": 128, "epochs": 2, "sequence": 128,
                 "vocabulary": 8000, "width": 256, "numerics_every": 500,
                 "profile_steps": (10, 11)}
        paired = {"block": 16, "rounds": 150, "samples": 8192, "models": ("seed", "cnn")}
    sizes["steps"] = sizes["samples"] // sizes["batch"] * sizes["epochs"]
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="mpprof-gpu-check-torch-")
    started = time.perf_counter()
    result = {"device": (torch.cuda.get_device_name(0) if torch.cuda.is_available()
                         else "cpu"),
              "torch_version": torch.__version__, "cuda": torch.version.cuda,
              "keras_version": keras.__version__, "sizes": sizes, "runs": []}
    for name in MODELS:
        for policy in ("mixed_float16", "mixed_bfloat16"):
            result["runs"].append(train(log_dir, name, policy, sizes))
    print(f"trained: {time.perf_counter() - started:.0f} s", flush=True)
    result["diagnosis"] = diagnose(log_dir)
    result["replay"] = replay_check(log_dir)
    print(f"replayed: {time.perf_counter() - started:.0f} s", flush=True)
    print(json.dumps({"replay": result["replay"]}, default=float))
    result["paired_overhead"] = {}
    for name in paired["models"]:
        times = bench_paired_steps_torch.measure(
            "mixed_float16", paired["block"], paired["rounds"], samples=paired["samples"],
            past_first_sample=not args.tiny, model_name=name)
        with contextlib.redirect_stdout(io.StringIO()):
            result["paired_overhead"][name] = {
                clock: bench_paired_steps_torch.report(series, paired["block"])
                for clock, series in times.items()}
    result["seconds"] = time.perf_counter() - started
    result["log_dir"] = log_dir
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2, default=float)
    print(json.dumps({k: result[k] for k in ("device", "seconds")}))
    ok = all(run.get("steps_run") == sizes["steps"] and run["numerics_samples"] >= 1
             and (run["kernels"] or {}).get("state") == "ok" for run in result["runs"])
    return 0 if ok and result["diagnosis"]["exit"] == 0 and result["replay"][
        "as_expected"] else 1


if __name__ == "__main__":
    sys.exit(main())
