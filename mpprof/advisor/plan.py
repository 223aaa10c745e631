"""The plan: which layers must be float32, which can go lower, and the code.

Judged from the layer facts alone (`facts.layer_facts`), with the same
thresholds as the diagnosis' numerics rules (`HEADROOM_FACTOR`,
`UNDERFLOW_SHARE`): a layer the data show overflowing or without headroom is
never lowered; a float32 island the data show needless goes to the run's
half dtype; a Dense/EinsumDense layer with float8 headroom on its input and
gradient becomes a float8 candidate.
"""

from __future__ import annotations

import dataclasses
import re

from mpprof.advisor.facts import LayerFacts
from mpprof.diagnosis.numerics import HEADROOM_FACTOR, UNDERFLOW_SHARE
from mpprof.dtypes import (
    FLOAT8_GEMM_MULTIPLE,
    HALF_DTYPES,
    TENSOR_CORE_MULTIPLE,
    gemm_multiple,
)

# Largest share of a tensor's non-zero values float8 may flush to zero at
# amax scaling: the same 1% Keras' float8 training leaves to delayed scaling.
FLOAT8_MAX_LOSS = 0.01
# Largest jump of a layer's abs max over its history that delayed scaling
# (scale from the amax history) absorbs without saturating e4m3.
FLOAT8_MAX_AMAX_GROWTH = 2.0

# Layers whose products inside (attention scores: query x key) are larger
# than anything at their output: the numerics sample outputs, so their
# headroom cannot be read there. A float32 island of these is never lowered.
INSIDE_PRODUCTS = ("Attention", "AdditiveAttention", "MultiHeadAttention",
                   "GroupedQueryAttention", "GroupQueryAttention")

# How an attention layer's sizing reason starts (the text and the report
# list them apart: a kept layer's reasons are not shown otherwise).
ATTENTION_EVIDENCE = "attention GEMMs per step"

KEEP = "keep"
FLOAT32 = "float32"
LOWER = "lower"
FLOAT8 = "float8"


@dataclasses.dataclass
class Row:
    """One layer's line of the plan.

    Attributes:
        layer, path, cls: the layer.
        now: its compute dtype now (float8 layers: "float8").
        planned: the dtype the plan gives it ("float32", "float16",
            "bfloat16", "float8").
        action: KEEP (no change), FLOAT32 (must be float32), LOWER (a float32
            island that can go to half precision) or FLOAT8.
        reasons: why, in words, each with its evidence.
        verified: None until a replay verified (True) or refuted (False) it.
    """

    layer: str
    path: str | None
    cls: str
    now: str
    planned: str
    action: str
    reasons: list[str]
    verified: bool | None = None

    @property
    def changed(self) -> bool:
        return self.action != KEEP

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Plan:
    """The plan for one run.

    Attributes:
        model_policy: the model's policy now.
        default_policy: the plan's default policy (the DTypePolicyMap's).
        half_dtype: the half-precision dtype the plan computes in.
        rows: one per layer, in call order.
        flavor: "keras" or "tf_keras" (how the code is spelled).
    """

    model_policy: str
    default_policy: str
    half_dtype: str
    rows: list[Row]
    flavor: str = "keras"

    def layers(self, action: str) -> list[str]:
        return [r.layer for r in self.rows if r.action == action]

    @property
    def must_float32(self) -> list[str]:
        """Layers that must compute in float32: those made float32 and the
        float32 ones the data show need it."""
        return [r.layer for r in self.rows if r.planned == FLOAT32
                and (r.action == FLOAT32 or r.now == FLOAT32)]

    @property
    def nothing_to_change(self) -> bool:
        return not any(r.changed for r in self.rows)

    def policy_map(self) -> dict[str, str]:
        """Layer path -> policy for every layer whose policy differs from
        the default (float8 layers keep their half policy: quantize sets it)."""
        entries = {}
        for row in self.rows:
            policy = _policy(row.planned if row.planned != FLOAT8 else self.half_dtype)
            if policy != self.default_policy:
                entries[row.path or row.layer] = policy
        return entries

    def float8_filters(self) -> list[str]:
        """`model.quantize("float8", filters=...)` patterns: each float8
        layer's own name (Keras matches `layer.name` with re.search)."""
        return [f"^{re.escape(r.layer.rpartition('/')[2])}$" for r in self.rows
                if r.action == FLOAT8]

    def code(self) -> str:
        """The plan as code to paste: a DTypePolicyMap and, for float8, the
        `model.quantize` call."""
        module = "tf_keras" if self.flavor == "tf_keras" else "keras"
        if self.nothing_to_change:
            return "# nothing to change: the data support the current policies"
        filters = self.float8_filters()
        changed = [r for r in self.rows if r.changed and r.action != FLOAT8]
        lines = []
        if filters:
            # A layer whose policy is a DTypePolicyMap cannot be quantized
            # (Keras 3.15 builds "float8_from_map_..." and fails): the plain
            # policy, and each changed layer's own dtype.
            lines.append(f'{module}.mixed_precision.set_dtype_policy("{self.default_policy}")')
            if changed:
                lines.append("# each changed layer's dtype, in the model's code:")
        else:
            lines.append(f"policy = {module}.dtype_policies.DTypePolicyMap("
                         f'default_policy="{self.default_policy}")')
            lines += [f'policy["{key}"] = "{policy}"' for key, policy in self.policy_map().items()]
            lines.append(f"{module}.mixed_precision.set_dtype_policy(policy)  # then build the "
                         "model: each layer looks up its path")
            lines.append("# a layer given its own dtype= in the model's code keeps it: change "
                         "those:")
        for row in changed:
            lines.append(f'{"" if filters else "#   "}{module}.layers.{row.cls}(..., name="'
                         f'{row.layer.rpartition("/")[2]}", dtype="{_policy(row.planned)}")')
        filters = self.float8_filters()
        if filters:
            lines.append("# after the model is built, before compile:")
            lines.append(f'model.quantize("float8", filters={filters!r})')
        if self.half_dtype == "float16":
            lines.append("# float16 needs loss scaling: compile with the default "
                         "auto_scale_loss=True under a mixed_float16 model policy")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "model_policy": self.model_policy,
            "default_policy": self.default_policy,
            "half_dtype": self.half_dtype,
            "must_float32": self.must_float32,
            "lower": self.layers(LOWER),
            "float8": self.layers(FLOAT8),
            "nothing_to_change": self.nothing_to_change,
            "policy_map": self.policy_map(),
            "float8_filters": self.float8_filters(),
            "code": self.code(),
            "rows": [r.to_dict() for r in self.rows],
        }


