"""A run as the rules see it, and the one answer to "did this layer overflow?".

`RunView` reads each record of a `mpprof.records.reader.Run` once and derives what
several rules need: the dtype each layer really computed in, the numeric
limits of that dtype, the optimizers the train step used, and the Keras the
model was written in (so that fix texts speak it).

`forward_overflow_mask(run)` decides, for every sampled step and layer,
whether the layer's output overflowed the dtype it was computed in. The
reader, the report and the dashboard show this answer; nothing else decides it.
"""

from __future__ import annotations

import functools

import numpy as np

from mpprof.diagnosis.core import NotApplicable, NotMeasured
from mpprof.dtypes import DTYPE_MAX, HALF_DTYPES
from mpprof.fix_syntax import FixSyntax
from mpprof.records.run_context import RunContext

NUMERICS_HINT = (
    "per-layer numerics were not recorded: pass numerics_every=N to "
    "mpprof.MixedPrecisionProfiler(log_dir, numerics_every=100)"
)


def inventory_missing_reason(context: RunContext) -> str:
    """Why a run has no precision inventory, from what its run context says.

    Args:
        context: the run's run context.
    """
    state = context.collectors.get("precision")
    if not isinstance(state, dict):
        return "no precision inventory was recorded (the run context does not say why)"
    if state.get("state") == "failed":
        return ("no precision inventory was recorded: the precision collector "
                f"failed ({state.get('reason')})")
    if state.get("reason"):
        return f"no precision inventory was recorded: {state['reason']}"
    error = context.fit_error
    if error is not None:
        return (f"no precision inventory was recorded: the fit raised at step "
                f"{error.get('step')} (MP020) before its first step ended")
    if state.get("traced"):
        return ("no precision inventory was recorded though the step traced "
                "(the run stopped before the end of its first step?)")
    # Runs written before the context gave a reason: mpprof then missed the
    # calls of quantized layers, so a step that ran cannot be told apart
    # from one that never did.
    return ("no precision inventory was recorded: no layer call was seen (this run "
            "does not record whether its train step ran)")


