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

import tensorflow as tf

from mpprof.backends import keras_capture, replay_candidates
from mpprof.backends.tensorflow.replay_passes import run_pass
from mpprof.replay import files

# What `replay` raises, named where the engine is (as every engine names it).
from mpprof.replay.files import ReplayError  # noqa: F401 - re-exported


def _replay_with_weights(model, capture: files.Capture) -> dict:
    # Keras 3's float8 Dense fails under an eager GradientTape ("too many
    # values to unpack" in its custom gradient), so the backward pass cannot
    # run op by op.
    keras_capture.refuse_quantized(
        model, "their custom gradients do not run eagerly, so the step cannot be "
        "replayed op by op")
    keras_capture.load_weights(model, capture)
    return Engine.replay_result(
        model, capture, backend="tensorflow",
        unrunnable="; a model whose train_step computes its loss otherwise cannot be "
                   "replayed yet")


replay = keras_capture.replay_function(_replay_with_weights)


class Engine(replay_candidates.EagerEngine):
    """`mpprof.replay.verification.Engine` on TensorFlow: passes watched op by
    op (`replay_passes.run_pass`) and trials of the model's own `train_step`
    in a `tf.function`. (the arguments
    are `replay_candidates.CandidateEngine`'s).
    """

    pass_function = staticmethod(run_pass)

    def trial_step(self, optimizer):
        # A new function: traced with the trial's policies and optimizer.
        return replay_candidates.counted_trial_step(self.model, optimizer,
                                                    tf.function(self.model.train_step))


engine_for = Engine.for_batches
