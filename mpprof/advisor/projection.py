"""The speed a plan buys, projected: a roofline per GEMM on a GPU of the table.

The model (docs/advisor.md says it with its assumptions):

- Each of a layer's GEMMs runs three times a step with the same FLOPs,
  2·B·M·N·K each (the forward pass and the gradients of its two operands;
  B = 1 but for attention's batched products, B = batch x heads), and each
  moves its two operands and its result once: B·(M·K + K·N + M·N) elements.
  Attention runs two: QK^T (M = queries, N = keys, K = key_dim) and AV
  (M = queries, N = value_dim, K = keys); its projections are their own
  layers' GEMMs.
- A GEMM takes max(FLOPs / (peak · COMPUTE_EFFICIENCY), bytes / (bandwidth ·
  MEMORY_EFFICIENCY)): compute bound or memory bound, whichever is slower.
  The efficiencies are torchao's float8 roofline's (78% of peak GEMM, 92% of
  peak bandwidth); small GEMMs reach less, so small layers are optimistic.
- float32 runs as TF32 where the GPU has it and the run had it on (the run
  context's `float32_matmuls`; TensorFlow's and JAX's default).
- Casts move memory: a layer whose compute dtype differs from its input's
  casts the input (forward) and its gradient (backward), M·K elements each,
  read in one dtype and written in the other (attention's products cast
  nothing: their operands are made inside the layer); a half-precision or float8
  layer casts its float32 kernel (K·N) each step, forward and backward; a
  float8 layer also reads each quantized tensor once more for its amax.
- Amdahl: only the GEMMs change; where the run measured its step on the same
  GPU, the step's other time stays. The GEMMs' share of the step is measured
  where it can be: XProf's kernel times over the run's profile window (the
  Tensor-Core-eligible ops' kernels per traced step, over the measured step
  time; without a step time, their share of all GPU kernel time), else the
  roofline's GEMM time over the measured step. The result names its source.
"""

from __future__ import annotations

import dataclasses

from mpprof.advisor import gpus
from mpprof.advisor.facts import Gemm, LayerFacts
from mpprof.advisor.gpus import Gpu
from mpprof.advisor.plan import FLOAT8, Plan

COMPUTE_EFFICIENCY = 0.78
MEMORY_EFFICIENCY = 0.92
# A step's GEMMs: forward, data gradient, weight gradient.
GEMMS_PER_STEP = 3


def mode_of(dtype: str, gpu: Gpu, tf32_enabled: bool | None) -> str:
    """The Tensor Core mode a GEMM computing in `dtype` runs in on `gpu`
    (a dtype the GPU has no Tensor Cores for runs as float32 would)."""
    if dtype == FLOAT8:
        if gpu.tflops.get(gpus.FP8):
            return gpus.FP8
        dtype = "float16" if gpu.tflops.get(gpus.FP16) else "float32"
    if dtype in ("float16", "bfloat16"):
        mode = gpu.half_mode(dtype)
        if mode is not None:
            return mode
    return gpu.float32_mode(tf32_enabled)


def gemm_seconds(gemm: Gemm, mode: str, gpu: Gpu) -> tuple[float, str]:
    """(seconds for this GEMM's three products in one step, "compute" or
    "memory"); a batched GEMM moves each of its `batch` products' operands."""
    flops = gemm.forward_flops
    moved = gemm.batch * (gemm.m * gemm.k + gemm.k * gemm.n + gemm.m * gemm.n) * gpus.BYTES[mode]
    compute = flops / (gpu.peak(mode) * COMPUTE_EFFICIENCY)
    memory = moved / (gpu.bandwidth * MEMORY_EFFICIENCY)
    bound = "compute" if compute >= memory else "memory"
    return GEMMS_PER_STEP * max(compute, memory), bound


