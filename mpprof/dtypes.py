"""The floating-point dtypes of mixed precision and what hardware does with them.

Defined once here: each dtype's range (float8 formats included), which dtypes
are half precision, the GEMM dimension multiples Tensor Cores want (float8
included) and the compute capabilities that bring fast float16 and bfloat16.
The collectors, the diagnosis and the front ends import them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mpprof.records import schema

# The 16-bit floating-point dtypes Keras' mixed precision policies compute in.
HALF_DTYPES = ("float16", "bfloat16")

# Tensor Cores run float16/bfloat16 GEMMs at full speed only when the matrix
# dimensions are multiples of 8 (NVIDIA's "Matrix Multiplication Background
# User's Guide"; cuBLAS pads or falls back otherwise).
TENSOR_CORE_MULTIPLE = 8

# A float8 layer's matmul (Keras quantize-dequantizes its operands) runs as a
# float8 GEMM where XLA compiles it for a GPU with FP8 Tensor Cores: XLA's
# GEMM rewriter recognizes the pattern and calls cuBLASLt's FP8 GEMM, whose
# non-batch dimensions must be multiples of 16 (XLA pads both operands to
# them otherwise, a copy of each on every call).
FLOAT8_GEMM_MULTIPLE = 16


def gemm_multiple(compute_dtype: str | None, quantization_mode: str | None) -> int | None:
    """The multiple a layer's GEMM dimensions should be for Tensor Cores:
    16 for a float8 layer (whatever dtype it dequantizes to), 8 for one
    computing in float16/bfloat16, None for any other (float32 GEMMs are
    not judged)."""
    if quantization_mode == "float8":
        return FLOAT8_GEMM_MULTIPLE
    if compute_dtype in HALF_DTYPES:
        return TENSOR_CORE_MULTIPLE
    return None

# Tensor Cores first shipped with compute capability 7.0 (Volta); native
# bfloat16 with 8.0 (Ampere).
FP16_TENSOR_CORE_CAPABILITY = (7, 0)
BF16_CAPABILITY = (8, 0)


@dataclasses.dataclass(frozen=True)
class DtypeRange:
    """The range of a floating-point dtype.

    Attributes:
        name: "float16", "bfloat16", "float32" or "float64".
        max: the largest finite value.
        smallest_normal: the smallest positive normal value.
        smallest_subnormal: the smallest positive subnormal value.
    """

    name: str
    max: float
    smallest_normal: float
    smallest_subnormal: float


def _ieee(name: str) -> DtypeRange:
    info = np.finfo(name)
    return DtypeRange(name, float(info.max), float(info.tiny), float(info.smallest_subnormal))


DTYPE_RANGES = (
    DtypeRange(
        "float16",
        schema.FLOAT16_MAX,
        schema.FLOAT16_SMALLEST_NORMAL,
        schema.FLOAT16_SMALLEST_SUBNORMAL,
    ),
    # bfloat16 has float32's exponent range and 7 stored mantissa bits.
    DtypeRange("bfloat16", schema.BFLOAT16_MAX, 2.0**-126, 2.0**-133),
    _ieee("float32"),
    _ieee("float64"),
)

# Largest finite value of each float dtype: the limit a tensor is judged by
# comes from the dtype it was computed in.
DTYPE_MAX = {d.name: d.max for d in DTYPE_RANGES}

# Headroom: a half-precision value within this factor of its dtype's largest
# finite value is too close to it. 16 = four doublings of headroom: weights
# that grow during training can double an activation's range in a few hundred
# steps. MP004 fires on it; a replay's fix must leave at least this much
# (`mpprof.replay.verification`); the advisor keeps such layers in float32.
HEADROOM_FACTOR = 16.0

# The float8 formats Keras' float8 layers quantize to (the names are
# ml_dtypes'): e4m3fn (4 exponent bits, no infinities) for inputs and kernels,
# e5m2 for gradients. Keras clips x / scale to the max, so a larger value
# saturates; a non-zero value at most half the smallest subnormal rounds to
# zero (round to nearest even).
FLOAT8_RANGES = {
    "float8_e4m3fn": DtypeRange("float8_e4m3fn", 448.0, 2.0**-6, 2.0**-9),
    "float8_e5m2": DtypeRange("float8_e5m2", 57344.0, 2.0**-14, 2.0**-16),
}


def has_fp16_tensor_cores(compute_capability) -> bool | None:
    """Whether a GPU of this compute capability has float16 Tensor Cores
    (None when the capability is unknown)."""
    if not compute_capability:
        return None
    return tuple(compute_capability) >= FP16_TENSOR_CORE_CAPABILITY


# GPU architectures by compute capability major (7.5 and 8.9 below).
_ARCHITECTURES_BY_CC = {
    3: "Kepler",
    5: "Maxwell",
    6: "Pascal",
    7: "Volta",
    8: "Ampere",
    9: "Hopper",
    10: "Blackwell",
    12: "Blackwell",
}


def architecture_of(compute_capability) -> str | None:
    """The GPU architecture of a compute capability ([major, minor]), or None."""
    if not compute_capability:
        return None
    if tuple(compute_capability) == (7, 5):
        return "Turing"
    if tuple(compute_capability) == (8, 9):
        return "Ada"
    return _ARCHITECTURES_BY_CC.get(compute_capability[0])


def has_native_bf16(compute_capability) -> bool | None:
    """Whether a GPU of this compute capability computes bfloat16 natively
    (None when the capability is unknown)."""
    if not compute_capability:
        return None
    return tuple(compute_capability) >= BF16_CAPABILITY
