"""Loss-scale rules: collapse (MP001), overflow storms (MP002), no loss
scaling (MP008), and a loss that never went through `scale_loss` (MP018)."""

from __future__ import annotations

import math

import numpy as np

from mpprof.diagnosis.core import NotApplicable, NotMeasured, finding, rule
from mpprof.diagnosis.numerics import gradient_overflow_origin
from mpprof.diagnosis.view import RunView, forward_overflow_mask
from mpprof.dtypes import DTYPE_MAX
from mpprof.records import schema

_EVENT = schema.LOSS_SCALE_EVENT_COLUMN

# MP001: Keras 3's LossScaleOptimizer has no floor. A scale below 1 means the
# gradients overflow float16 even UNSCALED, so no loss scale can help.
MIN_HEALTHY_LOSS_SCALE = 1.0
# MP001 (tf-keras, floor of 1): overflows AT the floor mean the same thing;
# a few can be a bad batch, this many in one run is a pattern.
FLOOR_OVERFLOWS_LIMIT = 10

# MP002: a share of steps skipped by overflows, beyond the normal probe after
# each growth. A healthy run with the default dynamic_growth_steps=2000 skips
# ~0.05% of its steps (one probe per growth); 5% is 100x that and wastes one
# step in twenty.
EXCESS_OVERFLOW_SHARE = 0.05
# MP002: the default initial scale (2**15) usually needs a few halvings to
# settle (one skipped step each), so a handful of overflows is calibration,
# not a problem; 8 means the scale started >= 256x too high or keeps failing.
MIN_EXCESS_OVERFLOWS = 8


def _origin_text(view: RunView) -> str:
    """Where the gradient overflow starts, for MP001/MP002's fix texts."""
    forward = forward_overflow_mask(view.run, view)
    if forward.size and forward.any():
        sample = int(np.flatnonzero(forward.any(axis=1))[0])
        layer = view.numerics.layers[int(np.argmax(forward[sample]))]
        return (
            f"The overflow starts in the forward pass: layer {layer!r} (MP003, step "
            f"{int(view.numerics.steps[sample])}). Keep it in float32:\n"
            f"    {view.syntax.layer(view.layer_class(layer))}\n"
        )
    origin = gradient_overflow_origin(view)
    if origin is None:
        return (
            "Find the layer that overflows (MP003, MP019; record numerics with "
            "numerics_every=N), then either keep it in float32:\n"
            f"    {view.syntax.layer(view.layer_class(view.last_half_layer()))}\n"
        )
    text = (
        f"The gradient overflow starts at {origin['kind']} {origin['name']!r} "
        f"(MP019, step {origin['step']})"
    )
    if origin["half_head"]:
        text += (
            f": it is the model's {origin['dtype']} output layer, so the loss's "
            "gradient overflows there (see MP006). Give it float32:\n"
        )
    else:
        text += ". Keep it in float32:\n"
    return text + f"    {view.syntax.layer(view.layer_class(origin['layer']))}\n"


@rule("MP001", "critical", "loss scale collapsed: gradients overflow even unscaled",
      view="loss_scale", data="loss scale")
def loss_scale_collapse(view: RunView) -> list:
    """The loss scale fell below 1 (Keras 3, no floor), or overflowed this
    many times at tf-keras' floor of 1: the gradients overflow float16 even
    unscaled, so no loss scale can help. Names the layer where the gradient
    overflow starts when numerics were recorded (MP019)."""
    view.require_mixed()
    series = view.require_loss_scales()
    return [found for name, loss_scale in series
            for found in _collapse(view, name, loss_scale, several=len(series) > 1)]


def _named(title: str, name: str, several: bool) -> str:
    """A finding's title, naming its optimizer when the run has several series."""
    return f"{title} (optimizer {name})" if several else title


