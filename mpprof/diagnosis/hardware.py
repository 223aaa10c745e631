"""Hardware rules: low Tensor Core use (MP010), hardware without fast half
precision (MP011) and the bfloat16 hint on GPUs that have it (MP013)."""

from __future__ import annotations

import numpy as np

from mpprof.diagnosis.core import NotApplicable, NotMeasured, finding, rule
from mpprof.diagnosis.numerics import quiet
from mpprof.diagnosis.view import RunView, layer_dtype
from mpprof.dtypes import (
    BF16_CAPABILITY,
    DTYPE_MAX,
    FP16_TENSOR_CORE_CAPABILITY,
)
from mpprof.records import schema

# MP010: share of GPU kernel time in Tensor Core kernels. Matmul/conv heavy
# models in mixed precision spend most GPU time there; under 20% means the
# eligible ops are not reaching the Tensor Cores.
LOW_TENSOR_CORE_SHARE = 0.20
# MP010 (NVML GPM): Tensor Core activity in percent while the GPU is busy.
LOW_TENSOR_UTIL_PERCENT = 5.0
# MP010: a GPU sample counts as "busy" above this utilisation in percent, so
# idle gaps (input pipeline, evaluation) do not dilute the Tensor Core figure.
BUSY_GPU_UTIL_PERCENT = 20.0


@rule("MP010", "warning", "low Tensor Core use on the GPU", view="gpu",
      data="GPU sampler / kernel stats", host=True)
def tensor_core_use(view: RunView) -> list:
    """Training in mixed precision on a GPU, but Tensor Core kernels take less
    than `LOW_TENSOR_CORE_SHARE` of GPU kernel time (XProf), or Tensor Core
    activity is below `LOW_TENSOR_UTIL_PERCENT` while the GPU is busy (GPM)."""
    view.require_mixed()
    hardware = view.hardware
    if hardware is not None and hardware.get("cpu_only"):
        raise NotApplicable("no GPU: Tensor Cores do not apply")
    gpu = view.gpu
    if gpu is None or (
        getattr(gpu, "mode", "unavailable") == "unavailable" and not gpu.kernels
    ):
        raise NotMeasured(
            "no GPU utilisation or kernel statistics were recorded (needs an NVIDIA "
            "GPU "
            "with NVML, or a profiler trace)"
        )
    kernels = getattr(gpu, "kernels", None) or {}
    share = kernels.get("tensor_core_share")
    if share is not None and not kernels.get("no_gpu_kernels"):
        if share >= LOW_TENSOR_CORE_SHARE:
            return []
        evidence = {
            "tensor_core_share": round(float(share), 4),
            "threshold": LOW_TENSOR_CORE_SHARE,
            "total_gpu_kernel_us": kernels.get("total_gpu_kernel_us"),
            "eligible_not_using_us": kernels.get("eligible_not_using_us"),
            "top_ops": kernels.get("top_ops", [])[:5],
        }
        title = f"Only {share:.0%} of GPU kernel time ran on Tensor Cores"
        # The layers of the eligible ops that missed them, the worst first
        # (a trace whose ops' eligibility is unknown lists none). An op's
        # eligibility is judged by its name alone, so a layer that computes in
        # float32 (a float32 head, kept so on purpose) is no miss: it is set
        # apart, never named as one.
        missed = list(dict.fromkeys(op.get("layer") or op.get("op_name")
                                    for op in evidence["top_ops"]))
        float32 = [name for name in missed if _computes_float32(view, name)]
        missed = [name for name in missed if name not in float32]
        if float32:
            evidence["float32_layers"] = float32
        if missed:
            title += f"; eligible ops missed them in {', '.join(map(str, missed[:3]))}"
        return [finding("MP010", title, evidence=evidence, fix=_tensor_core_fix(view))]
    util = _busy_tensor_util(gpu)
    if util is None:
        raise NotMeasured(
            "Tensor Core activity not measured (NVML GPM needs a Hopper or newer GPU; "
            "kernel statistics need a profiler trace)"
        )
    median, busy_samples = util
    if median >= LOW_TENSOR_UTIL_PERCENT:
        return []
    evidence = {
        "median_tensor_util_percent": round(median, 2),
        "threshold_percent": LOW_TENSOR_UTIL_PERCENT,
        "busy_samples": busy_samples,
        "mode": gpu.mode,
    }
    title = f"Tensor Cores {median:.1f}% active while the GPU was busy"
    return [finding("MP010", title, evidence=evidence, fix=_tensor_core_fix(view))]


