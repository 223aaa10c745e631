"""Replay captures on PyTorch: the batch and weights of a sampled step that went wrong.

The files are every backend's (`mpprof.backends.keras_capture`; the manifest
says `"backend": "torch"`, which `mpprof replay` reads to pick the PyTorch
engine, `mpprof.backends.torch.replay_engine`). Keras' PyTorch step runs
eagerly, once per call, from Python, so gathering them is plain: on a sampled
call the train functions hand this collector (`before_sampled`) the call's
batch and, before the step runs, clones of the non-trainable variables
(moving statistics change in the forward pass, also on a skipped step) and
the primary optimizer's counts as the step found them (`step_state`, kept on
the host). After the call (`after_sample`) the host counts say whether the
step was skipped, and the step's loss is checked (the sampled call reads its
numerics anyway). Only a step that went wrong reaches the host: the batch,
the trainable weights after the step (a skipped step leaves them unchanged:
the ones it ran with) and the non-trainable ones as the step found them. A
model whose own `train_step` may apply optimizers the step state does not
follow (a GAN's) has its trainable weights cloned before the step too.

Not captured, as on TensorFlow and JAX: the loss scale's initial descent
(every step so far skipped, the loss finite). Under `jit_compile=True` the
sampled steps are not instrumented (`train_functions`): captures are off.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mpprof.backends import keras_capture
from mpprof.backends.torch.custom_step import overrides_train_step
from mpprof.backends.torch.step_state import host_array
from mpprof.replay import files


class ReplayCapture(keras_capture.SampledStepCapture):
    """Saves up to `budget` steps per fit that overflowed or lost the loss
    (the arguments: `keras_capture.ReplayCaptureBase`'s)."""

    # What the sampled step started from, and whether it ran, until written
    # (None, False: no sampled step under way).
    _before: Any = None
    _ran = False

    def overrides_train_step(self, model) -> bool:
        return overrides_train_step(model)

    def unavailable_on_backend(self, model) -> str | None:
        if getattr(model, "jit_compile", False):
            return ("jit_compile=True: on PyTorch the step runs under torch.compile and "
                    "is not sampled; train with jit_compile=False to capture a step")
        return None

    # Around the sampled call (called by `TrainFunctions.run_instrumented`).

    def before_sampled(self, data) -> None:
        """`data`: what Keras hands the train function (a one-element list
        holding the batch)."""
        self._ran = False
        state = self._api.step_state
        if not self.wanted() or state is None:
            self._before = None
            return
        model = self.model
        with torch.no_grad():
            non_trainable = [v.value.detach().clone() for v in model.non_trainable_variables]
            # A custom step's skips are its own optimizers' (a GAN's), which
            # the step state may not follow: its weights after may be updated.
            trainable = ([v.value.detach().clone() for v in model.trainable_variables]
                         if self._custom_step else None)
        self._before = (data[0], non_trainable, trainable, state.all_skipped(),
                        state.primary_counts())

    def after_sampled(self) -> None:
        self._ran = self._before is not None

    # The core's hook.

    def after_sample(self, fit) -> None:
        """Writes a capture when the sampled step just run went wrong."""
        before, ran, self._before, self._ran = self._before, self._ran, None, False
        if before is None or not ran:
            return
        batch, non_trainable, trainable, skipped_before, counts = before
        state = self._api.step_state
        skipped = state.all_skipped() - skipped_before
        watched = state.loss_watched and fit.guard.ok(self._health.name)
        loss = state.last_loss() if watched else math.nan
        loss_finite = math.isfinite(loss) if watched else None
        applied_before, skipped_steps_before, scale = counts
        step = applied_before + skipped_steps_before
        decided = self.decide(step, skipped, loss_finite, applied_before)
        if decided is None:
            return
        reasons, folder, captured = decided
        self._write(fit, step, batch, non_trainable, trainable, reasons, skipped > 0, loss,
                    scale, folder, captured)

    def _write(self, fit, step: int, data, non_trainable, trainable, reasons: list[str],
               skipped: bool, loss: float, scale: float, folder: str,
               captured: list) -> None:
        model = fit.model
        leaves: list = []
        structure = files.encode_structure(data, leaves)
        batch = [host_array(leaf) for leaf in leaves]
        values = {id(v): a for v, a in zip(model.non_trainable_variables, non_trainable,
                                           strict=True)}
        if trainable is not None:
            values.update({id(v): a for v, a in zip(model.trainable_variables, trainable,
                                                    strict=True)})
        weights = [host_array(values.get(id(v), v.value)) for v in model.weights]
        keras_capture.write_capture(
            fit, captured, step=step, batch=batch, weights=weights, reasons=reasons,
            loss=loss, loss_scale=scale, skipped=skipped, structure=structure,
            config=self._config, backend={"backend": "torch", "torch": torch.__version__},
            weights_before=trainable is not None, folder=folder,
        )

    def end(self, fit) -> None:
        self._before = None
        super().end(fit)