def _collapse(view: RunView, name: str, loss_scale, *, several: bool) -> list:
    """MP001 for one optimizer's series."""
    overflows = loss_scale.overflows
    before, after = overflows[:, _EVENT.scale_before], overflows[:, _EVENT.scale_after]
    below = overflows[after < MIN_HEALTHY_LOSS_SCALE]
    at_floor = overflows[(before <= MIN_HEALTHY_LOSS_SCALE) & (after >= before)]
    if len(below):
        first = below[0]
        evidence = {
            "first_step_below_1": int(first[_EVENT.step]),
            "scale_at_that_step": float(first[_EVENT.scale_after]),
            "lowest_scale": float(after.min()),
            "final_scale": loss_scale.final_scale,
            "overflows_below_1": len(below),
            "overflows": loss_scale.skipped_steps,
        }
        step = int(first[_EVENT.step])
        what = f"the loss scale fell to {evidence['lowest_scale']:g}"
    elif len(at_floor) >= FLOOR_OVERFLOWS_LIMIT:
        evidence = {
            "overflows_at_floor": len(at_floor),
            "floor": MIN_HEALTHY_LOSS_SCALE,
            "first_step_at_floor": int(at_floor[0, _EVENT.step]),
        }
        step = int(at_floor[0, _EVENT.step])
        what = f"{len(at_floor)} overflows with the loss scale at its floor of 1"
    else:
        return []
    evidence["optimizer"] = name
    origin = gradient_overflow_origin(view)
    if origin is not None:
        evidence["gradient_overflow_starts_at"] = origin["name"]
    zero_note = ""
    if evidence.get("lowest_scale", 1.0) == 0.0:
        zero_note = (
            " The scale reached 0: the next finite step divides by it and makes "
            "the weights NaN."
        )
    fix = (
        f"Gradients exceed float16's range ({DTYPE_MAX['float16']:g}) even without "
        "scaling, so no loss scale can help." + zero_note + " " + _origin_text(view)
        + "or shrink the loss and activations (normalise regression targets and "
        "inputs to unit scale, lower the learning rate), or train in bfloat16, which "
        "has float32's range:\n"
        f"    {view.syntax.set_policy('mixed_bfloat16')}"
    )
    title = _named(f"Loss scale collapsed: {what}; gradients overflow float16 even unscaled",
                   name, several)
    return [finding("MP001", title, step=step, evidence=evidence, fix=fix)]


@rule("MP002", "warning", "many steps skipped by overflows, beyond the growth probe",
      view="loss_scale", data="loss scale")
def overflow_share(view: RunView) -> list:
    """Overflows (skipped steps) beyond the one probe that follows each
    growth are at least `EXCESS_OVERFLOW_SHARE` of the steps and at least
    `MIN_EXCESS_OVERFLOWS`. A suggested initial scale is never below 1: when
    the scale descends without settling, the fix defers to MP001/MP003/MP019."""
    view.require_mixed()
    series = view.require_loss_scales()
    if all(ls.steps_run - ls.first_step <= 0 for _, ls in series):
        raise NotMeasured("no train step was recorded")
    return [found for name, loss_scale in series
            for found in _overflow_share(view, name, loss_scale, several=len(series) > 1)]


def _overflow_share(view: RunView, name: str, loss_scale, *, several: bool) -> list:
    """MP002 for one optimizer's series."""
    steps = loss_scale.steps_run - loss_scale.first_step
    if steps <= 0:
        return []
    excess = _excess_overflows(loss_scale)
    probes = loss_scale.skipped_steps - len(excess)
    if len(excess) < MIN_EXCESS_OVERFLOWS or len(excess) / steps < EXCESS_OVERFLOW_SHARE:
        return []
    descent = loss_scale.initial_descent
    settled = (float(loss_scale.overflows[descent - 1, _EVENT.scale_after]) if descent
               else loss_scale.final_scale)
    evidence = {
        "optimizer": name,
        "steps": steps,
        "overflows": loss_scale.skipped_steps,
        "probe_overflows": probes,
        "excess_overflows": len(excess),
        "excess_share": round(len(excess) / steps, 4),
        "initial_descent_overflows": descent,
        "initial_scale": loss_scale.initial_scale,
        "scale_after_initial_descent": settled,
        "final_scale": loss_scale.final_scale,
        "growths": len(loss_scale.growths),
    }
    origin = gradient_overflow_origin(view)
    if origin is not None:
        evidence["gradient_overflow_starts_at"] = origin["name"]
    settings = view.context.collector("loss_scale")
    growth_steps = (settings.get("series") or {}).get(name, settings).get("dynamic_growth_steps")
    if growth_steps is not None:
        evidence["dynamic_growth_steps"] = growth_steps
    if descent >= len(excess) / 2 and settled >= MIN_HEALTHY_LOSS_SCALE:
        exponent = int(math.floor(math.log2(settled)))
        fix = (
            f"Most skipped steps ({descent}) are the scale halving down from its "
            f"initial value {loss_scale.initial_scale:g} to {settled:g}. Start it "
            "there:\n"
            f"    {name} = "
            + view.syntax.loss_scale_optimizer(_inner(view, name),
                                               initial_scale=f"2.0**{exponent}")
        )
    elif descent >= len(excess) / 2:
        fix = (
            f"The scale halved from {loss_scale.initial_scale:g} to "
            f"{loss_scale.final_scale:g}, below 1, without settling: no initial scale "
            "helps (see MP001). " + _origin_text(view)
            + "or train in bfloat16, which has float32's range:\n"
            f"    {view.syntax.set_policy('mixed_bfloat16')}"
        )
    else:
        fix = (
            "The gradients keep exceeding float16 at the scale the optimizer settles "
            "on. " + _origin_text(view)
            + "or clip or normalise what produces the spikes (outliers in the data, "
            "a learning rate too high), or train in bfloat16, which has float32's "
            f"range:\n    {view.syntax.set_policy('mixed_bfloat16')}"
        )
    if growth_steps is not None and growth_steps < 100 and probes:
        fix += (
            f"\nAlso: dynamic_growth_steps={growth_steps} probes a higher scale (and "
            "skips a step when it fails) very often; the default is 2000."
        )
    title = _named(
        f"{len(excess)} of {steps} steps ({len(excess) / steps:.0%}) skipped by "
        "float16 overflows, beyond the normal probe after each growth", name, several)
    return [finding("MP002", title, step=int(excess[0]), evidence=evidence, fix=fix)]


