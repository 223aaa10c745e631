"""A fit that raised (MP020): what failed, at which step, and, for the dtype
errors a mixed policy brings out, what to change."""

from __future__ import annotations

import re

from mpprof.diagnosis.core import NotApplicable, NotMeasured, finding, rule
from mpprof.diagnosis.view import RunView
from mpprof.records import run_context

# An op that has no float16 (bfloat16) kernel, e.g. InTopKV2 in a top-k
# accuracy metric on TensorFlow. Each framework words it its own way (each
# alternative is a message seen in a real fit, tests/ and tests/torch/ and
# tests/jax/): TensorFlow names the op and the allowed types; PyTorch's CPU
# kernels say `"linalg_svd_cpu" not implemented for 'Half'`, "linalg.inv: Low
# precision dtypes not supported. Got Half" or "Unsupported dtype Half"; JAX's
# CPU solvers "Unsupported dtype float16".
_NO_HALF_KERNEL = re.compile(
    r"(?:has type (?:float16|half|bfloat16) that does not match expected type of float32|"
    r"'T' of half is not in the list of allowed values|"
    r"No (?:OpKernel|registered kernel)[^\n]*half|"
    r"Could not find device for node: \{\{node (\w+)\}\}[^\n]*half|"
    r"not implemented for '(?:Half|BFloat16)'|"
    r"Low precision dtypes not supported|"
    r"Unsupported dtype (?:Half|BFloat16|float16|bfloat16)|"
    r"doesn't support tensors of type: (?:Half|BFloat16))",
    re.IGNORECASE)
_OP_NAME = re.compile(
    r"(?:\{\{node (\w+)\}\}|Op<name=(\w+)|\[Op:(\w+)\]|of '(\w+)' Op|"
    # PyTorch: `"cdist" not implemented for 'Half'`, "linalg.inv: Low precision ...";
    # JAX: "lax.add requires arguments to have the same dtypes".
    r"\"(\w+)\" not implemented for|([\w.]+): Low precision|(lax\.\w+) requires)")
# Two operands of one op in different float dtypes. TensorFlow: "Input 'y' of
# 'AddV2' Op has type float32 that does not match type float16 of argument
# 'x'"; PyTorch (its matmuls and convolutions do not promote): "expected m1
# and m2 to have the same dtype, but got: c10::Half != float", "mat1 and mat2
# must have the same dtype", "self and mat2 must have the same dtype, but got
# Float and Half", "expected scalar type Half but found Float", "Input type
# (c10::Half) and bias type (float) should be the same", "RNN input dtype
# (torch.float16) does not match weight dtype (torch.float32)"; JAX (jax.lax
# does not promote): "lax.add requires arguments to have the same dtypes, got
# float16, float32".
# One float dtype as each framework spells it (float16: c10::Half, Half, torch.float16).
_FLOAT = r"(?:c10::|torch\.)?(?:float16|float32|bfloat16|half|float)"
_MIXED_FLOATS = re.compile(
    r"(?:expected to be a (?:half|float|bfloat16) tensor but is a (?:half|float|bfloat16)"
    r" tensor|has type (?:float32|float16|bfloat16) that does not match type "
    r"(?:float32|float16|bfloat16)|(?:float32|float16|bfloat16) (?:and|!=|vs\.?) "
    r"(?:float32|float16|bfloat16)|"
    rf"have (?:the )?same (?:scalar type|dtype)[^\n]*?\b{_FLOAT}\b[^\n]*?\b{_FLOAT}\b|"
    rf"\({_FLOAT}\) and \w+ \({_FLOAT}\) must have the same|"
    r"mat1 and mat2 must have the same dtype\.?$|"
    rf"expected scalar type {_FLOAT} but found {_FLOAT}\b|"
    rf"\({_FLOAT}\) and (?:bias|weight) type \({_FLOAT}\) should be the same|"
    rf"dtype \({_FLOAT}\) does not match weight dtype \({_FLOAT}\)|"
    rf"requires arguments to have the same dtypes, got {_FLOAT}, {_FLOAT}\b)",
    re.IGNORECASE | re.MULTILINE)
FLOAT32 = '"float32"'
# Ops of metrics that top-k/in-top-k accuracy use.
_METRIC_OPS = ("InTopK", "in_top_k", "TopKV2", "top_k")


