"""What every backend's `RunHealth` writes: the run context's health entry
(`mpprof.backends.protocol.RunHealth.record`), one layout on every backend."""

from __future__ import annotations

# The loss fields when no loss is watched (no optimizer ran the loss).
NOT_WATCHED = {
    "loss_watched": False,
    "first_nonfinite_loss_step": None,
    "first_nonfinite_loss_step_last": None,
    "first_nonfinite_loss_count": None,
    "nonfinite_loss_steps": None,
}


def health_record(loss: dict | None, nonfinite_weights: list[str], step: int) -> dict:
    """The health entry as of `step`.

    Args:
        loss: the watched loss' fields (its watcher's `read()`, and what the
            backend adds), or None when no loss is watched.
        nonfinite_weights: the paths of the weights found non-finite at the
            last epoch end.
        step: the step the entry is of.
    """
    watched = NOT_WATCHED if loss is None else {"loss_watched": True, **loss}
    return {**watched, "nonfinite_weights": nonfinite_weights, "checked_step": step}
