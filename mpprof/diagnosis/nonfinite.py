"""Non-finite loss or weights (MP012)."""

from __future__ import annotations

import numpy as np

from mpprof.diagnosis.core import NotMeasured, finding, rule
from mpprof.diagnosis.view import RunView


@rule("MP012", "critical", "non-finite loss or weights", view="overview",
      data="health / numerics")
def nonfinite(view: RunView) -> list:
    """Weights became NaN/inf, or the loss was non-finite on a step the loss
    scale did not skip. A loss that was not watched (the health record's
    "loss_watched": false) is "not measured", never a value."""
    health, numerics = view.health, view.numerics
    if health is None and numerics is None:
        raise NotMeasured(
            "the loss and weights were not checked (needs the numerics/health "
            "records: numerics_every=N)"
        )
    findings = []
    weights = list((health or {}).get("nonfinite_weights") or [])
    if weights:
        step = (health or {}).get("first_nonfinite_loss_step") or (health or {}).get(
            "checked_step"
        )
        evidence = {
            "nonfinite_weights": weights[:20],
            "count": len(weights),
            "checked_step": (health or {}).get("checked_step"),
        }
        if view.loss_scale is not None:
            evidence["final_loss_scale"] = view.loss_scale.final_scale
        findings.append(finding(
            "MP012",
            f"{len(weights)} weight(s) became non-finite (NaN/inf)",
            layer=view.layer_of_variable(weights[0]),
            step=None if step is None else int(step),
            evidence=evidence,
            fix=_fix(view, weights=True),
        ))
    if not view.loss_watched:
        if not findings:
            raise NotMeasured(
                "the loss was not watched (the train step never handed it to "
                f"{view.syntax.loss_methods}); the weights were checked and are finite"
            )
        return findings
    loss_step = _nonfinite_loss(view, health, numerics)
    if loss_step is not None:
        step, last, evidence = loss_step
        when = f"at step {step}" if last == step else f"between steps {step} and {last}"
        findings.append(finding(
            "MP012",
            f"Non-finite loss {when}, not caught as a gradient overflow",
            step=step,
            evidence=evidence,
            fix=_fix(view, weights=False),
        ))
    return findings


def first_unskipped_nonfinite_loss(view: RunView) -> int | None:
    """The first step whose non-finite loss the loss scale did not skip: its
    update may have made the weights non-finite, so what later steps computed
    only inherits that (None: no such step)."""
    found = _nonfinite_loss(view, view.health, view.numerics)
    return None if found is None else found[0]


def _nonfinite_loss(view: RunView, health, numerics):
    """(first step, last step, evidence) of the first non-finite loss the loss
    scale did not catch: it came at a step from the first to the last (the
    health record dates it to a call of several steps under
    steps_per_execution)."""
    guarded = view.loss_scale is not None
    overflow_steps = _guarding_overflow_steps(view) if guarded else set()
    if health and health.get("first_nonfinite_loss_step") is not None:
        step = int(health["first_nonfinite_loss_step"])
        last = health.get("first_nonfinite_loss_step_last")
        last = step if last is None else max(step, int(last))
        # Under steps_per_execution the call's steps are known, not which of
        # them had the loss: caught when as many of them were skipped.
        count = health.get("first_nonfinite_loss_count") or 1
        skipped = sum(step <= s <= last for s in overflow_steps)
        if not guarded or skipped < count:
            return step, last, {
                "first_nonfinite_loss_step": step,
                "first_nonfinite_loss_step_last": last,
                "first_nonfinite_loss_count": count,
                "nonfinite_loss_batches": health.get(
                    "nonfinite_loss_batches", health.get("nonfinite_loss_steps")
                ),
                "loss_scaled": guarded,
                "step_was_skipped": False,
            }
    if numerics is not None and getattr(numerics, "loss", None) is not None and len(
        numerics.steps
    ):
        loss = np.asarray(numerics.loss, dtype=np.float64)
        bad = ~np.isfinite(loss)
        grads = (getattr(numerics, "variable_grads", None) or {}).get("nonfinite_frac")
        if grads is not None and np.size(grads):
            bad &= ~(np.asarray(grads) > 0).any(axis=1)
        for i in np.flatnonzero(bad):
            step = int(numerics.steps[i])
            if not guarded or step not in overflow_steps:
                return step, step, {
                    "loss": float(loss[i]),
                    "step": step,
                    "loss_scaled": guarded,
                    "gradients_finite": grads is not None,
                }
    return None


def _guarding_overflow_steps(view: RunView) -> set[int]:
    """The steps skipped by the loss scales that guard the watched loss: the
    series the health record names (`loss_guarded_by`: a JAX step's losses
    are checked as their sum, which any of its LossScaleOptimizers catches),
    else the primary one (the optimizer whose loss was watched)."""
    names = (view.health or {}).get("loss_guarded_by")
    series = view.run.loss_scales if names else {}
    guards = [series[name] for name in names or () if name in series] or [view.loss_scale]
    return {int(s) for guard in guards for s in guard.overflow_steps.tolist()}


def _fix(view: RunView, *, weights: bool) -> str:
    lines = []
    if view.loss_scale is not None and view.loss_scale.final_scale == 0.0:
        lines.append("The loss scale reached 0 (MP001): the step after divided by it.")
    if weights:
        lines.append(
            "Training cannot recover from NaN weights: restart from the last "
            "good checkpoint, and stop on the first NaN next time:"
        )
        lines.append(f"    callbacks=[{view.syntax.module}.callbacks.TerminateOnNaN(), ...]")
    lines.append(
        "Find where the first inf/NaN came from: MP003 names the first overflowing "
        "layer; check the data for NaN/inf (np.isfinite(x).all()), divide-by-zero or "
        "log(0) in a custom loss (add an epsilon), and a learning rate too high."
    )
    if view.computes_float16 and view.loss_scale is None:
        lines.append(
            "Wrap the optimizer in a LossScaleOptimizer so non-finite gradient steps "
            "are skipped (MP008)."
        )
    return "\n".join(lines)
