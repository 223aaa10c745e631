"""A fit that raised (MP020): what failed, at which step, and, for the dtype
errors a mixed policy brings out, what to change."""

from __future__ import annotations

import re

from mpprof.diagnosis.core import NotApplicable, NotMeasured, finding, rule
from mpprof.diagnosis.view import RunView
from mpprof.records import run_context

# A TensorFlow op that has no float16 kernel (its message names the op and
# the allowed types), e.g. InTopKV2 in a top-k accuracy metric.
_NO_HALF_KERNEL = re.compile(
    r"(?:has type (?:float16|half|bfloat16) that does not match expected type of float32|"
    r"'T' of half is not in the list of allowed values|"
    r"No (?:OpKernel|registered kernel)[^\n]*half|"
    r"Could not find device for node: \{\{node (\w+)\}\}[^\n]*half)",
    re.IGNORECASE)
_OP_NAME = re.compile(r"(?:\{\{node (\w+)\}\}|Op<name=(\w+)|\[Op:(\w+)\]|of '(\w+)' Op)")
# Two operands of one op in different float dtypes (TensorFlow does not promote).
_MIXED_FLOATS = re.compile(
    r"(?:expected to be a (?:half|float|bfloat16) tensor but is a (?:half|float|bfloat16)"
    r" tensor|has type (?:float32|float16|bfloat16) that does not match type "
    r"(?:float32|float16|bfloat16)|(?:float32|float16|bfloat16) (?:and|!=|vs\.?) "
    r"(?:float32|float16|bfloat16))", re.IGNORECASE)
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
    message = str(error.get("message") or "")
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
        head = view.last_half_layer()
        where = f" ({head})" if head else ""
        fix = (
            f"The op {op or 'named in the message'} has no {mixed} kernel and the mixed "
            f"policy gave it {mixed} values"
            + (": a top-k accuracy metric runs it on the model's output. "
               if metric else ". ")
            + f"Give the layer that feeds it float32, here the output layer{where}:\n"
            f"    {syntax.layer(view.layer_class(head))}\n"
            "(a metric's own dtype does not cast y_pred), or cast in a custom metric:\n"
            "    def top5(y_true, y_pred):\n"
            f"        return {syntax.module}.metrics.sparse_top_k_categorical_accuracy(\n"
            f"            y_true, {syntax.module}.ops.cast(y_pred, \"float32\"), k=5)"
        )
        if syntax.module == "tf_keras":
            fix = fix.replace("tf_keras.ops.cast", "tf.cast")
        return "no_half_kernel", fix
    if _MIXED_FLOATS.search(message):
        cast = ("tf.cast(x, self.compute_dtype)" if syntax.module == "tf_keras"
                else "keras.ops.cast(x, self.compute_dtype)")
        fix = (
            f"An op got float32 and {mixed} operands: under the mixed policy a layer's "
            f"inputs are {mixed}, but a constant, a random draw or a float32 variable made "
            "in its call stays float32 (TensorFlow does not promote). Cast it to the "
            "layer's compute dtype in the call:\n"
            f"    x = {cast}\n"
            "or create it in that dtype (e.g. keras.random.normal(shape, "
            "dtype=self.compute_dtype))."
        )
        return "mixed_floats", fix
    return "other", ""
