"""Dense Tensor Core throughput and memory bandwidth of the GPUs the advisor
projects for.

Every figure is the vendor's datasheet figure WITHOUT structured sparsity
(datasheets print the sparse figure, twice the dense one, with an asterisk),
for the SXM / highest-bandwidth form of each GPU. The sources are listed per
GPU (`source`) and in docs/advisor.md. A `None` throughput means the GPU has
no such Tensor Core mode: V100 and T4 have no TF32 (float32 matmuls run on
the CUDA cores) and no bfloat16; nothing before Hopper (and Ada's L4) has FP8.
"""

from __future__ import annotations

import dataclasses

# The compute modes a GEMM can run in, as the advisor names them.
FP32 = "fp32"
TF32 = "tf32"
FP16 = "fp16"
BF16 = "bf16"
FP8 = "fp8"
MODES = (FP32, TF32, FP16, BF16, FP8)

# Bytes per element each mode reads and writes (TF32 reads float32 tensors).
BYTES = {FP32: 4, TF32: 4, FP16: 2, BF16: 2, FP8: 1}


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One GPU's peak figures.

    Attributes:
        name: the short name `--gpu` takes ("H100").
        full_name: the model the figures are for.
        tflops: dense peak TFLOPS per mode (None: no such mode).
        bandwidth_tbs: memory bandwidth in TB/s (10**12 bytes per second).
        source: the datasheet the figures come from.
    """

    name: str
    full_name: str
    tflops: dict[str, float | None]
    bandwidth_tbs: float
    source: str

    def peak(self, mode: str) -> float | None:
        """Dense peak FLOP/s of `mode`, or None where the GPU lacks it."""
        value = self.tflops.get(mode)
        return None if value is None else value * 1e12

    @property
    def bandwidth(self) -> float:
        """Memory bandwidth in bytes per second."""
        return self.bandwidth_tbs * 1e12

    def float32_mode(self, tf32_enabled: bool | None) -> str:
        """What a float32 matmul runs as: TF32 where the GPU has it and the
        framework enables it (TensorFlow's default, JAX's default matmul
        precision on A100/H100), else FP32."""
        if tf32_enabled is not False and self.tflops.get(TF32):
            return TF32
        return FP32

    def half_mode(self, dtype: str) -> str | None:
        """The mode a float16/bfloat16 GEMM runs in, or None when the GPU has
        no Tensor Cores for it."""
        mode = FP16 if dtype == "float16" else BF16
        return mode if self.tflops.get(mode) else None


GPUS: dict[str, Gpu] = {gpu.name.lower(): gpu for gpu in (
    Gpu("V100", "NVIDIA V100 SXM2",
        {FP32: 15.7, TF32: None, FP16: 125.0, BF16: None, FP8: None}, 0.9,
        "NVIDIA Tesla V100 datasheet (tesla-v100-datasheet-letter-fnl-web.pdf), "
        "https://images.nvidia.com/content/technologies/volta/pdf/"
        "tesla-volta-v100-datasheet-letter-fnl-web.pdf"),
    Gpu("T4", "NVIDIA T4",
        {FP32: 8.1, TF32: None, FP16: 65.0, BF16: None, FP8: None}, 0.32,
        "NVIDIA T4 datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/"
        "Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf"),
    Gpu("A100", "NVIDIA A100 80GB SXM",
        {FP32: 19.5, TF32: 156.0, FP16: 312.0, BF16: 312.0, FP8: None}, 2.039,
        "NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), "
        "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
        "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"),
    Gpu("L4", "NVIDIA L4",
        {FP32: 30.3, TF32: 60.0, FP16: 121.0, BF16: 121.0, FP8: 242.5}, 0.3,
        "NVIDIA L4 datasheet, https://resources.nvidia.com/en-us-data-center-overview/"
        "l4-gpu-datasheet"),
    Gpu("H100", "NVIDIA H100 SXM",
        {FP32: 67.0, TF32: 494.7, FP16: 989.4, BF16: 989.4, FP8: 1978.9}, 3.35,
        "NVIDIA H100 Tensor Core GPU datasheet, https://resources.nvidia.com/"
        "en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"),
    Gpu("H200", "NVIDIA H200 SXM",
        {FP32: 67.0, TF32: 494.7, FP16: 989.4, BF16: 989.4, FP8: 1978.9}, 4.8,
        "NVIDIA H200 Tensor Core GPU datasheet, https://resources.nvidia.com/"
        "en-us-data-center-overview-mc/en-us-data-center-overview/hpc-datasheet-sc23-h200"),
    Gpu("B200", "NVIDIA B200 (HGX B200, per GPU)",
        {FP32: 75.0, TF32: 1100.0, FP16: 2250.0, BF16: 2250.0, FP8: 4500.0}, 8.0,
        "NVIDIA HGX B200 / DGX B200 datasheet (8 GPUs: divided by 8, sparse figures "
        "halved), https://resources.nvidia.com/en-us-dgx-systems/dgx-b200-datasheet"),
)}


class UnknownGpuError(ValueError):
    """A GPU name the table does not hold (the message lists the known ones)."""


def known() -> list[str]:
    """The names `gpu()` accepts."""
    return [gpu.name for gpu in GPUS.values()]


def gpu(name: str) -> Gpu:
    """The table's GPU of `name` (case-insensitive; "H100 SXM", "nvidia a100"
    and NVML names such as "NVIDIA H100 80GB HBM3" are found too).

    Raises:
        UnknownGpuError: no such GPU in the table; the message lists them.
    """
    key = str(name).strip().lower()
    if key in GPUS:
        return GPUS[key]
    words = key.replace("-", " ").split()
    for short, found in GPUS.items():
        if short in words:
            return found
    raise UnknownGpuError(
        f"unknown GPU {name!r}: the advisor's table knows {', '.join(known())} "
        "(pass one of them with --gpu)")