def _policy(dtype: str) -> str:
    return FLOAT32 if dtype == FLOAT32 else f"mixed_{dtype}"


def half_dtype_of(model_policy: str | None, facts: list[LayerFacts],
                  bfloat16_available: bool | None) -> str:
    """The half dtype the plan uses: the run's own (its policy, or its
    layers'); for a float32 run, bfloat16 unless the GPU lacks it."""
    policy = model_policy or ""
    for dtype in HALF_DTYPES:
        if policy.endswith(dtype):
            return dtype
    for fact in facts:
        if fact.compute_dtype in HALF_DTYPES:
            return fact.compute_dtype
    return "float16" if bfloat16_available is False else "bfloat16"


def make_plan(facts: list[LayerFacts], model_policy: str | None, half: str,
              flavor: str | None = None) -> Plan:
    """The plan for these layers, lowering to `half`."""
    rows = [_row(fact, half) for fact in facts]
    _inside_kept_attention(rows)
    for row, fact in zip(rows, facts, strict=True):
        if fact.cls in INSIDE_PRODUCTS and fact.gemms:
            row.reasons.append(_attention_evidence(fact))
    _float8(rows, facts)
    default = _policy(half)
    return Plan(model_policy=model_policy or "float32", default_policy=default,
                half_dtype=half, rows=rows, flavor=flavor or "keras")


def _row(fact: LayerFacts, half: str) -> Row:
    now = FLOAT8 if fact.quantization_mode == "float8" else fact.compute_dtype

    def row(planned: str, action: str, *reasons: str) -> Row:
        return Row(fact.name, fact.path, fact.cls, now, planned, action, list(reasons))

    if fact.quantization_mode is not None:
        return row(now, KEEP, f"already quantized ({fact.quantization_mode})")
    if fact.first_overflow:
        why = (f"overflowed {fact.compute_dtype}: the first layer in call order with a "
               f"non-finite or beyond-max output, on {fact.overflow_samples} of "
               f"{fact.samples} samples (first at step {fact.first_overflow_step}); "
               f"abs max {_num(fact.forward_abs_max)} on the others")
        if now == FLOAT32:
            return row(FLOAT32, KEEP, why)
        return row(FLOAT32, FLOAT32, why)
    if fact.is_output and now == FLOAT32:
        return row(FLOAT32, KEEP, "the model's output: the loss sees it, it stays float32")
    if fact.overflowed:
        return row(now, KEEP, "its output was non-finite after an earlier layer overflowed: "
                   "never lowered")
    if fact.is_output and now in HALF_DTYPES:
        return row(FLOAT32, FLOAT32, f"the model's output: the loss sees {now} (MP006)")
    headroom = fact.float16_headroom
    if now == FLOAT32 and fact.cls in INSIDE_PRODUCTS:
        return row(FLOAT32, KEEP, (
            f"stays float32: a {fact.cls} computes its attention scores inside, larger than "
            "its output and never sampled, so its output's headroom "
            f"({_num(headroom)}x) says nothing of them"))
    if not fact.sampled and fact.cls in INSIDE_PRODUCTS:
        return row(now, KEEP, f"keeps {now}: its attention scores are computed inside it, "
                   "never sampled; its projections are judged on their own rows")
    if not fact.sampled:
        return row(now, KEEP, "no numerics sample holds it: no evidence to change it on")
    low_headroom = half == "float16" and headroom is not None and headroom < HEADROOM_FACTOR
    underflow = max(fact.forward_underflow or 0.0, fact.backward_underflow or 0.0)
    if now in HALF_DTYPES:
        if now == "float16" and headroom is not None and headroom < HEADROOM_FACTOR:
            return row(FLOAT32, FLOAT32, (
                f"little headroom in float16: abs max {_num(fact.forward_abs_max)} is "
                f"within {HEADROOM_FACTOR:g}x of 65504 ({headroom:.1f}x left)"))
        return row(now, KEEP, f"fits {now} (abs max {_num(fact.forward_abs_max)})")
    # A float32 layer: an island, or a float32 run.
    if low_headroom:
        return row(FLOAT32, KEEP, (
            f"needs float32: abs max {_num(fact.forward_abs_max)} leaves {headroom:.1f}x "
            f"of float16's max (less than {HEADROOM_FACTOR:g}x)"))
    if half == "float16" and underflow >= UNDERFLOW_SHARE:
        return row(FLOAT32, KEEP, (
            f"needs float32: {underflow:.0%} of its values are below float16's smallest "
            "normal"))
    room = (f"headroom {headroom:.0f}x of float16's max" if headroom is not None
            else "no overflow")
    return row(half, LOWER, (
        f"float32 not needed: abs max {_num(fact.forward_abs_max)} ({room}), "
        f"{underflow:.1%} below float16's smallest normal, over {fact.samples} samples"))


