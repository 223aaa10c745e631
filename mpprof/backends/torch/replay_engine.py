"""Replays a captured step on PyTorch: the first offending aten op, float16
against float32 per layer, and the smallest per-layer float32 fix, verified.

The same three steps and result as on TensorFlow and JAX
(`mpprof.backends.tensorflow.replay_engine`; the search is
`mpprof.replay.search`), with PyTorch's own way of looking at every op:

1. The step runs eagerly with the run's policies, every aten op of its
   forward and backward pass seen by a `TorchDispatchMode`
   (`replay_passes.run_pass`): the first op whose floating output is
   non-finite or beyond its dtype's max, and the layer it ran in.
2. It runs again with every layer in float32: per layer, the relative error
   of the run's output and of the gradient flowing into it against
   float32's, ranked.
3. The greedy float32 set (or bounded inputs, where an input is past
   float16's range), each fix verified (`mpprof.replay.verification`)
   through `Engine`: passes as in 1, and trials of the model's own
   `train_step`, eager, as Keras' PyTorch `fit` runs it.

A model with its own `train_step` is replayed as Keras' step (its forward
pass and `compute_loss`); the result's notes say so.
"""

from __future__ import annotations

from typing import Any

from mpprof.backends import keras_capture, replay_candidates
from mpprof.backends.torch.custom_step import overrides_train_step
from mpprof.backends.torch.replay_passes import as_tensors, run_pass, seeded_global_rng
from mpprof.replay import files, verification

# What `replay` raises, named where the engine is (as every engine names it).
from mpprof.replay.files import ReplayError  # noqa: F401 - re-exported


def _replay_with_weights(model, capture: files.Capture) -> dict:
    keras_capture.captured_model(model, capture)
    extra: dict[str, Any] = {
        "replayed_as": ("model(x, training=True) and model.compute_loss, eagerly, every "
                        "aten op seen by a TorchDispatchMode")}
    if overrides_train_step(model):
        extra["notes"] = [
            "the model has its own train_step: the replay runs Keras' step (its forward "
            "pass and model.compute_loss), not the model's own loss; the trials run the "
            "model's train_step"]
    return Engine.replay_result(model, capture, backend="torch", **extra)


replay = keras_capture.replay_function(_replay_with_weights)


class Engine(replay_candidates.EagerEngine):
    """`mpprof.replay.verification.Engine` on PyTorch: passes watched op by
    op (`replay_passes.run_pass`) and trials of the model's own
    `train_step`, run eagerly as Keras' PyTorch `fit` runs it. (the arguments
    are `replay_candidates.CandidateEngine`'s).
    """

    pass_function = staticmethod(run_pass)

    def trial_step(self, optimizer):
        """The trial's update: the model's own `train_step`, eager, as Keras'
        PyTorch `fit` runs it (jit_compile=False); its loss, or None where
        the loss scale skipped it (`iterations` left as it was)."""
        model = self.model
        return replay_candidates.counted_trial_step(
            model, optimizer, lambda batch: model.train_step(as_tensors(batch)))

    def train(self, candidate: verification.Candidate, steps: int,
              loss_scale: float | None = None) -> list[float]:
        # PyTorch's global generator seeded for the trial (unseeded dropout
        # draws from it): float32's and the candidate's trials see the same
        # masks, and the caller's generator is put back.
        with seeded_global_rng():
            return super().train(candidate, steps, loss_scale)


engine_for = Engine.for_batches