@rule("MP020", "critical", "model.fit raised", view="overview", data="context (fit_error)")
def fit_raised(view: RunView) -> list:
    """`model.fit` raised inside a train step: names the exception, its
    message and the step. Under a mixed policy, a float16 op without a
    float16 kernel (a top-k metric's InTopK on a float16 output) or an op
    given float32 and float16 operands (a constant or random draw in float32
    beside float16 activations) gets the change that fixes it."""
    if view.context.fit_state != run_context.FIT_FAILED:
        raise NotApplicable(f"the fit did not fail (fit_state {view.context.fit_state})")
    error = view.context.fit_error
    if error is None:
        raise NotMeasured(
            "the fit failed, but what it raised was not recorded (it stopped outside a "
            "train step, or the run was written by an older mpprof)")
    message = run_context.without_ansi(error.get("message"))
    first_line = run_context.error_headline(message)
    step = error.get("step")
    evidence = {"type": error.get("type"), "message": first_line[:500], "step": step}
    mixed = view.half_dtype or (
        "float16" if (view.policy or "").endswith("float16") else
        "bfloat16" if (view.policy or "").endswith("bfloat16") else None)
    op = _op_name(message)
    if op:
        evidence["op"] = op
    kind, fix = _dtype_fix(view, message, op, mixed)
    evidence["kind"] = kind
    what = f"{error.get('type')}: {first_line[:200]}".rstrip(".")
    title = f"model.fit raised at step {step}: {what}"
    if kind == "other":
        fix = (
            f"The fit stopped at step {step} with {what}. The whole message is in the run "
            "context's fit_error and in the traceback fit raised; mpprof's records stop "
            "at that step."
        )
    return [finding("MP020", title, step=step, evidence=evidence, fix=fix)]


def _op_name(message: str) -> str | None:
    for match in _OP_NAME.finditer(message):
        name = next(g for g in match.groups() if g)
        if name not in ("Identity", "IteratorGetNext"):
            return name
    return None


def _dtype_fix(view: RunView, message: str, op: str | None,
               mixed: str | None) -> tuple[str, str]:
    """("no_half_kernel" | "mixed_floats" | "other", the fix)."""
    if mixed is None:
        return "other", ""
    syntax = view.syntax
    metric = any(name in message for name in _METRIC_OPS)
    if _NO_HALF_KERNEL.search(message) or (metric and "half" in message):
        if not metric:
            which = f"the op {op}" if op else "an op of the step (the message says which)"
            fix = (
                f"{syntax.framework} has no {mixed} kernel for {which} here, and the "
                f"mixed policy gave it {mixed} values. Run that op in float32: cast its "
                "input in the layer's call,\n"
                f"    x = {syntax.cast('x', FLOAT32)}\n"
                f"and its result back with {syntax.cast('y', 'self.compute_dtype')}; or "
                "build that layer with dtype=\"float32\"."
            )
            return "no_half_kernel", fix
        head = view.last_half_layer()
        where = f" ({head})" if head else ""
        fix = (
            f"The op {op or 'named in the message'} has no {mixed} kernel and the mixed "
            f"policy gave it {mixed} values: a top-k accuracy metric runs it on the model's "
            "output. "
            f"Give the layer that feeds it float32, here the output layer{where}:\n"
            f"    {syntax.layer(view.layer_class(head))}\n"
            "(a metric's own dtype does not cast y_pred), or cast in a custom metric:\n"
            "    def top5(y_true, y_pred):\n"
            f"        return {syntax.module}.metrics.sparse_top_k_categorical_accuracy(\n"
            f"            y_true, {syntax.cast('y_pred', FLOAT32)}, k=5)"
        )
        return "no_half_kernel", fix
    if _MIXED_FLOATS.search(message):
        fix = (
            f"An op got float32 and {mixed} operands: under the mixed policy a layer's "
            f"inputs are {mixed}, but a constant or a random draw made in its call stays "
            f"float32 ({syntax.float_promotion}). Cast it to the layer's compute dtype in "
            "the call:\n"
            f"    x = {syntax.cast('x', 'self.compute_dtype')}\n"
            "or create it in that dtype (e.g. keras.random.normal(shape, "
            "dtype=self.compute_dtype))."
        )
        return "mixed_floats", fix
    return "other", ""
