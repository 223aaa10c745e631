"""The layer of an XProf op name in JAX's naming (framework-free: the kernel
statistics are read without JAX; `mpprof.backends.xprof_kernels`).

XLA names an op by the jit's name stack, Keras' layer scopes inside it:
"jit(step)/transpose(jvp(mha))/query/abc,cde->abde/dot_general" is an op of
layer "mha/query", "jit(step)/jvp(dense)/jit(relu)/max" one of "dense".
"""

from __future__ import annotations

import re

# Name-stack frames that are no layer: a transformation wrapping a scope
# ("transpose(jvp(dense))": the backward pass of "dense"), a jitted function
# ("jit(step)", "jit(relu)"), control flow ("while/body", "cond/branch_1_fun"),
# call frames, an einsum's equation ("query/abc,cde->abde/dot_general",
# "vmap(BTNH,BSNH->BNTS)") and an empty scope ("jvp()").
_WRAPPED = re.compile(r"^[A-Za-z_]\w*\((.*)\)$")
_JITTED = re.compile(r"^p?jit\(.*\)$")
_NOT_LAYERS = {"while", "cond", "closed_call", "core_call", "checkpoint", "remat",
               "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"}
# Frames that only follow a control-flow frame ("while/body", "cond/branch_0_fun").
_INSIDE = {"while": re.compile(r"^(body|cond)$"), "cond": re.compile(r"^branch_\d+_fun$")}


def layer_of(op_name: str) -> str | None:
    """The layer of `op_name` (its layer scopes, the name stack's other frames
    left out), or None when the name is not a JAX name stack (no scope has a
    transformation's "(", or the op is a PyTorch operator, "aten::mm", in a
    layer whose name holds a "(")."""
    *scopes, op = op_name.split("/")
    if "::" in op or not any("(" in scope for scope in scopes):
        return None
    layers: list[str] = []
    previous = ""
    for scope in scopes:
        while (match := _WRAPPED.match(scope)) and not _JITTED.match(scope):
            scope = match.group(1)  # jvp(dense) -> dense
        if _is_layer(scope, previous):
            layers.append(scope)
        previous = scope
    return "/".join(layers) or op_name


def _is_layer(scope: str, previous: str) -> bool:
    """Whether a name-stack frame (unwrapped) is a layer's scope."""
    inside = _INSIDE.get(previous)
    return not (not scope or _JITTED.match(scope) or scope in _NOT_LAYERS
                or "->" in scope or (inside is not None and inside.match(scope)))
