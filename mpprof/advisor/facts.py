"""What the advisor knows of each layer, read from a recorded run.

Everything comes from the run's records, no framework: the inventory (each
layer's policy, compute dtype, GEMM layout and multiply-adds per element,
its path), the numerics samples (abs max, non-finite, underflow shares and
log2 histograms of each leaf layer's output and of the gradient flowing
into it, with the element counts that size each GEMM) and the run context.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from mpprof import dtypes
from mpprof.records.run import Run

# Keras 3's `model.quantize("float8")` quantizes these classes (Dense and
# EinsumDense implement `_float8_build` / `_float8_call`; every other layer
# is skipped by `Model.quantize`).
FLOAT8_CLASSES = ("Dense", "EinsumDense")

# log2 of the span below the amax a float8 format keeps (down to its smallest
# subnormal), under Keras' delayed scaling (x / scale with scale = amax / max).
FLOAT8_SPAN = {
    name: math.log2(r.max / r.smallest_subnormal) for name, r in dtypes.FLOAT8_RANGES.items()
}
FLOAT8_INPUT_FORMAT = "float8_e4m3fn"
FLOAT8_GRADIENT_FORMAT = "float8_e5m2"


@dataclasses.dataclass
class Gemm:
    """One of a layer's GEMMs in a training step: `batch` products of
    M x K by K x N.

    Attributes:
        m, n, k: rows, columns and contracted size of the forward GEMM
            (the backward pass runs two more of the same FLOPs: the gradients
            of its two operands).
        basis: how it was sized ("output elements", ...).
        batch: how many such products (attention: batch x heads), 1 for a
            layer's GEMM on its kernel.
        weights: whether the K x N operand is a kernel (a float32 variable a
            lower-precision layer casts each step); attention multiplies two
            activations the layer made in its own dtype.
        name: what it computes ("QK^T", "AV"), or None for the layer's only GEMM.
    """

    m: float
    n: float
    k: float
    basis: str
    batch: float = 1.0
    weights: bool = True
    name: str | None = None

    @property
    def forward_flops(self) -> float:
        return 2.0 * self.batch * self.m * self.n * self.k

    @property
    def step_flops(self) -> float:
        """Forward and the two gradients."""
        return 3.0 * self.forward_flops

    def describe(self) -> str:
        shape = f"{self.m:g}x{self.n:g}x{self.k:g} (MxNxK)"
        batched = f"{self.batch:g} x {shape}" if self.batch != 1 else shape
        return f"{self.name}: {batched}" if self.name else batched


@dataclasses.dataclass
class LayerFacts:
    """Per-layer facts (see docs/advisor.md).

    Attributes:
        name: the qualified layer name; `path` its Keras path (policy map key).
        cls: the layer's class.
        compute_dtype: what it computes in now; `policy` its policy name.
        quantization_mode: "float8" etc., or None.
        is_output: whether it produces a model output (what the loss sees).
        gemms: its GEMMs sized from the recorded shapes and the samples'
            element counts (empty: none, or not sized); attention's are its
            QK^T and AV products (its projections are its sublayers' own).
        gemm_dims: the kernel's (in, out) sizes; `aligned` whether the
            GEMMs' dims are multiples of 8 (16 for float8): the kernel's, or
            for attention each product's K and N (head sizes and the key
            length), None without a GEMM.
        float8_eligible: whether Keras can quantize it to float8.
        sampled: whether the numerics samples hold the layer.
        forward_abs_max / backward_abs_max: the largest |value| of its output
            and of the (loss-scaled) gradient into it over the samples.
        overflowed: a sample held a non-finite or beyond-the-dtype output;
            `overflow_samples` how many, `first_overflow_step` the first's step.
        first_overflow: it was the first layer in call order to overflow.
        forward_underflow / backward_underflow: the mean share of values
            below float16's smallest normal (zeros apart).
        float16_headroom: float16's max over `forward_abs_max`.
        float8_input_loss: the share of the layer's input (its producer's
            output) that float8 e4m3 would flush to zero at amax scaling;
            `float8_gradient_loss` the same for the gradient in e5m2.
        amax_growth: the largest jump of the output's abs max over the most
            seen in earlier samples (delayed scaling saturates on a jump).
    """

    name: str
    path: str | None
    cls: str
    compute_dtype: str
    policy: str
    quantization_mode: str | None
    is_output: bool
    gemms: list[Gemm]
    gemm_dims: list[int] | None
    aligned: bool | None
    float8_eligible: bool
    producer: str | None = None
    sampled: bool = False
    samples: int = 0
    forward_abs_max: float | None = None
    backward_abs_max: float | None = None
    overflowed: bool = False
    first_overflow: bool = False
    overflow_samples: int = 0
    first_overflow_step: int | None = None
    forward_underflow: float | None = None
    backward_underflow: float | None = None
    float8_input_loss: float | None = None
    float8_gradient_loss: float | None = None
    amax_growth: float | None = None

    @property
    def float16_headroom(self) -> float | None:
        if self.forward_abs_max is None or not math.isfinite(self.forward_abs_max):
            return None
        return dtypes.DTYPE_MAX["float16"] / max(self.forward_abs_max, 1e-30)

    def to_dict(self) -> dict:
        row = dataclasses.asdict(self)
        row["float16_headroom"] = self.float16_headroom
        row["gemms"] = [{**dataclasses.asdict(g), "step_flops": g.step_flops}
                        for g in self.gemms]
        row["step_flops"] = sum(g.step_flops for g in self.gemms) if self.gemms else None
        return row


def layer_facts(run: Run) -> list[LayerFacts]:
    """The facts of every leaf layer the step called (and of each
    MultiHeadAttention, whose attention GEMMs are its own), in call order."""
    inventory = run.inventory or {}
    records = inventory.get("layers", [])
    by_name = {r["name"]: r for r in records}
    outputs = {o.get("producer") for o in inventory.get("model", {}).get("outputs", [])}
    numerics = run.numerics
    index = {name: i for i, name in enumerate(numerics.layers)} if numerics else {}
    counts = _counts(numerics)
    first = _first_overflows(numerics)
    facts = []
    for record in records:
        # Leaves the step called; containers only for GEMMs of their own
        # (attention, a recurrent layer's cell loop).
        if record.get("is_leaf") and record.get("call_index") is None:
            continue
        if not record.get("is_leaf") and not record.get("gemm_macs"):
            continue
        parent = by_name.get(record.get("parent"))
        if parent and (parent.get("gemm_macs") or {}).get("per") == "timestep_output":
            continue  # a recurrent cell: its layer holds its GEMMs and numerics
        mode = record.get("quantization_mode")
        multiple = dtypes.gemm_multiple(record.get("compute_dtype"), mode) or (
            dtypes.TENSOR_CORE_MULTIPLE)
        dims = record.get("gemm_dims")
        gemms = _gemms(record, by_name, records, counts)
        fact = LayerFacts(
            name=record["name"], path=record.get("path"), cls=record.get("class", ""),
            compute_dtype=record.get("compute_dtype") or "float32",
            policy=record.get("policy") or "", quantization_mode=mode,
            is_output=record["name"] in outputs,
            gemms=gemms,
            gemm_dims=dims,
            aligned=_aligned(dims, gemms, multiple),
            float8_eligible=record.get("class") in FLOAT8_CLASSES and mode is None,
            producer=(record.get("inputs_from") or [None])[0],
        )
        i = index.get(fact.name)
        if i is not None:
            _sampled(fact, numerics, i, index, record, first)
        facts.append(fact)
    return facts


def _counts(numerics) -> dict[str, float]:
    """Each sampled layer's output element count (the largest batch seen)."""
    if numerics is None:
        return {}
    count = numerics.forward["count"]
    return {name: float(np.nanmax(count[:, i])) for i, name in enumerate(numerics.layers)
            if len(count) and np.isfinite(count[:, i]).any() and np.nanmax(count[:, i]) > 0}