def _computes_float32(view: RunView, path: str) -> bool:
    """Whether the inventory says the layer at `path` computed in float32."""
    layer = view.layer_at(path)
    return layer is not None and layer_dtype(layer) == "float32"


def _busy_tensor_util(gpu) -> tuple[float, int] | None:
    columns = tuple(schema.GPU_SAMPLE_COLUMNS)
    samples = getattr(gpu, "samples", None)
    if "tensor_util" not in columns or samples is None or not len(samples):
        return None
    samples = np.asarray(samples, dtype=np.float64).reshape(len(samples), -1)
    tensor = samples[:, columns.index("tensor_util")]
    busy = np.isfinite(tensor)
    for name in ("gpu_util", "sm_util"):
        if name in columns:
            activity = samples[:, columns.index(name)]
            busy &= ~(activity < BUSY_GPU_UTIL_PERCENT)  # NaN activity: keep the sample
            break
    if not busy.any():
        return None
    return float(np.median(tensor[busy])), int(busy.sum())


def _tensor_core_fix(view: RunView) -> str:
    misaligned = [name for found in quiet("MP007", view) for name in found.evidence["layers"]]
    lines = ["Tensor-Core-eligible work is not reaching the Tensor Cores:"]
    if misaligned:
        lines.append(
            f"- round the GEMM dimensions of {', '.join(misaligned[:5])} to the "
            "multiples MP007 names;"
        )
    lines.append("- use batch sizes and sequence lengths that are multiples of 8;")
    lines += view.syntax.faster_step()
    return "\n".join(lines)


@rule("MP011", "warning", "hardware without fast half precision", view="overview",
      data="hardware", host=True)
def hardware(view: RunView) -> list:
    """mixed_float16 on a CPU only or on a GPU below compute capability 7.0;
    mixed_bfloat16 on a GPU below 8.0."""
    half = view.require_mixed()
    hardware = view.hardware
    if hardware is None:
        raise NotMeasured("the GPUs' compute capability was not recorded")
    gpus = hardware.get("gpus") or []
    if hardware.get("cpu_only") or not gpus:
        if half != "float16":
            raise NotApplicable("bfloat16 on CPU: speed depends on AVX512_BF16/AMX")
        evidence = {
            "cpu_only": True,
            "devices": [d.get("name") for d in view.context.devices],
        }
        fix = (
            "CPUs have no float16 Tensor Cores: mixed_float16 is usually slower than "
            "float32 there (2x to 50x in mpprof's tests, by the backend's CPU "
            "kernels). Train in float32 on this machine, or in bfloat16 if the "
            "CPU has AVX512_BF16/AMX:\n"
            f"    {view.syntax.set_policy('mixed_bfloat16')}  # or \"float32\""
        )
        title = (
            "mixed_float16 on a CPU only: no float16 Tensor Cores, expect a slow-down"
        )
        return [finding("MP011", title, evidence=evidence, fix=fix)]
    needed = FP16_TENSOR_CORE_CAPABILITY if half == "float16" else BF16_CAPABILITY
    slow = [gpu for gpu in gpus if not _gpu_supports(gpu, half, needed)]
    if not slow:
        return []
    evidence = {
        "gpus": [
            {"name": g.get("name"), "compute_capability": g.get("compute_capability")}
            for g in slow
        ],
        "needs_compute_capability": list(needed),
    }
    fix = (
        f"{slow[0].get('name')} (compute capability "
        f"{_capability_text(slow[0])}) has no fast {half} units: mixed precision saves "
        "memory but not time there. Train in float32:\n"
        f"    {view.syntax.set_policy('float32')}"
    )
    title = f"{half} on a GPU without fast {half} math ({slow[0].get('name')})"
    return [finding("MP011", title, evidence=evidence, fix=fix)]


def _gpu_supports(gpu: dict, dtype: str, needed: tuple[int, int]) -> bool:
    flag = gpu.get("fp16_tensor_cores" if dtype == "float16" else "bf16")
    if flag is not None:
        return bool(flag)
    capability = gpu.get("compute_capability")
    return capability is None or tuple(capability) >= needed


def _capability_text(gpu: dict) -> str:
    capability = gpu.get("compute_capability")
    return ".".join(str(c) for c in capability) if capability else "unknown"


@rule("MP013", "info", "frequent fp16 overflows on hardware with bfloat16",
      view="overview", data="loss scale, hardware")
