"""Device check for mpprof's NVML sampler, on a machine with an NVIDIA GPU.

Runs the sampler (mpprof/collectors/gpu.py) while PyTorch (or CuPy) keeps the
GPU busy with an fp16 matmul load, then an fp32 one (TF32 off), and prints
the Tensor Core utilization NVML reported in each phase. On Hopper or newer
(GPM mode) the fp16 phase must read clearly higher; on older GPUs (basic
mode) NVML cannot see Tensor Cores and only kernel utilization is printed.

Needs no TensorFlow: the sampler module is loaded without mpprof's package
`__init__` (which imports TensorFlow). Needs nvidia-ml-py and torch or cupy.

    python benchmarks/gpu_check.py               # 8 s per phase
    python benchmarks/gpu_check.py --seconds 15 --size 8192
    python benchmarks/gpu_check.py --dry-run     # no load: mode and reason only

Exit status: 0 when the check passed (or could not apply: basic mode, dry
run), 1 when GPM readings did not rise under fp16, 2 when no GPU/no library.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import types
from pathlib import Path

import tiny  # benchmarks/, on the path when run as a script

REPO = Path(__file__).resolve().parents[1]


def load_sampler_module():
    """Imports mpprof.recording.nvml.sampler without running mpprof/__init__.py."""
    for name, path in (("mpprof", REPO / "mpprof"),
                       ("mpprof.recording.collectors", REPO / "mpprof" / "collectors")):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(path)]
            sys.modules[name] = package
    return importlib.import_module("mpprof.recording.nvml.sampler")


class _TorchLoad:
    name = "torch"

    def __init__(self, size: int):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        # fp32 matmuls must not slip onto Tensor Cores as TF32.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        self.torch, self.size = torch, size
        self.device_name = torch.cuda.get_device_name(0)

    def run(self, dtype_name: str, seconds: float) -> int:
        torch = self.torch
        dtype = {"fp16": torch.float16, "fp32": torch.float32}[dtype_name]
        a = torch.randn(self.size, self.size, device="cuda", dtype=dtype)
        b = torch.randn(self.size, self.size, device="cuda", dtype=dtype)
        done, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            for _ in range(10):
                a @ b
            torch.cuda.synchronize()
            done += 10
        return done


class _CupyLoad:
    name = "cupy"

    def __init__(self, size: int):
        import cupy

        self.cupy, self.size = cupy, size
        self.device_name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()

    def run(self, dtype_name: str, seconds: float) -> int:
        cupy = self.cupy
        dtype = {"fp16": cupy.float16, "fp32": cupy.float32}[dtype_name]
        a = cupy.random.standard_normal((self.size, self.size)).astype(dtype)
        b = cupy.random.standard_normal((self.size, self.size)).astype(dtype)
        done, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            for _ in range(10):
                a @ b
            cupy.cuda.Device().synchronize()
            done += 10
        return done


def _load_generator(size: int):
    errors = []
    for kind in (_TorchLoad, _CupyLoad):
        try:
            return kind(size)
        except Exception as e:  # noqa: BLE001 - try the next library
            errors.append(f"{kind.name}: {e}")
    raise SystemExit("No GPU load generator: " + "; ".join(errors))


def _phase_means(gpu, rows, start: float, end: float) -> dict:
    columns = gpu.COLUMNS
    inside = rows[(rows[:, 0] >= start) & (rows[:, 0] <= end) & (rows[:, 2] == 0)]
    means = {"samples": len(inside)}
    for name in ("tensor_util", "hmma_tensor_util", "fp16_util", "fp32_util",
                 "sm_util", "gpu_util", "power_w", "sm_clock_mhz"):
        values = inside[:, columns.index(name)]
        values = values[values == values]  # drop NaN
        means[name] = float(values.mean()) if len(values) else float("nan")
    return means


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="per phase")
    parser.add_argument("--size", type=int, default=8192, help="matmul side")
    parser.add_argument("--interval", type=float, default=0.2, help="sampling s")
    parser.add_argument("--dry-run", action="store_true",
                        help="only start and stop the sampler; no load")
    args = tiny.parse_args(parser, argv, dry_run=True)

    gpu = load_sampler_module()
    sampler = gpu.GpuSampler(args.interval)
    sampler.start()
    print(f"mode: {sampler.mode}")
    print(f"reason: {sampler.reason}")
    print(f"tensorflow imported: {'tensorflow' in sys.modules}")
    if args.dry_run or sampler.mode == gpu.MODE_UNAVAILABLE:
        sampler.stop()
        return 0 if args.dry_run else 2

    try:
        load = _load_generator(args.size)
        print(f"load: {load.name} on {load.device_name}, {args.size}^2 matmuls")
        phases = {}
        phase_index = 0
        sampler.step_source = lambda: phase_index  # each row's phase
        for phase in ("idle", "fp16", "fp32"):
            start = time.time()
            if phase == "idle":
                time.sleep(min(args.seconds, 3.0))
                work = 0
            else:
                phase_index += 1
                work = load.run(phase, args.seconds)
            phases[phase] = (start, time.time(), work)
        time.sleep(2 * args.interval)
    finally:
        sampler.stop()
    rows = sampler.drain()

    print(f"{'phase':6} {'n':>4} {'tensor%':>8} {'hmma%':>7} {'fp16%':>6} "
          f"{'fp32%':>6} {'sm%':>6} {'gpu%':>6} {'W':>6} {'MHz':>6} matmuls")
    means = {}
    for phase, (start, end, work) in phases.items():
        m = means[phase] = _phase_means(gpu, rows, start, end)
        print(f"{phase:6} {m['samples']:4d} {m['tensor_util']:8.1f} "
              f"{m['hmma_tensor_util']:7.1f} {m['fp16_util']:6.1f} "
              f"{m['fp32_util']:6.1f} {m['sm_util']:6.1f} {m['gpu_util']:6.1f} "
              f"{m['power_w']:6.0f} {m['sm_clock_mhz']:6.0f} {work}")
    if sampler.warnings:
        print("warnings:", *sampler.warnings, sep="\n  ")
    print("metric failures:", sampler.context().get("metric_failures", {}))

    if sampler.mode != gpu.MODE_GPM:
        print("RESULT: basic mode: NVML cannot see Tensor Cores on this GPU; "
              "gpu_util shows both loads keep it busy")
        return 0
    fp16, fp32 = means["fp16"]["tensor_util"], means["fp32"]["tensor_util"]
    passed = fp16 > fp32 + 10.0 and fp16 > means["idle"]["tensor_util"] + 10.0
    print(f"RESULT: {'PASS' if passed else 'FAIL'}: tensor_util fp16 {fp16:.1f}% "
          f"vs fp32 {fp32:.1f}% (idle {means['idle']['tensor_util']:.1f}%)")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
