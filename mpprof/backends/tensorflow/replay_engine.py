"""Replays a captured step: the first offending op, float16 against float32
per layer, and the smallest per-layer float32 fix, verified.

1. The step runs eagerly with the run's policies (`passes.run_pass`): the
   first TensorFlow op whose output is non-finite or beyond its dtype's max,
   and the layer it ran in.
2. It runs again with every layer in float32: per layer, the relative error
   of the run's output and of the gradient flowing into it against float32's
   (the L2 norm of the difference over float32's), ranked.
3. Layers go to float32 greedily (the first offender's layer first, then by
   that ranking) until a replay with them in float32 has no offending forward
   op, a finite loss and finite gradients; layers the fix does not need are
   then dropped again. Where a model input holds values past float16's max,
   bounding the inputs is the lead fix instead (`mpprof.replay.fixes`).
4. Each fix is verified (`mpprof.replay.verification`): within stated
   tolerances of float32 on the step, and a short trial of optimizer steps
   that must train like float32 (`Engine` runs both here).
"""

from __future__ import annotations

import os

import keras
import tensorflow as tf

from mpprof.backends import keras_capture, replay_candidates
from mpprof.backends.tensorflow.replay_passes import run_pass
from mpprof.replay import files, search, verification
from mpprof.replay.files import ReplayError


def replay(logdir_or_model, run: str | None = None, step: int | None = None, *,
           logdir: str | os.PathLike | None = None, save: bool = True) -> dict:
    """Replays a captured step; see the module docstring.

    Args:
        logdir_or_model: the LOG_DIR the profiler wrote (the model is rebuilt
            from the capture's config), or the model object itself (needed
            for subclassed models without a config; its weights are set to
            the capture's for the replay and put back after), with `logdir`.
        run: the run (default "train").
        step: the captured step (default: the first captured).
        logdir: the LOG_DIR, when `logdir_or_model` is a model.
        save: write the result beside the capture (`replay.json`).

    Returns:
        The result, strict JSON (infinities as "inf"): `run, step,
        first_op{layer, op, input_abs_max, output},
        divergence[{layer, forward_rel_error, backward_rel_error}],
        policy_map, dtype_lines, verified, verified_detail`, and more.

    Raises:
        mpprof.replay.files.NoCaptureError: no such capture.
        ReplayError: the capture cannot be replayed.
    """
    return keras_capture.replay_entry(logdir_or_model, run, step, logdir, save,
                                      _replay_with_weights)


def _replay_with_weights(model, capture: files.Capture) -> dict:
    # Keras 3's float8 Dense fails under an eager GradientTape ("too many
    # values to unpack" in its custom gradient), so the backward pass cannot
    # run op by op.
    keras_capture.refuse_quantized(
        model, "their custom gradients do not run eagerly, so the step cannot be "
        "replayed op by op")
    keras_capture.load_weights(model, capture)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(capture.batch())
    batch = (x, y, sample_weight)
    scale = float(capture.manifest.get("loss_scale") or 1.0)
    try:
        run_policy = run_pass(model, batch, scale, None)
    except Exception as e:
        raise ReplayError(
            f"the step could not be run eagerly as model(x, training=True) and "
            f"model.compute_loss ({type(e).__name__}: {str(e)[:300]}); a model whose "
            "train_step computes its loss otherwise cannot be replayed yet"
        ) from e
    return keras_capture.replay_result(
        model, capture, scale=scale, run_policy=run_policy,
        reference=run_pass(model, batch, scale, None, all_float32=True),
        engine=Engine(model, [batch], scale),
        run_unscaled=lambda float32_layers: run_pass(model, batch, 1.0, float32_layers),
        inputs=keras.tree.flatten(x), backend="tensorflow")


def engine_for(model, batches: list, loss_scale: float = 1.0) -> Engine:
    """A verification engine (`mpprof.replay.verification.Engine`) of `model`
    as it is now (its weights are the ones every pass and trial start from)
    on `batches` (each as `train_step` receives it: (x, y) or (x, y,
    sample_weight))."""
    return Engine(model, [keras.utils.unpack_x_y_sample_weight(b) for b in batches],
                  loss_scale)


class Engine(replay_candidates.CandidateEngine):
    """`mpprof.replay.verification.Engine` on TensorFlow: passes watched op by
    op (`replay_passes.run_pass`) and trials of the model's own `train_step`
    in a `tf.function`.

    Args:
        model: the model, its captured weights loaded.
        batches: the captured batches, each (x, y, sample_weight).
        loss_scale: the run's loss scale at the capture (1.0: none).
    """

    def run_pass(self, candidate: verification.Candidate, batch: int,
                 loss_scale: float) -> search.PassResult:
        return self.eager_pass(run_pass, candidate, batch, loss_scale)

    def trial_step(self, optimizer):
        # A new function: traced with the trial's policies and optimizer.
        return replay_candidates.counted_trial_step(self.model, optimizer,
                                                    tf.function(self.model.train_step))