class RunView:
    """A run's records, each read once, plus what the rules derive from them.

    Args:
        run: a `mpprof.records.reader.Run`.
        assume_gpu: judge GPU-only matters (Tensor Core shapes) as a
            projection where the run had no GPU.
    """

    def __init__(self, run, *, assume_gpu: bool = False):
        self.run = run
        self.assume_gpu = assume_gpu

    @functools.cached_property
    def context(self) -> RunContext:
        return self.run.context

    @functools.cached_property
    def inventory(self) -> dict | None:
        return self.run.inventory

    @functools.cached_property
    def loss_scale(self):
        return self.run.loss_scale

    @functools.cached_property
    def numerics(self):
        return getattr(self.run, "numerics", None)

    @functools.cached_property
    def health(self) -> dict | None:
        return getattr(self.run, "health", None)

    @functools.cached_property
    def gpu(self):
        return getattr(self.run, "gpu", None)

    @functools.cached_property
    def syntax(self) -> FixSyntax:
        return FixSyntax(self.context.keras_flavor, self.context.keras_backend)

    @functools.cached_property
    def loss_watched(self) -> bool:
        """False when the health record says no loss was watched: then every
        recorded loss (numerics' "loss" column included) is "not measured"."""
        return (self.health or {}).get("loss_watched", True) is not False

    @functools.cached_property
    def optimizers(self) -> list[dict]:
        """The optimizers the train step used: the context's "optimizers", or
        for older runs the compiled optimizer alone (`{"name", "class",
        "inner", "loss_scale", "apply_called", "scale_loss_called"}`)."""
        used = self.context.optimizers
        if isinstance(used, list):
            return [o for o in used if isinstance(o, dict)]
        name = self.context.optimizer
        if name is None:
            return []
        state = self.context.collector("loss_scale").get("state")
        return [{
            "name": "optimizer",
            "class": name,
            "inner": None,
            "loss_scale": self.loss_scale is not None or state == "ok",
            "apply_called": None,
            "scale_loss_called": None,
        }]

    @functools.cached_property
    def policy(self) -> str | None:
        """The model's dtype policy name."""
        policy = self.context.model_policy
        if policy is None and self.inventory:
            policy = self.inventory.get("model", {}).get("policy")
        return policy

    @functools.cached_property
    def leaf_layers(self) -> list[dict]:
        if not self.inventory:
            return []
        return [layer for layer in self.inventory.get("layers", []) if layer.get("is_leaf")]

    @functools.cached_property
    def layers_by_name(self) -> dict[str, dict]:
        """Every inventory layer by its full path."""
        if not self.inventory:
            return {}
        return {layer["name"]: layer for layer in self.inventory.get("layers", [])}

    @functools.cached_property
    def computes_float16(self) -> bool:
        """Whether any part of the model computes in float16."""
        if self.leaf_layers:
            return any(layer_dtype(layer) == "float16" for layer in self.leaf_layers)
        return self.policy == "mixed_float16"

    @functools.cached_property
    def half_dtype(self) -> str | None:
        """ "float16" or "bfloat16" if the model (or any layer) computes in it."""
        if self.computes_float16:
            return "float16"
        if self.leaf_layers:
            if any(layer_dtype(layer) == "bfloat16" for layer in self.leaf_layers):
                return "bfloat16"
            return None
        return "bfloat16" if self.policy == "mixed_bfloat16" else None

    def require_mixed(self) -> str:
        if self.policy is None and not self.leaf_layers:
            raise NotMeasured("no run context or precision inventory was recorded")
        if self.half_dtype is None:
            reason = f"the model trains in {self.policy or 'float32'}"
            modes = sorted({layer["quantization_mode"] for layer in self.leaf_layers
                            if layer.get("quantization_mode")})
            if modes:
                # Not "plain float32": say what its quantized layers compute.
                reason += (f" (its {'/'.join(modes)} layers quantize their matmul operands "
                           "and dequantize them to float32: no float16/bfloat16 to judge)")
            raise NotApplicable(reason)
        return self.half_dtype

    def require_loss_scales(self) -> list[tuple[str, object]]:
        """Every loss-scale series by optimizer name, the primary one first
        (a GAN's optimizers each have one); NotApplicable without any."""
        self.require_loss_scale()
        return list(self.run.loss_scales.items())

    def require_loss_scale(self):
        if self.loss_scale is None:
            state = self.context.collector("loss_scale")
            raise NotApplicable(
                state.get("reason") or "no dynamic loss scale recorded (no LossScaleOptimizer)"
            )
        return self.loss_scale

    def require_numerics(self):
        if self.numerics is not None and len(self.numerics.steps) and len(self.numerics.layers):
            return self.numerics
        state = self.context.collector("numerics")
        error = self.context.fit_error
        if error is not None and self.context.fit_state == "failed":
            raise NotMeasured(
                f"no step was sampled: the fit raised at step {error.get('step')} "
                "(MP020) before its first sample")
        if state.get("state") == "ok":
            every, early = state.get("every"), state.get("early_steps")
            early = (f"; each fit samples its steps {', '.join(map(str, early))} first"
                     if early else "")
            raise NotMeasured(
                f"no step was sampled: the fit ended before its first sample "
                f"(numerics_every={every}{early}), and no overflow triggered a "
                "forensic sample"
            )
        if state.get("state") == "off" and state.get("every") is not None:
            raise NotMeasured(f"no step was sampled: {state.get('reason')}")
        raise NotMeasured(NUMERICS_HINT)

    def require_inventory(self) -> dict:
        if not self.inventory:
            raise NotMeasured(inventory_missing_reason(self.context))
        return self.inventory

    @functools.cached_property
    def hardware(self) -> dict | None:
        """{"cpu_only": bool, "gpus": [...]} or None when unknown."""
        hardware = self.context.hardware
        if isinstance(hardware, dict) and "cpu_only" in hardware:
            return hardware
        if self.context.gpus_visible == 0:
            return {"cpu_only": True, "gpus": [], "source": "gpus_visible"}
        return None

    def layer_at(self, path: str) -> dict | None:
        """The inventory layer a profiler's layer path names: the path itself,
        or the longest inventory name that ends it (traces prefix the model's
        own name: "model/dense" is layer "dense"); None where none does."""
        found = self.layers_by_name.get(path)
        if found is not None:
            return found
        ending = [name for name in self.layers_by_name if path.endswith("/" + name)]
        return self.layers_by_name[max(ending, key=len)] if ending else None

    def layer_class(self, name: str | None) -> str:
        layer = self.layers_by_name.get(name) if name else None
        return layer["class"] if layer else "Dense"

    def output_dtype(self, name: str) -> str | None:
        """The dtype `name`'s output was computed in (None: not in the inventory)."""
        layer = self.layers_by_name.get(name)
        return layer_dtype(layer) if layer else None

    def numerics_dtypes(self) -> list[str]:
        """The output dtype of each numerics layer (the model policy's compute
        dtype where the inventory does not know the layer)."""
        default = {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}.get(
            self.policy or "", "float32"
        )
        return [self.output_dtype(name) or default for name in self.numerics.layers]

    def layer_of_variable(self, variable: str) -> str | None:
        """The full inventory path of the layer owning `variable` (a path such
        as "model/encoder/key/bias"): the longest layer path that ends the
        variable's own prefix."""
        prefix = variable.rsplit("/", 1)[0] if "/" in variable else ""
        best = None
        for name in self.layers_by_name:
            if (prefix == name or prefix.endswith("/" + name)) and (
                best is None or len(name) > len(best)
            ):
                best = name
        if best is not None:
            return best
        parts = variable.split("/")
        return parts[-2] if len(parts) > 1 else None

    def last_half_layer(self) -> str | None:
        """The last layer in call order that outputs half precision."""
        called = sorted(
            (layer for layer in self.leaf_layers if layer.get("call_index") is not None),
            key=lambda layer: layer["call_index"],
        )
        for layer in reversed(called):
            if set(layer.get("output_dtypes") or ()) & set(HALF_DTYPES):
                return layer["name"]
        return called[-1]["name"] if called else None


