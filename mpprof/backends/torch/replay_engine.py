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

import os

import keras

from mpprof.backends import keras_capture, replay_candidates
from mpprof.backends.torch.custom_step import overrides_train_step
from mpprof.backends.torch.replay_passes import as_tensors, run_pass, seeded_global_rng
from mpprof.replay import files, search, verification
from mpprof.replay.files import ReplayError


def replay(logdir_or_model, run: str | None = None, step: int | None = None, *,
           logdir: str | os.PathLike | None = None, save: bool = True) -> dict:
    """Replays a captured step; the arguments and result are those of
    `mpprof.backends.tensorflow.replay_engine.replay`."""
    return keras_capture.replay_entry(logdir_or_model, run, step, logdir, save,
                                      _replay_with_weights)


def _replay_with_weights(model, capture: files.Capture) -> dict:
    keras_capture.refuse_quantized(model)
    keras_capture.load_weights(model, capture)
    keras_capture.captured_policies(model, capture)
    batch = keras.utils.unpack_x_y_sample_weight(capture.batch())
    scale = float(capture.manifest.get("loss_scale") or 1.0)
    try:
        run_policy = run_pass(model, batch, scale, None)
    except Exception as e:
        raise ReplayError(
            f"the step could not be run eagerly as model(x, training=True) and "
            f"model.compute_loss ({type(e).__name__}: {str(e)[:300]})") from e
    notes = ([
        "the model has its own train_step: the replay runs Keras' step (its forward "
        "pass and model.compute_loss), not the model's own loss; the trials run the "
        "model's train_step"] if overrides_train_step(model) else [])
    return keras_capture.replay_result(
        model, capture, scale=scale, run_policy=run_policy,
        reference=run_pass(model, batch, scale, None, all_float32=True),
        engine=Engine(model, [batch], scale),
        run_unscaled=lambda float32_layers: run_pass(model, batch, 1.0, float32_layers),
        inputs=keras.tree.flatten(batch[0]), backend="torch",
        replayed_as=("model(x, training=True) and model.compute_loss, eagerly, every "
                     "aten op seen by a TorchDispatchMode"),
        **({"notes": notes} if notes else {}))


def engine_for(model, batches: list, loss_scale: float = 1.0) -> Engine:
    """A verification engine (`mpprof.replay.verification.Engine`) of `model`
    as it is now (its weights are the ones every pass and trial start from)
    on `batches` (each as `train_step` receives it: (x, y) or (x, y,
    sample_weight))."""
    return Engine(model, [keras.utils.unpack_x_y_sample_weight(b) for b in batches],
                  loss_scale)


class Engine(replay_candidates.CandidateEngine):
    """`mpprof.replay.verification.Engine` on PyTorch: passes watched op by
    op (`replay_passes.run_pass`) and trials of the model's own
    `train_step`, run eagerly as Keras' PyTorch `fit` runs it.

    Args:
        model: the model, its captured weights loaded.
        batches: the captured batches, each (x, y, sample_weight).
        loss_scale: the run's loss scale at the capture (1.0: none).
    """

    def run_pass(self, candidate: verification.Candidate, batch: int,
                 loss_scale: float) -> search.PassResult:
        return self.eager_pass(run_pass, candidate, batch, loss_scale)

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