def _gemms(record: dict, by_name: dict, records: list[dict],
           counts: dict[str, float]) -> list[Gemm]:
    macs = record.get("gemm_macs")
    if not macs:
        return []
    per = macs.get("per")
    dims = record.get("gemm_dims") or []
    if per == "output":
        count = counts.get(record["name"])
        if count is None or len(dims) < 2:
            return []
        n = float(dims[1])
        return [Gemm(m=count / n, n=n, k=float(macs["macs"]),
                     basis="output elements of a sampled step")]
    if per == "attention_scores":
        return _multi_head_attention(record, records, counts)
    if per == "attention_output":
        return _dot_product_attention(record, by_name, counts, macs)
    if per == "timestep_output":
        # Per timestep: (B x (inputs + units)) @ ((inputs + units) x gates*units).
        gates, units, inputs = int(macs["gates"]), float(macs["units"]), float(macs["inputs"])
        count = counts.get(record["name"])
        if macs.get("return_sequences") and count is not None:
            rows = count / units
        else:
            producers = record.get("inputs_from") or []
            produced = counts.get(producers[0]) if producers else None
            if produced is None:
                return []
            rows = produced / inputs
        return [Gemm(m=rows, n=gates * units, k=inputs + units,
                     basis="timesteps of a sampled step")]
    return []


