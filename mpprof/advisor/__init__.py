"""The precision advisor: which layers can go lower, which must stay float32,
and the speed it buys (`mpprof advise LOGDIR`, `mpprof.advise(...)`).

Framework-free: it reads a recorded run (`mpprof.records`) and judges it
(`facts` -> `plan` -> `projection`). Only the verification replays the plan,
through the engine of the backend that trained the run
(`mpprof.advisor.verify`, imported when asked for).

Example:

```python
import mpprof
advice = mpprof.advise("logs/run1", gpu="H100")
print(advice["plan"]["code"])
```
"""

from __future__ import annotations

import json
import os

import numpy as np

from mpprof.advisor import gpus
from mpprof.advisor.facts import layer_facts
from mpprof.advisor.plan import half_dtype_of, make_plan
from mpprof.advisor.projection import KernelTimes, project
from mpprof.jsonsafe import json_safe
from mpprof.records import filesystem, reader, schema
from mpprof.records.run import Run
from mpprof.replay import files as replay_files

__all__ = ["advise", "advise_run", "gpus", "saved_verification"]

# What a run needs for each part of the advice, told when it is missing.
HOW_TO_SAMPLE = ("record numerics samples: MixedPrecisionProfiler(log_dir, "
                 "numerics_every=N) (the default samples every 500 steps)")
HOW_TO_CAPTURE = ("record batches to verify on: MixedPrecisionProfiler(log_dir, "
                  "advise_batches=4) keeps 4 of the run's own batches, spread across it, "
                  "and the weights at capture")


def advise(logdir: str | os.PathLike, run: str | None = None, *, gpu: str | None = None,
           verify: bool = False) -> dict:
    """The advice for one run of `logdir`: facts, plan, projection.

    Args:
        logdir: the LOG_DIR the profiler wrote (local or fsspec URL).
        run: the run, as `mpprof summary` names it (default: the logdir's
            only run, or its "train" run).
        gpu: the GPU to project for ("H100", "A100", ...: `gpus.known()`);
            default: the run's own GPU, else H100.
        verify: replay the plan on the run's advise batches (imports the
            framework that trained it).

    Returns:
        A strict-JSON dict: `run`, `facts` (per layer), `plan` (the three
        parts and `code`), `projection`, `verification`, `baseline`, `notes`.

    Raises:
        mpprof.advisor.gpus.UnknownGpuError: `gpu` is not in the table.
        ValueError: several runs and no `run` (the message lists them).
        mpprof.records.reader.NoMpprofDataError / LogdirNotFoundError.
    """
    chosen = gpus.gpu(gpu) if gpu is not None else None
    names = reader.select_runs(logdir, run)
    if len(names) > 1 and schema.TRAIN_RUN not in names:
        raise ValueError(f"{os.fspath(logdir)} holds {len(names)} runs ({', '.join(names)}): "
                         "pass run= one of them")
    name = names[0] if len(names) == 1 else schema.TRAIN_RUN
    found = reader.read_run(logdir, name)
    advice = advise_run(found, gpu=chosen)
    advice["verification"] = _verification(logdir, name, advice, verify)
    sensitivity = advice["verification"].get("sensitivity") or {}
    for fact in advice["facts"]:
        fact["sensitivity"] = {dtype: rows.get(fact["name"]) for dtype, rows in
                               sensitivity.items() if isinstance(rows, dict)} or None
    return json_safe(advice)


def advise_run(run: Run, gpu: gpus.Gpu | None = None) -> dict:
    """The unverified advice for a read run (see `advise`)."""
    context = run.context
    notes = []
    own_gpu = _run_gpu(context)
    target = gpu or own_gpu or gpus.GPUS["h100"]
    if gpu is None and own_gpu is None:
        notes.append("the run trained without a known GPU: projected for H100 "
                     "(--gpu NAME picks another)")
    facts = layer_facts(run)
    if run.inventory is None:
        notes.append("no precision inventory was recorded (the train step was never "
                     "traced): nothing to advise on")
    if run.numerics is None:
        notes.append(f"no numerics samples: headroom and underflow unknown, nothing is "
                     f"changed without them; {HOW_TO_SAMPLE}")
    matmuls = context.float32_matmuls
    tf32 = matmuls.get("tf32_enabled") if matmuls else None
    half = half_dtype_of(context.model_policy, facts, bool(target.tflops.get(gpus.BF16)))
    plan = make_plan(facts, context.model_policy, half, context.keras_flavor)
    # The run's own step and kernel times count only on the GPU they ran on.
    step_s = _measured_step_seconds(run) if own_gpu is target else None
    kernels = _kernel_times(run) if own_gpu is target else None
    projection = project(plan, facts, target, tf32, step_s, kernels)
    if projection["step_speedup"] is None:
        projection["step_note"] = (
            "GEMM time only: the whole step's speedup needs the run's own step time on "
            f"{target.name} (train there with the profiler's GPU sampler on)")
    return {
        "run": run.name,
        "backend": context.keras_backend,
        "baseline": {
            "model_policy": context.model_policy,
            "float32_matmuls": matmuls or {
                "setting": "not recorded (a run from an older mpprof): taken as the "
                           "frameworks' default, TF32 on"},
            "float32_runs_as": target.float32_mode(tf32),
        },
        "facts": [f.to_dict() for f in facts],
        "plan": plan.to_dict(),
        "projection": projection,
        "notes": notes,
    }


