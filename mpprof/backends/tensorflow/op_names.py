"""The layer of an XProf op name in TensorFlow's naming (framework-free: the
kernel statistics are read without TensorFlow; `mpprof.backends.xprof_kernels`).

TensorFlow names an op by its name scopes, Keras' layer scopes among them:
"seq/dense/MatMul" is op "MatMul" of layer "seq/dense".
"""

from __future__ import annotations


def layer_of(op_name: str) -> str | None:
    """The layer of `op_name` ("seq/dense/MatMul" -> "seq/dense"), or None
    when the name is not TensorFlow's (a scope with "(" is a JAX name stack's
    transformation; a ":" is in no TensorFlow op name, whose ":type" XProf
    strips, and in every PyTorch operator's, "aten::mm")."""
    scopes = op_name.split("/")[:-1]
    if ":" in op_name or any("(" in scope for scope in scopes):
        return None
    return "/".join(scopes)
