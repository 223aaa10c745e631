"""Device check of the JAX backend, in one script, figures to one JSON file.

Trains, with `MixedPrecisionProfiler` at its defaults (NVML sampler on) and
an XProf window (`profile_steps`, a jax.profiler trace), the seed model
(784-256-10 MLP) and a small transformer, each under mixed_float16 and
mixed_bfloat16; reads back each run (steps, skipped steps, NVML GPM Tensor
Core utilisation when the GPU has it, over the run and over the window's
steps, beside XProf's Tensor Core kernel share of the same steps, numerics
samples);
runs `mpprof diagnose` on the whole log_dir; asks the precision advisor for a
plan for each model's mixed_bfloat16 run and trains the run's policy and the
plan without the profiler, printing both measured step times beside the
plan's projection; measures the paired overhead of
the profiler on the seed model (`bench_paired_steps_jax`); writes it all to
`--out`. Sized for at most 8 minutes on one GPU; `--tiny` runs it on a CPU in
seconds (CI's smoke test: the same code path, tiny sizes).

    KERAS_BACKEND=jax python benchmarks/gpu_check_jax.py --out gpu_check_jax.json
    KERAS_BACKEND=jax python benchmarks/gpu_check_jax.py --tiny --out /tmp/smoke.json

Exit status 0 when every run recorded its steps and the diagnosis ran.
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

os.environ["KERAS_BACKEND"] = "jax"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import keras
import numpy as np
from bench_models import small_transformer
from device_checks import column_medians, diagnose

import mpprof
from mpprof.records import reader


def seed_model() -> keras.Model:
    return keras.Sequential([
        keras.layers.Input((784,)),
        keras.layers.Dense(256, activation="relu", name="dense"),
        keras.layers.Dense(10, dtype="float32", name="logits"),
    ])


def _data(name: str, samples: int, sequence: int, vocabulary: int):
    rng = np.random.default_rng(0)
    y = rng.integers(0, 10, samples)
    if name == "seed":
        return rng.random((samples, 784), dtype=np.float32), y
    return rng.integers(0, vocabulary, (samples, sequence)).astype("int32"), y


def build(name: str, policy, sizes: dict) -> keras.Model:
    """The model under `policy` (a name or a DTypePolicyMap: its keys are the
    layers' paths, the same in every build after `clear_session`)."""
    keras.backend.clear_session()
    keras.mixed_precision.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    model = (seed_model() if name == "seed" else
             small_transformer(sizes["sequence"], sizes["vocabulary"], sizes["width"]))
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def train(log_dir: str, name: str, policy: str, sizes: dict) -> dict:
    model = build(name, policy, sizes)
    x, y = _data(name, sizes["samples"], sizes["sequence"], sizes["vocabulary"])
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
               "gpu_mode": run.gpu.mode if run.gpu else None}
    if run.gpu is not None and len(run.gpu.samples):
        medians = column_medians(run.gpu, ("tensor_util", "hmma_tensor_util", "sm_util",
                                           "gpu_util"))
        figures.update({f"{column}_median": value for column, value in medians.items()})
    figures["xprof"] = xprof_beside_nvml(run, sizes["profile_steps"])
    return figures