def bfloat16_hint(view: RunView) -> list:
    """MP001, MP002 or MP003 fired on float16 while every GPU supports
    bfloat16 (compute capability 8.0+)."""
    if view.require_mixed() != "float16":
        raise NotApplicable("the model does not train in float16")
    hardware = view.hardware
    if hardware is None:
        raise NotMeasured("the GPUs' bfloat16 support was not recorded")
    gpus = hardware.get("gpus") or []
    if hardware.get("cpu_only") or not gpus:
        raise NotApplicable("no GPU (for CPUs see MP011)")
    if not all(_gpu_supports(gpu, "bfloat16", BF16_CAPABILITY) for gpu in gpus):
        return []
    triggers = [found for code in ("MP001", "MP002", "MP003") for found in quiet(code, view)]
    if not triggers:
        return []
    evidence = {
        "because_of": sorted({f.code for f in triggers}),
        "gpus": [g.get("name") for g in gpus],
    }
    if view.loss_scale is not None:
        evidence["overflows"] = view.loss_scale.skipped_steps
    fix = (
        f"{gpus[0].get('name')} supports bfloat16, which has float32's exponent range: "
        f"no overflows at {DTYPE_MAX['float16']:g} and no loss scaling needed, at the same speed:\n"
        f"    {view.syntax.set_policy('mixed_bfloat16')}\n"
        "(set it before building the model; a LossScaleOptimizer is then unnecessary)"
    )
    title = "Frequent float16 overflows on a GPU with bfloat16: try mixed_bfloat16"
    step = min((f.step for f in triggers if f.step is not None), default=None)
    return [finding("MP013", title, step=step, evidence=evidence, fix=fix)]




# TF32 (float32 matmuls on Tensor Cores, 10 mantissa bits) came with Ampere.
TF32_CAPABILITY = (8, 0)


@rule("MP021", "info", "float32 layers run their matmuls in TF32 on this GPU",
      view="inventory", data="inventory, context (float32 matmuls)")
def float32_islands_in_tf32(view: RunView) -> list:
    """A mixed-precision run pins layers to float32 (float32 islands with a
    GEMM), but on its GPU (Ampere or newer) the framework runs float32
    matmuls and convolutions in TF32 (TensorFlow's default
    `tensor_float_32_execution_enabled()`, JAX's default matmul precision):
    their products round to 10 mantissa bits, as float16's do, keeping only
    float32's range. An island kept for precision does not get it. The
    model's float32 output layer is not named: it is float32 for the softmax
    and loss after its matmul, which stay float32."""
    view.require_mixed()
    matmuls = view.context.float32_matmuls
    if matmuls is None:
        raise NotMeasured("the run context does not say what float32 matmuls run as "
                          "(recorded by an older mpprof)")
    hardware = view.hardware
    if hardware is None:
        raise NotMeasured("the GPU is not known")
    if hardware.get("cpu_only"):
        raise NotApplicable("no GPU: float32 matmuls run in float32 on a CPU")
    tf32_gpus = [g for g in hardware.get("gpus") or []
                 if g.get("compute_capability")
                 and tuple(g["compute_capability"]) >= TF32_CAPABILITY]
    if not tf32_gpus:
        raise NotApplicable("the GPU has no TF32 (before Ampere): float32 is float32")
    if not matmuls.get("tf32_enabled"):
        return []
    inventory = view.require_inventory()
    # The model's output is float32 for what follows its matmul (the softmax
    # and the loss, still float32): TF32 does not undo that (MP006's fix).
    outputs = {o.get("producer") for o in inventory.get("model", {}).get("outputs", [])}
    islands = [layer["name"] for layer in inventory.get("layers", [])
               if layer.get("float32_island") and layer.get("gemm_dims")
               and layer["name"] not in outputs]
    if not islands:
        return []
    shown = ", ".join(islands[:8]) + (f" and {len(islands) - 8} more" if len(islands) > 8 else "")
    evidence = {"layers": islands, "float32_matmuls": matmuls.get("setting"),
                "gpu": tf32_gpus[0].get("name"),
                "compute_capability": tf32_gpus[0].get("compute_capability")}
    fix = (
        f"Layers pinned to float32 ({shown}) run their matmuls in TF32 here "
        f"({matmuls.get('setting')}): float32's range, float16's 10-bit mantissa. If they "
        "are float32 for range (overflow), that is enough: `mpprof advise LOGDIR` says "
        "which islands the data need at all. If they are float32 for precision, turn "
        f"TF32 off before building the model:\n    {matmuls.get('disable')}\n"
        "(every float32 matmul then runs at float32 speed: up to 8x slower on an A100).")
    title = f"{len(islands)} float32 layer(s) run their matmuls in TF32 on this GPU"
    return [finding("MP021", title, layer=islands[0], evidence=evidence, fix=fix)]