def cast_bytes(gemm: Gemm, mode: str, input_mode: str) -> float:
    """Bytes one step's casts of this GEMM move (see the module docstring).
    Attention's products cast nothing: both operands are made inside the
    layer, in its dtype (its projections' casts are theirs)."""
    size = gpus.BYTES[mode]
    moved = 0.0
    if not gemm.weights:
        return moved
    if gpus.BYTES[input_mode] != size or (mode == gpus.FP8) != (input_mode == gpus.FP8):
        moved += 2 * gemm.m * gemm.k * (gpus.BYTES[input_mode] + size)
    if size < 4:
        moved += 2 * gemm.k * gemm.n * (4 + size)
    if mode == gpus.FP8:
        moved += (gemm.m * gemm.k + gemm.k * gemm.n + gemm.m * gemm.n) * 2
    return moved


def layer_seconds(gemms: list[Gemm], mode: str, gpu: Gpu) -> tuple[float, str]:
    """(seconds for a layer's GEMMs in one step, the bound of its slowest)."""
    timed = [gemm_seconds(g, mode, gpu) for g in gemms]
    return sum(t for t, _ in timed), max(timed)[1]


@dataclasses.dataclass
class KernelTimes:
    """The run's XProf kernel table over its profile window
    (`kernels/tensor_core_share`, `mpprof.backends.xprof_kernels`).

    Attributes:
        gemm_us: the kernel time of the ops XProf calls Tensor-Core eligible
            (matmuls, convolutions, einsums: the GEMMs a plan changes).
        total_us: all GPU kernel time.
        steps: how many train steps the trace holds, None when unknown (a
            trace of TensorBoard's `profile_batch`).
        source: the profiling session read.
    """

    gemm_us: float
    total_us: float
    steps: int | None
    source: str


# Where the whole step's Amdahl took the GEMMs' share of the step from.
AMDAHL_XPROF_STEP = "xprof kernel times over the measured step"
AMDAHL_XPROF_SHARE = "xprof kernel times' share of GPU kernel time"
AMDAHL_ROOFLINE = "roofline GEMM time over the measured step"


def gemm_share(kernels: KernelTimes | None, measured_step_s: float | None,
               roofline_now_s: float) -> tuple[float, str, str] | None:
    """The GEMMs' share of the step, its source and how it was read.

    Measured where the run has a profile window: the GEMM kernels' time per
    traced step over the measured step time, or (no step time) their share
    of all GPU kernel time, the step taken as GPU-bound. Else the roofline's
    GEMM time over the measured step. None without either.
    """
    if kernels is not None and kernels.gemm_us > 0 and kernels.total_us > 0:
        if kernels.steps and measured_step_s:
            per_step = kernels.gemm_us * 1e-6 / kernels.steps
            return (min(per_step / measured_step_s, 1.0), AMDAHL_XPROF_STEP,
                    f"XProf: GEMM kernels {per_step * 1e6:.4g} us per step over "
                    f"{kernels.steps} traced steps, of a measured "
                    f"{measured_step_s * 1e3:.4g} ms step")
        return (kernels.gemm_us / kernels.total_us, AMDAHL_XPROF_SHARE,
                f"XProf: GEMM kernels {kernels.gemm_us:.4g} us of {kernels.total_us:.4g} us "
                "of GPU kernel time, the step taken as GPU-bound (no measured step time "
                "or traced step count)")
    if measured_step_s and roofline_now_s > 0:
        return (min(roofline_now_s / measured_step_s, 1.0), AMDAHL_ROOFLINE,
                f"the roofline's GEMM time {roofline_now_s * 1e6:.4g} us over a measured "
                f"{measured_step_s * 1e3:.4g} ms step (no XProf kernel times: "
                "MixedPrecisionProfiler(profile_steps=(start, stop)) records them)")
    return None


@dataclasses.dataclass
class LayerTime:
    layer: str
    flops: float
    now_mode: str
    plan_mode: str
    now_s: float
    plan_s: float
    now_bound: str
    plan_bound: str
    now_cast_s: float
    plan_cast_s: float
    # A float8 layer's time in the plan's half dtype instead: whether float8
    # pays at these shapes on this GPU (its quantization casts included).
    half_s: float | None = None

    @property
    def float8_pays(self) -> bool | None:
        if self.half_s is None:
            return None
        return self.plan_s + self.plan_cast_s < self.half_s

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "float8_pays": self.float8_pays}


