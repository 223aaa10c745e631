"""Replay captures: the batch and weights of an instrumented step that went wrong.

When a numerics-sampled (instrumented) step overflowed (its loss-scale skip
counter moved) or had a non-finite loss, everything needed to run that step
again offline is saved under `RUN/replay/step_<N>@<writer>/` (see
`mpprof.replay.files`): its batch, the weights it ran with, the model's
config and every layer's dtype policy. `mpprof replay` runs it again.

How the batch reaches the host: the instrumented train function is traced
with a `train_step` wrapper that returns, beside the step's logs, the batch
tensors the step received, the step's number and how far the skip counter
moved during it (the dispatcher takes them out before Keras sees the logs).
Nothing is copied unless the host finds the step went wrong; the plain train
function is traced without any of this, so unsampled steps cost nothing.

A skipped step leaves the weights unchanged, so the weights after it are the
ones it ran with. A step with a non-finite loss that was not skipped (no
loss scaling) applied its update: the manifest says so. Non-trainable state
(BatchNormalization's moving statistics) changes in the forward pass even
on a skipped step, so the instrumented step also returns it as the step
found it, and the capture holds that.

Not captured: overflows with a finite loss while every step so far has
overflowed (the loss scale's initial descent, e.g. from 2**15 to where the
gradients fit): halving handles them, and they would spend the budget
before the overflow that matters. The run context counts them.

With `steps_per_execution > 1` the logs are those of a call's last step:
only that step can be captured. Under several replicas the logs are
averaged across replicas, so no batch can be recovered: the capture is off.
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from mpprof.backends import keras_capture
from mpprof.backends.base import REPLAY_LOGS_KEY
from mpprof.backends.flavor import KERAS_3
from mpprof.backends.patching import Patches
from mpprof.replay import files


class ReplayCapture(keras_capture.ReplayCaptureBase):
    """Saves up to `budget` steps per fit that overflowed or lost the loss
    (the arguments: `keras_capture.ReplayCaptureBase`'s; the sampled step's
    loss comes from `health`, its skip counter and step from `loss_scales`).
    """

    def __init__(self, budget: int, keras_api, loss_scales, health, instrumenting,
                 advise_batches: int = 0, fit_params: dict | None = None):
        super().__init__(budget, keras_api, loss_scales, health, instrumenting,
                         advise_batches, fit_params)
        self._structure = None

    def wrap_train_step(self, fit, patches: Patches) -> None:
        """Wraps `model.train_step` so that the instrumented step returns its
        batch; called before the train functions are made (they hold the
        `train_step` they were made with)."""
        model = fit.model
        self._unavailable = self._why_unavailable(model, fit.schedule.every)
        if self._unavailable is not None:
            return
        if self.advise_batches:
            self._advise = keras_capture.AdviseBatches(
                self.advise_batches, self._fit_params, fit.step)
        train_step = model.train_step

        def train_step_returning_batch(data):
            if not self._instrumenting():
                return train_step(data)
            skipped = self._loss_scales.skipped_total
            before = skipped()
            step = self._graph_step(fit)
            # The primary series' own skips: its step number counts them.
            primary = self._loss_scales.primary() if fit.usage.traced else None
            primary_skipped_before = (
                tf.identity(primary.skipped_counter) if primary is not None else None)
            # Read before the step writes them (automatic control
            # dependencies keep program order per variable).
            state_before = {f"state_{i}": tf.identity(v)
                            for i, v in enumerate(model.non_trainable_weights)}
            logs = train_step(data)
            leaves: list = []
            structure = files.encode_structure(data, leaves)
            if not isinstance(logs, dict) or not all(isinstance(t, tf.Tensor) for t in leaves):
                return logs  # a ragged or sparse batch is not captured
            self._structure = structure
            # Flat, string-keyed: the step's outputs pass through Keras' own
            # structure handling, which turns a list into one stacked tensor.
            outputs = {f"leaf_{i}": t for i, t in enumerate(leaves)}
            outputs.update(state_before)
            if before is not None:
                outputs["skipped"] = skipped() - before
                if primary_skipped_before is not None:
                    outputs["skipped_before"] = primary_skipped_before
            if step is not None:
                outputs["step"] = step
            return {**logs, REPLAY_LOGS_KEY: outputs}

        patches.set(model, "train_step", train_step_returning_batch)

    def _why_unavailable(self, model, sample_every: int | None) -> str | None:
        if self.budget == 0 and not self.advise_batches:
            return "replay_budget=0"
        if sample_every is None:
            return "numerics_every=None: only sampled (instrumented) steps are captured"
        if self._api.flavor != KERAS_3:
            return "replay captures need Keras 3 (this model is tf-keras)"
        replicas = int(model.distribute_strategy.num_replicas_in_sync)
        if replicas > 1:
            return (f"the step runs on {replicas} replicas: its logs are averaged across "
                    "them, so the batch cannot be returned")
        return None

    def _graph_step(self, fit):
        """The step's number, read in-graph before the step runs."""
        primary = fit.usage.primary() if fit.usage.traced else None
        if primary is None:
            return None
        return tf.cast(self._loss_scales.graph_step_of(primary.name)(), tf.int64)

    def after_sample(self, fit) -> None:
        """Writes a capture when the sampled step just run went wrong."""
        outputs, fit.replay_outputs = fit.replay_outputs, None
        if outputs is None:
            return
        skipped = int(outputs["skipped"].numpy()) if "skipped" in outputs else 0
        watched = self._health.watched() is not None if fit.guard.ok(self._health.name) else False
        loss = self._health.last_loss() if watched else math.nan
        loss_finite = math.isfinite(loss) if watched else None
        if skipped == 0 and loss_finite is not False:
            self._keep_for_advice(fit, outputs, loss)
            return
        if len(self.captured) >= self.budget:
            return
        step = int(outputs["step"].numpy()) if "step" in outputs else fit.sample_step
        if loss_finite and _in_initial_descent(outputs, step):
            self.initial_descent_skipped += 1
            return
        reasons = []
        if skipped:
            reasons.append("overflow: the loss scale skipped the step")
        if loss_finite is False:
            reasons.append("non-finite loss")
        leaves = [outputs[f"leaf_{i}"] for i in range(len(outputs)) if f"leaf_{i}" in outputs]
        state = [outputs[f"state_{i}"] for i in range(len(outputs)) if f"state_{i}" in outputs]
        self._write(fit, step, leaves, state, reasons, skipped > 0, loss)

    def _keep_for_advice(self, fit, outputs: dict, loss: float) -> None:
        """Keeps a healthy sampled step's batch for the advisor when due."""
        step = int(outputs["step"].numpy()) if "step" in outputs else fit.sample_step
        if self._advise is None or step is None or not self._advise.due(step):
            return
        leaves = [outputs[f"leaf_{i}"] for i in range(len(outputs)) if f"leaf_{i}" in outputs]
        state = [outputs[f"state_{i}"] for i in range(len(outputs)) if f"state_{i}" in outputs]
        self._write(fit, step, leaves, state, ["advise: one of the run's own batches"],
                    False, loss, folder=files.ADVISE_FOLDER, captured=self._advise.kept)

    def _write(self, fit, step: int, leaves, state, reasons: list[str], skipped: bool,
               loss: float, folder: str = files.REPLAY_FOLDER,
               captured: list | None = None) -> None:
        """Writes the capture: the batch, the trainable weights now, and the
        non-trainable ones as the step found them (`state`, in the order of
        `model.non_trainable_weights`)."""
        model = fit.model
        batch = [t.numpy() for t in leaves]
        found = {id(v): s for v, s in zip(model.non_trainable_weights, state, strict=False)}
        weights = [np.asarray(found.get(id(v), v).numpy()) for v in model.weights]
        keras_capture.write_capture(
            fit, self.captured if captured is None else captured, step=step, batch=batch,
            weights=weights, reasons=reasons,
            loss=loss, loss_scale=self._loss_scale_of_step(skipped), skipped=skipped,
            structure=self._structure, config=keras_capture.model_config(model),
            backend={"backend": "tensorflow", "tensorflow": tf.__version__}, folder=folder,
        )

    def _loss_scale_of_step(self, skipped: bool) -> float:
        """The scale the step ran with (a skip has halved it since)."""
        scale = float(self._loss_scales.scale_tensor().numpy())
        return 2.0 * scale if skipped else scale


def _in_initial_descent(outputs: dict, step: int) -> bool:
    """Whether every step before this one overflowed too: the dynamic loss
    scale calibrating down from its initial value, which halving handles and
    a replay would only confirm (it would spend the budget before the
    overflow that matters)."""
    if "skipped_before" not in outputs or "step" not in outputs:
        return False
    return int(outputs["skipped_before"].numpy()) == step
