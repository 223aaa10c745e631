"""The layer of an XProf op name in PyTorch's naming (framework-free: the
kernel statistics are read without PyTorch; `mpprof.backends.xprof_kernels`).

PyTorch's profile window names each kernel's op after the layer that ran it,
as TensorFlow names an op after its scopes (`mpprof.backends.torch.kernels`):
"sequential/dense/aten::mm" is op "aten::mm" of layer "sequential/dense".
An op is an operator's qualified name, "<namespace>::<operator>" ("aten::mm",
"aten::convolution_backward", "torchvision::roi_align").
"""

from __future__ import annotations

import re

_OPERATOR = re.compile(r"^[A-Za-z_]\w*::[A-Za-z_]\w*(\.\w+)?$")


def layer_of(op_name: str) -> str | None:
    """The layer of `op_name` ("sequential/dense/aten::mm" ->
    "sequential/dense"), or None when the name is not PyTorch's (its op is
    no "<namespace>::<operator>")."""
    layer, _, op = op_name.rpartition("/")
    if not layer or not _OPERATOR.match(op):
        return None
    return layer