def _attention(batch: float, queries: float, keys: float, key_dim: float, value_dim: float,
               basis: str, scores: bool = True) -> list[Gemm]:
    """The two batched products of dot-product attention: the scores
    (queries x keys, contracting key_dim) and the weighted values (queries x
    value_dim, contracting the keys); no weights, both operands made inside."""
    gemms = [Gemm(m=queries, n=keys, k=key_dim, basis=basis, batch=batch, weights=False,
                  name="QK^T")] if scores else []
    return gemms + [Gemm(m=queries, n=value_dim, k=keys, basis=basis, batch=batch,
                         weights=False, name="AV")]


def _multi_head_attention(record: dict, records: list[dict],
                          counts: dict[str, float]) -> list[Gemm]:
    """MultiHeadAttention's QK^T and AV, sized from its query, key and value
    projections' traced shapes ([..., heads, head size], the attended axes
    before them) and the sampled element count of the query projection's
    output (which gives the batch)."""
    children = {r["name"].rpartition("/")[2]: r for r in records
                if r.get("parent") == record["name"]}
    shapes = [(children.get(part) or {}).get("output_shape") for part in
              ("query", "key", "value")]
    if any(not s or len(s) < 3 or not all(isinstance(d, int) for d in s) for s in shapes):
        return []
    query, key, value = shapes
    count = counts.get(children["query"]["name"])
    if count is None:
        return []
    heads = float(query[-2])
    batch = count / math.prod(query)
    return _attention(batch * heads, float(math.prod(query[:-2])), float(math.prod(key[:-2])),
                      float(query[-1]), float(value[-1]),
                      "traced query/key/value shapes, batch from a sampled step")


def _dot_product_attention(record: dict, by_name: dict, counts: dict[str, float],
                           macs: dict) -> list[Gemm]:
    """`keras.layers.Attention`: [query (B, T, dim), value (B, S, dim_v)],
    sized from the query and value shapes Keras built it with (else its two
    producers' traced shapes: with one, which input it fed is unknown), its
    traced output (T, dim_v) and its sampled output count (the batch). Its
    "concat" score mode adds, not multiplies: only AV is a GEMM then."""
    out = record.get("output_shape") or []
    count = counts.get(record["name"])
    query, value = macs.get("query_shape"), macs.get("value_shape")
    producers = record.get("inputs_from") or []
    if (query is None or value is None) and len(producers) == 2:
        query, value = ((by_name.get(p) or {}).get("output_shape") for p in producers)
    shapes = [out, query or [], value or []]
    if count is None or any(len(s) < 2 or not all(isinstance(d, int) for d in s)
                            for s in shapes):
        return []
    batch = count / math.prod(out)
    return _attention(batch, float(math.prod(out[:-1])), float(math.prod(value[:-1])),
                      float(query[-1]), float(out[-1]),
                      "traced query/value shapes, batch from a sampled step",
                      scores=macs.get("score_mode", "dot") == "dot")


