"""Where a Keras 3 train step hands over its loss, on the backends whose
step state checks it (JAX, PyTorch): Keras' own step gives its unscaled loss
to the model's loss tracker (a `Mean` named "loss"); a keras.io-style custom
`train_step` gives its losses to trackers named "loss" or "..._loss". mpprof
wraps every such metric's `update_state` and hands the value to the step
state (`capture_loss`): on JAX while the step is traced (the check runs in
the step), on PyTorch as the step runs. A step that updates no such metric
leaves its loss unwatched (the run context says so).
"""

from __future__ import annotations

from mpprof.backends.patching import Patches


def loss_metrics(model) -> list:
    """The model's metrics that track a loss, by Keras' naming."""
    return [m for m in model.metrics
            if m.name == "loss" or m.name.endswith("_loss")]


def watch_loss_metrics(model, step_state, patches: Patches) -> list[str]:
    """Wraps each loss metric's `update_state` so that the value it gets
    while the step is traced reaches `step_state.capture_loss`; returns the
    metrics' names."""
    names = []
    for metric in loss_metrics(model):
        update_state = metric.update_state

        def watched(values, *args, _update_state=update_state, **kwargs):
            step_state.capture_loss(values)
            return _update_state(values, *args, **kwargs)

        patches.set(metric, "update_state", watched)
        names.append(metric.name)
    return names