def _inner(view: RunView, name: str) -> str:
    """What a fix wraps for optimizer `name`: the compiled one's variable, or
    a new optimizer of its inner class."""
    if name == "optimizer":
        return "optimizer"
    inner = next((o.get("inner") for o in view.optimizers if o.get("name") == name), None)
    return view.syntax.optimizer(inner or "Adam")


def _excess_overflows(loss_scale) -> np.ndarray:
    """Overflow steps that are not the normal probe after a growth.

    After each growth (scale doubled) the next overflow halves it back: one
    overflow per growth is the loss scale doing its job. Each growth excuses
    the first overflow after it, if that comes before the next growth.
    """
    overflows = np.sort(loss_scale.overflow_steps)
    growths = np.sort(loss_scale.growths[:, _EVENT.step].astype(np.int64))
    if not len(overflows) or not len(growths):
        return overflows
    first_after = np.searchsorted(overflows, growths, side="right")
    next_growth = np.append(growths[1:], np.iinfo(np.int64).max)
    valid = first_after < len(overflows)
    valid[valid] &= overflows[first_after[valid]] < next_growth[valid]
    excused = np.zeros(len(overflows), dtype=bool)
    excused[first_after[valid]] = True
    return overflows[~excused]


@rule("MP008", "critical", "mixed_float16 without loss scaling", view="overview",
      data="context")
def no_loss_scaling(view: RunView) -> list:
    """The model computes in float16 and an optimizer the train step used is
    not a LossScaleOptimizer. Every used optimizer is judged (a GAN's two);
    a compiled optimizer the train step never used is not."""
    view.require_mixed()
    if not view.computes_float16:
        raise NotApplicable("bfloat16 needs no loss scaling")
    optimizers = view.optimizers
    if not optimizers:
        state = view.context.collector("loss_scale").get("state")
        if state is None:
            raise NotMeasured("no run context was recorded")
        raise NotMeasured("the run context names no optimizer")
    unscaled = [o for o in optimizers if o.get("loss_scale") is False]
    if not unscaled:
        return []
    names = [f"{o.get('name')} ({o.get('class')})" for o in unscaled]
    evidence = {
        "model_policy": view.policy,
        "optimizer": unscaled[0].get("class"),
        "optimizers_without_loss_scaling": names,
        "float16_layers": sum(
            layer.get("compute_dtype") == "float16" for layer in view.leaf_layers
        ),
    }
    wrap = "\n".join(
        f"    {o.get('name')} = "
        + view.syntax.loss_scale_optimizer(view.syntax.optimizer(o.get("class") or "Adam"))
        for o in unscaled
    )
    fix = (
        "Without loss scaling, float16 gradients below 6e-8 become zero and large "
        "ones overflow unnoticed. Wrap the optimizer(s):\n" + wrap + "\n"
    )
    if len(optimizers) == 1 and unscaled[0].get("name") == "optimizer":
        fix += (
            "    model.compile(optimizer=optimizer, ...)\n"
            "(model.compile does this itself when auto_scale_loss=True, the default, "
            'and the model was built under "mixed_float16".)'
        )
    else:
        fix += ("and in the custom train_step scale the loss before taking gradients: "
                + view.syntax.scaled_step)
    title = f"mixed_float16 training without loss scaling (optimizer {', '.join(names)})"
    return [finding("MP008", title, evidence=evidence, fix=fix)]


@rule("MP018", "critical", "the loss never went through optimizer.scale_loss",
      view="overview", data="context (optimizers)")
