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
from mpprof.backends.layer_records import called_method, walk_layers
from mpprof.backends.replay_candidates import layer_tree
from mpprof.backends.torch.custom_step import overrides_train_step
from mpprof.backends.torch.replay_passes import as_tensors, run_pass
from mpprof.backends.torch.step_state import host_array
from mpprof.replay import files, fixes, search, verification
from mpprof.replay.files import ReplayError


def replay(logdir_or_model, run: str | None = None, step: int | None = None, *,
           logdir: str | os.PathLike | None = None, save: bool = True) -> dict:
    """Replays a captured step; the arguments and result are those of
    `mpprof.backends.tensorflow.replay_engine.replay`."""
    return keras_capture.replay_entry(logdir_or_model, run, step, logdir, save,
                                      _replay_with_weights)


def _replay_with_weights(model, capture: files.Capture) -> dict:
    quantized = [name for name, layer, _ in walk_layers(model)
                 if called_method(layer) == "quantized_call"]
    if quantized:
        raise ReplayError(
            f"the model has quantized layers ({', '.join(quantized[:5])}): float8 "
            "replays are not supported; the float8 findings and the numerics cover them")
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
    reference = run_pass(model, batch, scale, None, all_float32=True)
    tree = layer_tree(model)
    divergence = search.divergence(run_policy, reference, tree)
    fix = fixes.find_fixes(
        verifier=verification.Verifier(Engine(model, [batch], scale)),
        run_unscaled=lambda float32_layers: run_pass(model, batch, 1.0, float32_layers),
        scale=scale, run_policy=run_policy, reference=reference, divergence=divergence,
        tree=tree, paths=capture.manifest.get("layer_paths", {}),
        inputs=keras.tree.flatten(batch[0]), backend="torch")
    offender = run_policy.offender
    notes = ([
        "the model has its own train_step: the replay runs Keras' step (its forward "
        "pass and model.compute_loss), not the model's own loss; the trials run the "
        "model's train_step"] if overrides_train_step(model) else [])
    return {
        "run": capture.run,
        "step": capture.step,
        "capture_reasons": capture.manifest.get("reasons", []),
        "loss_scale": scale,
        "first_op": offender.to_dict() if offender else None,
        "loss": {"run_policy": run_policy.loss, "float32": reference.loss},
        "float32_clean": reference.forward_clean and reference.gradients_finite,
        "divergence": divergence,
        **fix,
        "weights_are_the_steps": capture.manifest.get("weights_are_the_steps"),
        "replayed_eagerly": True,
        "replayed_as": ("model(x, training=True) and model.compute_loss, eagerly, every "
                        "aten op seen by a TorchDispatchMode"),
        **({"notes": notes} if notes else {}),
        "backend": "torch",
        "versions": capture.manifest.get("versions", {}),
    }


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
        with replay_candidates.repeatable_random_draws(self.tree):
            return run_pass(self.model,
                            replay_candidates.scale_inputs(self.batches[batch],
                                                           candidate.input_scale),
                            loss_scale, None, policies=self.policies(candidate),
                            model_policy=candidate.default_policy)

    def train(self, candidate: verification.Candidate, steps: int,
              loss_scale: float | None = None) -> list[float]:
        model = self.model
        optimizer = self.trial_optimizer(candidate, loss_scale)
        batches = [as_tensors(replay_candidates.scale_inputs(b, candidate.input_scale))
                   for b in self.batches]
        losses: list[float] = []
        with self.swapped_optimizer(optimizer), replay_candidates.policies_applied(
                model, self.tree, self.policies(candidate), candidate.default_policy), \
                replay_candidates.repeatable_random_draws(self.tree):
            optimizer.build(model.trainable_variables)
            calls = 0
            while len(losses) < steps and calls < steps + verification.TRIAL_MAX_SKIPS:
                for metric in model.metrics:
                    metric.reset_state()
                before = int(host_array(optimizer.iterations))
                # Eager, as Keras' PyTorch fit runs it (jit_compile=False).
                logs = model.train_step(batches[calls % len(batches)])
                calls += 1
                # A skipped step leaves `iterations` as it was.
                if int(host_array(optimizer.iterations)) != before:
                    losses.append(replay_candidates.trial_loss(logs))
        self.skipped_steps = calls - len(losses)
        return losses