def _aligned(dims: list[int] | None, gemms: list[Gemm], multiple: int) -> bool | None:
    """Whether the GEMMs suit Tensor Cores: the kernel's dims, or attention's
    contracted and produced sizes (head sizes, key length) when sized."""
    attention = [g for g in gemms if not g.weights]
    if attention:
        return all(int(size) % multiple == 0 for g in attention for size in (g.k, g.n))
    if not dims:
        return None
    return all(int(d) % multiple == 0 for d in dims)


def _first_overflows(numerics) -> set[str]:
    """The first layer in call order that overflowed, in each sample."""
    if numerics is None:
        return set()
    bad = _overflow_matrix(numerics)
    found = set()
    for row in bad:
        hits = np.flatnonzero(row)
        if len(hits):
            found.add(numerics.layers[int(hits[0])])
    return found


def _overflow_matrix(numerics) -> np.ndarray:
    forward = numerics.forward
    beyond = np.nan_to_num(forward["abs_max"], nan=0.0) > numerics.policy_max
    return (np.nan_to_num(forward["nonfinite_frac"]) > 0) | beyond


def _sampled(fact: LayerFacts, numerics, i: int, index: dict, record: dict,
             first: set[str]) -> None:
    forward, backward = numerics.forward, numerics.backward
    fact.sampled = True
    fact.samples = int(len(numerics.steps))
    limit = dtypes.DTYPE_MAX.get(fact.compute_dtype, numerics.policy_max)
    nonfinite = np.nan_to_num(forward["nonfinite_frac"][:, i]) > 0
    peaks = forward["abs_max"][:, i]
    bad = nonfinite | (np.nan_to_num(peaks) > limit)
    fact.overflowed = bool(bad.any())
    fact.overflow_samples = int(bad.sum())
    if bad.any():
        fact.first_overflow_step = int(numerics.steps[int(np.flatnonzero(bad)[0])])
    fact.first_overflow = fact.name in first
    finite = peaks[np.isfinite(peaks)]
    fact.forward_abs_max = float(finite.max()) if len(finite) else None
    grads = backward["abs_max"][:, i]
    grads = grads[np.isfinite(grads)]
    fact.backward_abs_max = float(grads.max()) if len(grads) else None
    fact.forward_underflow = _mean_share(forward, i)
    fact.backward_underflow = _mean_share(backward, i)
    if len(finite) > 1:
        running = np.maximum.accumulate(finite)[:-1]
        fact.amax_growth = float(np.max(finite[1:] / np.maximum(running, 1e-30)))
    producers = record.get("inputs_from") or []
    if fact.float8_eligible and len(producers) == 1 and producers[0] in index:
        fact.float8_input_loss = _float8_loss(
            numerics.forward_hist[:, index[producers[0]]],
            numerics.forward["abs_max"][:, index[producers[0]]], numerics.hist_edges,
            FLOAT8_INPUT_FORMAT)
    if fact.float8_eligible:
        fact.float8_gradient_loss = _float8_loss(
            numerics.backward_hist[:, i], backward["abs_max"][:, i], numerics.hist_edges,
            FLOAT8_GRADIENT_FORMAT)


def _mean_share(stats: dict, i: int) -> float | None:
    """The mean share of non-zero values below float16's smallest normal."""
    below = stats["underflow_frac"][:, i]
    nonzero = 1.0 - stats["zero_frac"][:, i]
    ok = np.isfinite(below) & (nonzero > 0)
    if not ok.any():
        return None
    return float(np.mean(below[ok] / nonzero[ok]))


def _float8_loss(histograms: np.ndarray, abs_max: np.ndarray, edges: np.ndarray,
                 fmt: str) -> float | None:
    """The largest share, over the samples, of non-zero values a float8
    format scaled to the sample's amax flushes to zero: those in histogram
    bins wholly below amax / 2**span."""
    worst = None
    for counts, peak in zip(histograms, abs_max, strict=True):
        total = float(np.sum(counts))
        if total <= 0 or not np.isfinite(peak) or peak <= 0:
            continue
        floor = math.log2(peak) - FLOAT8_SPAN[fmt]
        # Bin b < len(edges) lies below edges[b]; the last bin is open above.
        wholly_below = int(np.searchsorted(edges, floor, side="right"))
        share = float(np.sum(counts[:wholly_below])) / total
        worst = share if worst is None else max(worst, share)
    return worst