def scale_loss_skipped(view: RunView) -> list:
    """A LossScaleOptimizer's `apply` ran but its `scale_loss` never did (a
    custom `train_step` that takes gradients of the raw loss): the optimizer
    divides gradients by the scale that were never multiplied by it. In
    tf-keras, `apply_gradients` ran but neither `minimize` nor
    `get_scaled_loss`: the gradients were never scaled."""
    view.require_mixed()
    used = view.context.optimizers
    if not isinstance(used, list):
        raise NotMeasured("which optimizer methods the train step called was not recorded")
    scaled = [o for o in view.optimizers if o.get("loss_scale")]
    if not scaled:
        raise NotApplicable("no LossScaleOptimizer was used")
    known = [o for o in scaled if o.get("apply_called") is not None
             and o.get("scale_loss_called") is not None]
    if not known:
        raise NotMeasured("whether scale_loss and apply ran was not recorded")
    skipped = [o for o in known if o["apply_called"] and not o["scale_loss_called"]]
    if not skipped:
        return []
    names = [o.get("name") for o in skipped]
    evidence = {
        "optimizers": [
            {k: o.get(k) for k in ("name", "class", "inner", "apply_called",
                                   "scale_loss_called")}
            for o in skipped
        ],
    }
    if view.loss_scale is not None:
        evidence["final_loss_scale"] = view.loss_scale.final_scale
    name = names[0] if names[0] != "optimizer" else "self.optimizer"
    scale = view.loss_scale.final_scale if view.loss_scale is not None else None
    inner = skipped[0].get("inner") or skipped[0].get("class")
    effect = _unscaled_update_effect(inner, scale, view.syntax.module)
    evidence["update_effect"] = effect["kind"]
    if view.syntax.module == "tf_keras":  # tf-keras' LossScaleOptimizer API
        why = (
            "The loss never went through get_scaled_loss (nor minimize): the "
            "gradients were never multiplied by the loss scale, so float16 gradients "
            "inside the model below 6e-8 flush to zero (and below 6.1e-5 lose "
            "precision), as without loss scaling. " + effect["text"]
        )
        title = (
            f"The loss never went through {', '.join(names)}.get_scaled_loss: "
            "gradients were never multiplied by the loss scale"
        )
    else:
        why = (
            "The loss never went through optimizer.scale_loss: the LossScaleOptimizer "
            "divides the gradients by the loss scale without their having been "
            "multiplied by it, and the float16 gradients inside the model below 6e-8 "
            "flush to zero (below 6.1e-5 they lose precision): those updates are lost, "
            "as without loss scaling. " + effect["text"]
        )
        title = (
            f"The loss never went through {', '.join(names)}.scale_loss: gradients are "
            "divided by the scale without having been multiplied"
        )
    fix = (
        why + "\nIn the custom train_step, scale the loss before taking gradients:\n"
        + view.syntax.custom_step(name)
    )
    return [finding("MP018", title, evidence=evidence, fix=fix)]


# Optimizers that divide each update by a running root mean square (or take
# its sign): a constant factor on every gradient cancels out of the update,
# up to epsilon.
ADAPTIVE_OPTIMIZERS = frozenset({
    "Adam", "AdamW", "Adamax", "Nadam", "Adagrad", "Adadelta", "RMSprop", "Adafactor",
    "Lamb", "Lion", "Muon",
})


def _unscaled_update_effect(optimizer: str | None, scale: float | None, module: str) -> dict:
    """What gradients divided by the loss scale do to `optimizer`'s updates:
    {"kind": "adaptive"|"scaled"|"unscaled"|"unknown", "text"}."""
    if module == "tf_keras":
        # tf-keras' apply_gradients does not unscale: only a step that calls
        # get_unscaled_gradients divides by the scale.
        return {"kind": "unscaled", "text": (
            "Where the step calls get_unscaled_gradients on them, every gradient is also "
            "divided by the loss scale: an SGD-like update that many times too small, "
            "an Adam-like one (normalised by the gradients' RMS) barely changed."
        )}
    factor = f"{scale:g}" if scale else "the loss scale"
    if optimizer in ADAPTIVE_OPTIMIZERS:
        return {"kind": "adaptive", "text": (
            f"{optimizer} divides each update by the gradients' running RMS, so the "
            f"constant division by {factor} mostly cancels out: updates shrink only where "
            "a gradient divided by it falls near epsilon (measured on a VAE with Adam: "
            "weights moved 1.7x more once fixed, not 32768x). The loss scale also never "
            "sees an overflow, so it only grows."
        )}
    if optimizer in ("SGD",):
        return {"kind": "scaled", "text": (
            f"{optimizer} applies the gradients as they are: every update is {factor} "
            "times too small, as if the learning rate were divided by it (and the scale "
            "doubles every dynamic_growth_steps, as no overflow stops it)."
        )}
    return {"kind": "unknown", "text": (
        f"Every gradient reaching {optimizer or 'the optimizer'} is {factor} times too "
        "small: an SGD-like update shrinks by that factor, an Adam-like one (normalised "
        "by the gradients' RMS) far less."
    )}