# Where `--verify` saves its result, beside the kept batches.
VERIFICATION_FILE = "verification.json"


def _verification(logdir, run: str, advice: dict, verify: bool) -> dict:
    """What verification there is: the result when `verify` ran it (saved
    beside the batches), else the saved one, else the plan labelled
    unverified with how to record what verification needs."""
    logdir = os.fspath(logdir)
    run_path = logdir if run == "." else filesystem.join(logdir, run)
    if not verify:
        return saved_verification(run_path)
    captures = replay_files.find_captures(run_path, ".", folder=replay_files.ADVISE_FOLDER)
    if not captures:
        return _unverified(0)
    from mpprof.advisor import verify as verifying

    # The steps that went wrong too (replay captures): the plan must hold on
    # the batches that overflowed, not only on healthy ones.
    wrong = replay_files.find_captures(run_path, ".")
    producers = {f["name"]: f["producer"] for f in advice["facts"] if f["float8_eligible"]}
    result = json_safe(verifying.verify(logdir, run, advice["plan"], captures, wrong,
                                        producers))
    if result["state"] != "failed":
        result["plan_code"] = advice["plan"]["code"]
        try:
            filesystem.write_bytes(
                filesystem.join(run_path, replay_files.ADVISE_FOLDER, VERIFICATION_FILE),
                replay_files.json_bytes(result))
        except OSError as e:
            result["not_saved"] = filesystem.error_text(e)
    return result


def saved_verification(run_path: str) -> dict:
    """The verification `mpprof advise --verify` saved for the run at
    `run_path`, or the unverified state (how many batches there are to
    verify on, and how to record them)."""
    captures = replay_files.find_captures(run_path, ".", folder=replay_files.ADVISE_FOLDER)
    if not captures:
        return _unverified(0)
    try:
        with filesystem.open_file(filesystem.join(
                run_path, replay_files.ADVISE_FOLDER, VERIFICATION_FILE)) as f:
            saved = json.loads(f.read())
        return {**saved, "saved": True}
    except (OSError, ValueError):
        return _unverified(len(captures))


def _unverified(batches: int) -> dict:
    if not batches:
        return {"state": "unverified", "batches": 0,
                "detail": f"unverified: the run holds no advise batches; {HOW_TO_CAPTURE}"}
    return {"state": "unverified", "batches": batches,
            "detail": (f"unverified: {batches} advise batches recorded; verify with "
                       "`mpprof advise LOGDIR --verify`")}


def _run_gpu(context) -> gpus.Gpu | None:
    hardware = context.hardware or {}
    for device in hardware.get("gpus") or []:
        try:
            return gpus.gpu(str(device.get("name", "")))
        except gpus.UnknownGpuError:
            continue
    return None


def _kernel_times(run: Run) -> KernelTimes | None:
    """The run's XProf kernel table (its profile window), if it holds GPU kernels."""
    table = run.gpu.kernels if run.gpu is not None else None
    if not table or table.get("no_gpu_kernels"):
        return None
    traced = run.context.collector("kernels").get("traced_steps")
    steps = int(traced[1]) - int(traced[0]) + 1 if traced and len(traced) == 2 else None
    return KernelTimes(gemm_us=float(table.get("eligible_us") or 0.0),
                       total_us=float(table.get("total_gpu_kernel_us") or 0.0),
                       steps=steps if steps and steps > 0 else None,
                       source=str(table.get("source", "")))


def _measured_step_seconds(run: Run) -> float | None:
    """The run's median seconds per step: between the GPU sampler's samples
    (each holds the step it saw) where it sampled, else between loss-scale
    reads."""
    gpu = run.gpu
    if gpu is not None and len(gpu.samples):
        points = set(zip(gpu.column("step").tolist(), gpu.column("wall_time").tolist(),
                         strict=True))
        found = _median_rate(points)
        if found is not None:
            return found
    records = run.records.get(schema.LOSS_SCALE_PROGRESS) or []
    return _median_rate({(float(np.asarray(r.value)[0]), r.wall_time) for r in records})


def _median_rate(points: set[tuple[float, float]]) -> float | None:
    """The median seconds per step between consecutive (step, wall time)
    points of different steps (each step at its first time)."""
    first: dict[float, float] = {}
    for step, wall in points:
        if np.isfinite(step) and np.isfinite(wall):
            first[step] = min(wall, first.get(step, wall))
    ordered = sorted(first.items())
    rates = [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in zip(ordered, ordered[1:],
                                                                   strict=False)
             if s1 > s0 and t1 > t0]
    return float(np.median(rates)) if rates else None
