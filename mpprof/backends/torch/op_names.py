"""PyTorch's XProf op names: the layer of an op, and whether it could run
on Tensor Cores (framework-free: the kernel statistics are read without
PyTorch; `mpprof.backends.xprof_kernels`).

PyTorch's profile window names each kernel's op after the layer that ran it,
as TensorFlow names an op after its scopes (`mpprof.backends.torch.kernels`):
"sequential/dense/aten::mm" is op "aten::mm" of layer "sequential/dense".
An op is an operator's qualified name, "<namespace>::<operator>" ("aten::mm",
"aten::convolution_backward", "torchvision::roi_align").

XProf judges an op Tensor-Core eligible by its TensorFlow or XLA op type
(MatMul, Conv2D, dot_general, ...) and knows no aten op, so PyTorch's table
is here (`TENSOR_CORE_OPS`): the GEMMs and convolutions cuBLAS and cuDNN
can run on Tensor Cores, by op name alone as XProf judges TensorFlow's (a
float32 matmul counts too).
"""

from __future__ import annotations

import re

_OPERATOR = re.compile(r"^[A-Za-z_]\w*::[A-Za-z_]\w*(\.\w+)?$")

# The aten ops that launch a GEMM or convolution kernel (a kernel belongs to
# the innermost op that launched it: aten::mm under aten::matmul, under
# aten::linear; aten::bmm under aten::einsum, as Keras' EinsumDense and
# attention run; aten::cudnn_convolution under aten::_convolution) and
# their outer ops, where a kernel may be tied to those; the backward ops
# launch the same GEMMs (MmBackward0 runs aten::mm) or their own
# (aten::convolution_backward). Fused attention (aten::_scaled_dot_product_
# flash_attention and kin) is left out: XProf's kernel-name heuristic knows
# none of its kernels (flash_fwd_kernel, ...), so each would be listed as
# eligible work that missed the Tensor Cores it ran on.
TENSOR_CORE_OPS = frozenset({
    # GEMMs (cuBLAS, cuBLASLt).
    "mm", "addmm", "_addmm_activation", "bmm", "baddbmm", "addbmm", "matmul", "linear",
    "einsum", "tensordot", "_scaled_mm", "_scaled_grouped_mm", "_grouped_mm", "_int_mm",
    # Convolutions (cuDNN), forward and backward.
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "convolution", "_convolution", "cudnn_convolution",
    "cudnn_convolution_transpose", "cudnn_convolution_relu", "cudnn_convolution_add_relu",
    "convolution_backward",
})


def layer_of(op_name: str) -> str | None:
    """The layer of `op_name` ("sequential/dense/aten::mm" ->
    "sequential/dense"), or None when the name is not PyTorch's (its op is
    no "<namespace>::<operator>")."""
    layer, _, op = op_name.rpartition("/")
    if not layer or not _OPERATOR.match(op):
        return None
    return layer


def tensor_core_eligible(op_name: str) -> bool:
    """Whether the op of `op_name` ("sequential/dense/aten::mm", or
    "aten::mm" in no layer; an overload, "aten::mm.out", is its operator's)
    is an aten op of `TENSOR_CORE_OPS`."""
    op = op_name.rpartition("/")[2]
    namespace, _, operator = op.partition("::")
    return namespace == "aten" and operator.partition(".")[0] in TENSOR_CORE_OPS