def project(plan: Plan, facts: list[LayerFacts], gpu: Gpu, tf32_enabled: bool | None,
            measured_step_s: float | None = None,
            kernels: KernelTimes | None = None) -> dict:
    """The plan's GEMM time against the current policy's on `gpu`.

    Args:
        tf32_enabled: whether float32 matmuls ran as TF32 (None: unknown,
            taken as the frameworks' default, on).
        measured_step_s: the run's own step time on this GPU, for Amdahl.
        kernels: the run's XProf kernel times on this GPU, for Amdahl.
    """
    by_name = {f.name: f for f in facts}
    now_dtype = {r.layer: r.now for r in plan.rows}
    plan_dtype = {r.layer: r.planned for r in plan.rows}
    layers, unsized = [], []
    for row in plan.rows:
        fact = by_name[row.layer]
        if not fact.gemms:
            if fact.gemm_dims:
                unsized.append(row.layer)
            continue
        now_mode = mode_of(row.now, gpu, tf32_enabled)
        plan_mode = mode_of(row.planned, gpu, tf32_enabled)
        now_s, now_bound = layer_seconds(fact.gemms, now_mode, gpu)
        plan_s, plan_bound = layer_seconds(fact.gemms, plan_mode, gpu)
        half_s = None
        if row.planned == FLOAT8:
            half = mode_of(plan.half_dtype, gpu, tf32_enabled)
            half_s = layer_seconds(fact.gemms, half, gpu)[0] + _cast_s(
                fact, half, plan_dtype, gpu, tf32_enabled)
        layers.append(LayerTime(
            layer=row.layer, flops=sum(g.step_flops for g in fact.gemms), now_mode=now_mode,
            plan_mode=plan_mode, now_s=now_s, plan_s=plan_s, now_bound=now_bound,
            plan_bound=plan_bound,
            now_cast_s=_cast_s(fact, now_mode, now_dtype, gpu, tf32_enabled),
            plan_cast_s=_cast_s(fact, plan_mode, plan_dtype, gpu, tf32_enabled),
            half_s=half_s))
    now = sum(t.now_s + t.now_cast_s for t in layers)
    planned = sum(t.plan_s + t.plan_cast_s for t in layers)
    result = {
        "gpu": gpu.name, "gpu_full_name": gpu.full_name, "source": gpu.source,
        "float32_runs_as": gpu.float32_mode(tf32_enabled),
        "assumptions": {
            "compute_efficiency": COMPUTE_EFFICIENCY,
            "memory_efficiency": MEMORY_EFFICIENCY,
            "gemms_per_step": GEMMS_PER_STEP,
        },
        "layers": [t.to_dict() for t in layers],
        "unsized_layers": unsized,
        "gemm_seconds_now": now,
        "gemm_seconds_plan": planned,
        "gemm_speedup": (now / planned) if planned > 0 else None,
        "measured_step_seconds": measured_step_s,
        "step_speedup": None,
        "amdahl_source": None,
        "label": "projection",
    }
    found = gemm_share(kernels, measured_step_s, now) if planned > 0 and now > 0 else None
    if found is not None:
        share, source, detail = found
        result["gemm_share_of_step"] = share
        result["amdahl_source"], result["amdahl_detail"] = source, detail
        result["step_speedup"] = 1.0 / ((1.0 - share) + share * planned / now)
    return result


def _cast_s(fact: LayerFacts, mode: str, dtype_of: dict[str, str], gpu: Gpu,
            tf32_enabled: bool | None) -> float:
    producer = fact.producer
    source = dtype_of.get(producer, "float32") if producer else "float32"
    if source == FLOAT8:
        source = "float16"  # a float8 layer outputs its half compute dtype
    input_mode = mode_of(source, gpu, tf32_enabled)
    moved = sum(cast_bytes(g, mode, input_mode) for g in fact.gemms)
    return moved / (gpu.bandwidth * MEMORY_EFFICIENCY)