def layer_dtype(layer: dict) -> str:
    """The dtype a layer's output really was: traced, else its compute dtype."""
    outputs = [d for d in layer.get("output_dtypes") or () if d in DTYPE_MAX]
    half = [d for d in outputs if d in HALF_DTYPES]
    if half:
        return half[0]
    if outputs:
        return outputs[0]
    return layer.get("compute_dtype") or "float32"


def forward_overflow_mask(run, view: RunView | None = None) -> np.ndarray:
    """[samples, layers] bool: whether each layer's output overflowed.

    A layer overflowed when its output held a non-finite value, or a finite
    magnitude beyond the largest value of the dtype it was computed in (a
    float32 island may exceed 65504; a float16 layer may not).

    Args:
        run: a `mpprof.records.reader.Run` with numerics.
        view: its `RunView`, if one exists already.
    """
    view = view or RunView(run)
    numerics = view.numerics
    if numerics is None or not len(numerics.steps):
        return np.zeros((0, 0), dtype=bool)
    abs_max = np.asarray(numerics.forward["abs_max"], dtype=np.float64)
    nonfinite = np.asarray(numerics.forward["nonfinite_frac"], dtype=np.float64)
    limit = np.array([DTYPE_MAX[d] for d in view.numerics_dtypes()])
    with np.errstate(invalid="ignore"):
        return (nonfinite > 0) | ~np.isfinite(abs_max) | (abs_max > limit[None, :])


def first_forward_offender(run, sample: int, view: RunView | None = None) -> int | None:
    """The index (in `run.numerics.layers`) of the first layer in call order
    whose output overflowed at `sample`, or None."""
    mask = forward_overflow_mask(run, view)
    if not len(mask):
        return None
    hits = np.flatnonzero(mask[sample])
    return int(hits[0]) if len(hits) else None


def backward_overflow_mask(run, view: RunView | None = None) -> np.ndarray:
    """[samples, layers] bool: whether the gradient flowing into each layer's
    output held a non-finite value."""
    view = view or RunView(run)
    numerics = view.numerics
    if numerics is None or not len(numerics.steps):
        return np.zeros((0, 0), dtype=bool)
    return np.asarray(numerics.backward["nonfinite_frac"], dtype=np.float64) > 0


def first_backward_offender(run, sample: int, view: RunView | None = None) -> int | None:
    """The index of the first layer, from the loss backwards, whose incoming
    gradient was non-finite at `sample`, or None."""
    mask = backward_overflow_mask(run, view)
    if not len(mask):
        return None
    hits = np.flatnonzero(mask[sample])
    return int(hits[-1]) if len(hits) else None


def gradient_underflow_share(run, view: RunView | None = None) -> np.ndarray:
    """[samples, layers]: the share of each layer's incoming gradient values
    that are non-zero and below float16's normal range, for float16 gradients
    only; NaN for layers whose gradient was bfloat16 or float32 (the recorded
    count uses float16's threshold, which means nothing for them)."""
    view = view or RunView(run)
    numerics = view.numerics
    if numerics is None or not len(numerics.steps):
        return np.zeros((0, 0))
    share = np.asarray(numerics.backward["underflow_frac"], dtype=np.float64).copy()
    half = np.array([d == "float16" for d in view.numerics_dtypes()], dtype=bool)
    share[:, ~half] = np.nan
    return share