def _inside_kept_attention(rows: list[Row]) -> None:
    """An attention layer kept float32 keeps its sublayers float32: its
    query and key projections' outputs are the scores' operands, and the
    scores' product runs in the dtype they arrive in."""
    kept = [r.layer for r in rows if r.cls in INSIDE_PRODUCTS and r.planned == FLOAT32]
    for row in rows:
        parent = next((k for k in kept if row.layer.startswith(k + "/")), None)
        if parent is None or row.action != LOWER:
            continue
        row.planned, row.action = FLOAT32, KEEP
        row.reasons = [f"stays float32 inside {parent}, which stays float32: its outputs are "
                       "the attention scores' operands"]


def attention_rows(plan: dict) -> list[tuple[dict, str]]:
    """(row, its sizing reason) of each attention layer of a plan dict."""
    return [(row, reason) for row in plan["rows"] for reason in row["reasons"]
            if reason.startswith(ATTENTION_EVIDENCE)]


def _attention_evidence(fact: LayerFacts) -> str:
    """An attention layer's sizing and Tensor Core alignment, in words."""
    flops = sum(g.step_flops for g in fact.gemms)
    shapes = "; ".join(g.describe() for g in fact.gemms)
    sizes = sorted({int(size) for g in fact.gemms for size in (g.k, g.n)})
    multiple = gemm_multiple(fact.compute_dtype, fact.quantization_mode) or TENSOR_CORE_MULTIPLE
    aligned = (f"its contracted and produced sizes {sizes} are multiples of {multiple}: "
               "Tensor Core friendly" if fact.aligned else
               f"its contracted and produced sizes {sizes} are not all multiples of "
               f"{multiple}: pad the head size or the key length for Tensor Cores")
    return (f"{ATTENTION_EVIDENCE} (forward and backward, {flops:.4g} FLOP): {shapes}; "
            f"{aligned}")


def _float8(rows: list[Row], facts: list[LayerFacts]) -> None:
    """Marks float8 candidates among the rows planned in half precision."""
    for row, fact in zip(rows, facts, strict=True):
        if row.planned not in HALF_DTYPES or not fact.float8_eligible or fact.is_output:
            continue
        if row.action not in (KEEP, LOWER):
            continue
        dims = fact.gemm_dims or []
        if not dims or any(int(d) % FLOAT8_GEMM_MULTIPLE for d in dims):
            continue
        inputs, grads = fact.float8_input_loss, fact.float8_gradient_loss
        if inputs is None or grads is None:
            continue
        if inputs > FLOAT8_MAX_LOSS or grads > FLOAT8_MAX_LOSS:
            continue
        if fact.amax_growth is not None and fact.amax_growth > FLOAT8_MAX_AMAX_GROWTH:
            continue
        row.planned, row.action = FLOAT8, FLOAT8
        row.reasons.append(
            f"float8 candidate: {inputs:.2%} of its input (e4m3) and {grads:.2%} of its "
            f"gradient (e5m2) would flush to zero at amax scaling; abs max grew at most "
            f"{_num(fact.amax_growth or 1.0)}x between samples; GEMM dims {dims} are "
            f"multiples of {FLOAT8_GEMM_MULTIPLE}")


def _num(value) -> str:
    return "n/a" if value is None else f"{value:.4g}"