class _StepTimes(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.ends: list[float] = []

    def on_train_batch_end(self, batch, logs=None):
        # The loss read forces the step to finish (JAX dispatches asynchronously).
        if logs:
            float(logs.get("loss", 0.0))
        self.ends.append(time.perf_counter())


def median_step_seconds(name: str, policy, sizes: dict, float8: list[str]) -> float:
    """The median step time of the model under `policy` (float8: the
    `model.quantize` filters), without the profiler, past the compilation."""
    model = build(name, policy, sizes)
    if float8:
        # A layer holding a DTypePolicyMap cannot be quantized (Keras builds
        # "float8_from_map_..."), and the `dtype_policy` setter writes into
        # the map: each layer takes its own entry in place of the map.
        for layer in model._flatten_layers(include_self=True):
            policy = getattr(layer, "_dtype_policy", None)
            if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
                layer._dtype_policy = (policy[layer.path] if layer.path
                                       else policy.default_policy)
        model.quantize("float8", filters=float8)
        model.compile(optimizer="adam",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data(name, sizes["samples"], sizes["sequence"], sizes["vocabulary"])
    times = _StepTimes()
    model.fit(x, y, batch_size=sizes["batch"], epochs=1, verbose=0, callbacks=[times])
    gaps = np.diff(times.ends)[2:]
    return float(np.median(gaps)) if len(gaps) else float("nan")


def advisor_check(run_dir: str, name: str, policy: str, sizes: dict) -> dict:
    """The advisor's plan for a run, trained beside the run's own policy: both
    step times measured, printed beside the plan's projection (so the first
    GPU run calibrates the projection)."""
    advice = mpprof.advise(run_dir)
    plan, projection = advice["plan"], advice["projection"]
    # The plan's policies: its default alone, or a map of its per-layer ones.
    planned = plan["default_policy"]
    if plan["policy_map"]:
        planned = keras.dtype_policies.DTypePolicyMap(default_policy=plan["default_policy"])
        for path, layer_policy in plan["policy_map"].items():
            planned[path] = layer_policy
    baseline_s = median_step_seconds(name, policy, sizes, [])
    error = None
    try:
        plan_s = (baseline_s if plan["nothing_to_change"]
                  else median_step_seconds(name, planned, sizes, plan["float8_filters"]))
    except ValueError as e:
        # XLA:CPU has no float16 dot_general accumulating in float32 (a
        # float16 attention einsum): said, and the check goes on.
        plan_s, error = None, f"{type(e).__name__}: {str(e)[:200]}"
    keras.mixed_precision.set_dtype_policy("float32")
    return {
        "model": name, "policy": policy,
        "plan": {key: plan[key] for key in ("must_float32", "lower", "float8",
                                            "nothing_to_change", "policy_map")},
        "projection": {key: projection.get(key) for key in (
            "gpu", "float32_runs_as", "gemm_seconds_now", "gemm_seconds_plan", "gemm_speedup",
            "measured_step_seconds", "step_speedup", "amdahl_source")},
        "measured": {"baseline_step_seconds": baseline_s, "plan_step_seconds": plan_s,
                     "speedup": baseline_s / plan_s if plan_s else None,
                     **({"plan_not_trained": error} if error else {})},
    }


def xprof_beside_nvml(run, window: tuple[int, int]) -> dict:
    """XProf's Tensor Core kernel share of the window's steps (the
    `kernels/tensor_core_share` record) beside NVML GPM's Tensor Core
    utilisation sampled while those steps ran: two measures of one thing,
    time in Tensor Core kernels against Tensor Core pipe activity."""
    kernels = (run.gpu.kernels if run.gpu else None) or {}
    figures = {"window": run.context["collectors"].get("kernels"),
               "tensor_core_share": kernels.get("tensor_core_share"),
               "no_gpu_kernels": kernels.get("no_gpu_kernels"),
               "reason": kernels.get("reason"),
               "total_gpu_kernel_us": kernels.get("total_gpu_kernel_us"),
               "eligible_not_using_us": kernels.get("eligible_not_using_us"),
               "top_ops": kernels.get("top_ops", [])[:5]}
    if run.gpu is not None and len(run.gpu.samples):
        steps = run.gpu.column("step")
        inside = (steps >= window[0]) & (steps <= window[1])
        figures["nvml_samples_in_window"] = int(inside.sum())
        medians = column_medians(run.gpu, ("tensor_util", "hmma_tensor_util"), inside)
        figures.update({f"nvml_{column}_in_window_median": value
                        for column, value in medians.items()})
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check_jax.json")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test sizes")
    parser.add_argument("--log-dir", default=None)
    args = parser.parse_args()
    if args.tiny:
        sizes = {"samples": 64, "batch": 16, "epochs": 1, "sequence": 8, "vocabulary": 50,
                 "width": 16, "numerics_every": 2}
        paired = {"block": 2, "rounds": 4, "samples": 512}
    else:
        sizes = {"samples": 128 * 400, "batch": 128, "epochs": 2, "sequence": 128,
                 "vocabulary": 8000, "width": 256, "numerics_every": 500}
        paired = {"block": 16, "rounds": 200, "samples": 8192}
    sizes["steps"] = sizes["samples"] // sizes["batch"] * sizes["epochs"]
    # Past compilation, and long enough on a GPU for NVML to sample inside
    # (one sample each 0.5 s; a step of these models takes milliseconds).
    sizes["profile_steps"] = ((1, 2) if args.tiny else
                              (sizes["steps"] // 4, sizes["steps"] // 4 + 299))
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="mpprof-gpu-check-jax-")
    started = time.perf_counter()
    result = {"devices": [str(d) for d in jax.devices()], "jax_version": jax.__version__,
              "keras_version": keras.__version__, "sizes": sizes, "runs": []}
    on_cpu = jax.devices()[0].platform == "cpu"
    for name in ("seed", "transformer"):
        for policy in ("mixed_float16", "mixed_bfloat16"):
            if on_cpu and name == "transformer" and policy == "mixed_float16":
                # XLA:CPU has no float16 dot_general accumulating in float32
                # (Keras' attention einsum): a plain JAX fit fails the same way.
                result["runs"].append({"model": name, "policy": policy, "skipped":
                                       "float16 attention einsum unsupported on XLA:CPU"})
                continue
            result["runs"].append(train(log_dir, name, policy, sizes))
    result["diagnosis"] = diagnose(log_dir)
    result["advisor"] = [advisor_check(os.path.join(log_dir, f"{name}_mixed_bfloat16"), name,
                                       "mixed_bfloat16", sizes)
                         for name in ("seed", "transformer")]
    for check in result["advisor"]:
        print(json.dumps({"advisor": check["model"], "projected": check["projection"],
                          "measured": check["measured"]}, default=float))
    import bench_paired_steps_jax

    times = bench_paired_steps_jax.measure("mixed_float16", paired["block"], paired["rounds"],
                                           samples=paired["samples"],
                                           past_first_sample=not args.tiny)
    with contextlib.redirect_stdout(io.StringIO()):
        result["paired_overhead"] = bench_paired_steps_jax.report(times, paired["block"])
    result["seconds"] = time.perf_counter() - started
    result["log_dir"] = log_dir
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2, default=float)
    print(json.dumps({k: result[k] for k in ("devices", "seconds")}))
    ok = all(run.get("steps_run") == sizes["steps"]
             and (run["xprof"]["window"] or {}).get("state") == "ok"
             for run in result["runs"] if "skipped" not in run)
    return 0 if ok and result["diagnosis"]["exit"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
