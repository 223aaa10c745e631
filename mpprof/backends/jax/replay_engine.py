"""Replays a captured step on JAX: the first offending equation, float16
against float32 per layer, and the smallest per-layer float32 fix, verified.

The same three steps and result as on TensorFlow
(`mpprof.backends.tensorflow.replay_engine`; the search is
`mpprof.replay.search`), with JAX's own way of looking at every op:

1. The step's forward pass, loss and backward pass are traced as one jaxpr
   (`jax.make_jaxpr` of `jax.value_and_grad` of a stateless function of the
   trainable variables), and the jaxpr is evaluated equation by equation on
   the captured batch and weights. Call-like equations (`jit`, custom JVP/VJP
   calls, remat) are entered and their equations evaluated one by one;
   control flow (`cond`, `while`, `scan`) runs whole and is judged by its
   outputs. The first equation whose floating output is non-finite or beyond
   its dtype's maximum is the offender; its layer is the innermost layer
   scope in the equation's name stack (each layer's `call` runs under a
   `jax.named_scope` of mpprof's while the step is traced); a transposed
   (`transpose(...)`) equation is part of the backward pass.
2. Per layer, its output and the gradient flowing into it (the gradient of
   a zero "probe" added to the output) against the float32 replay's.
3. The greedy float32 set (or bounded inputs, where an input is past
   float16's range), as on TensorFlow, each fix verified
   (`mpprof.replay.verification`) through `Engine`: passes as in 1, and
   trials of the model's own jitted `train_step`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras
import numpy as np

from mpprof.backends import keras_capture, replay_candidates
from mpprof.backends.jax import replay_step
from mpprof.backends.jax.custom_step import overrides_train_step
from mpprof.backends.jax.jaxpr_eval import MODEL_SCOPE, Evaluator, scoped_layer_call
from mpprof.backends.layer_records import called_method, variable_path, walk_layers
from mpprof.backends.patching import Patches
from mpprof.backends.replay_candidates import layer_tree, policies_applied
from mpprof.replay import files, verification
from mpprof.replay.files import ReplayError
from mpprof.replay.search import PassResult, subtree


def _replay_with_weights(model, capture: files.Capture) -> dict:
    keras_capture.captured_model(model, capture)
    captured_scale = float(capture.manifest.get("loss_scale") or 1.0)
    step = _step_for(model, capture.batch(), captured_scale)
    try:
        run_policy = step.run(None, None)
    except Exception as e:
        raise ReplayError(f"the step could not be traced as {step.what} for the replay "
                          f"({type(e).__name__}: {str(e)[:300]})") from e
    notes = step.notes() + keras_capture.shard_notes(capture.manifest)
    data = capture.batch()
    return keras_capture.replay_result(
        model, capture, scale=step.scale, run_policy=run_policy,
        reference=step.run(None, None, all_float32=True),
        engine=Engine(model, step, [data], step.scale),
        run_unscaled=lambda float32_layers: step.run(1.0, float32_layers),
        inputs=keras.tree.flatten(keras.utils.unpack_x_y_sample_weight(data)[0]),
        backend="jax",
        replayed_as=f"{step.what}: a jaxpr, equation by equation (jax.make_jaxpr)",
        **({"notes": notes} if notes else {}))


replay = keras_capture.replay_function(_replay_with_weights)


def _step_for(model, data, scale: float):
    return (_CustomStep if overrides_train_step(model) else _KerasStep)(model, data, scale)


def engine_for(model, batches: list, loss_scale: float = 1.0) -> Engine:
    """A verification engine (`mpprof.replay.verification.Engine`) of `model`
    as it is now (its weights are the ones every pass and trial start from)
    on `batches` (each as `train_step` receives it: (x, y) or (x, y,
    sample_weight), or a custom step's own structure)."""
    step = _step_for(model, batches[0], loss_scale)
    return Engine(model, step, list(batches), step.scale)


class _KerasStep:
    """Keras' own step, replayed as `stateless_call` and
    `stateless_compute_loss`: `run(loss_scale, float32_layers, all_float32=)`
    runs one pass (`loss_scale` None: the captured one)."""

    what = "model.stateless_call and model.stateless_compute_loss"

    def __init__(self, model, data, scale: float):
        self._model = model
        self._data = data
        self.scale = scale

    def run(self, loss_scale, float32_layers, *, all_float32=False, data=None,
            **policies) -> PassResult:
        """`data`: a batch other than the captured one (inputs scaled);
        `policies`: `run_pass`'s `policies` and `model_policy`."""
        batch = keras.utils.unpack_x_y_sample_weight(self._data if data is None else data)
        return run_pass(self._model, batch,
                        self.scale if loss_scale is None else loss_scale,
                        float32_layers, all_float32=all_float32, **policies)

    def notes(self) -> list[str]:
        return []


class _CustomStep:
    """The model's own `train_step` (`mpprof.backends.jax.replay_step`), run
    as `_KerasStep`; its notes say what the replay could not check."""

    what = "the model's own train_step"

    def __init__(self, model, data, optimizer_scale: float):
        self._model = model
        self._data = data
        self._optimizer_scale = optimizer_scale
        self._skip = _inside_recurrent(layer_tree(model))
        self._last: replay_step.StepPass | None = None
        self.scale = replay_step.largest_scale(model, optimizer_scale)

    def _make(self, model, tree) -> replay_step.StepPass:
        self._last = replay_step.StepPass(model, tree, self._skip, self._optimizer_scale)
        return self._last

    def run(self, loss_scale, float32_layers, *, all_float32=False, data=None,
            **policies) -> PassResult:
        return run_pass(self._model, self._data if data is None else data, loss_scale,
                        float32_layers, all_float32=all_float32, step=self._make, **policies)

    def notes(self) -> list[str]:
        notes = []
        if self._last is not None and not self._last.loss_watched:
            notes.append(
                "the step updates no loss metric (named 'loss' or '..._loss'): the replay "
                "does not know its loss; the fix is judged by the forward and backward "
                "passes and the gradients alone")
        if self._last is not None and not self._last.optimizers_applied:
            notes.append(
                "the step hands no gradients to an optimizer's stateless_apply: the "
                "replay judges the forward and backward passes alone")
        return notes


class Engine(replay_candidates.CandidateEngine):
    """`mpprof.replay.verification.Engine` on JAX: passes evaluated equation
    by equation (`step.run`, Keras' own step or the model's) and trials of
    the model's own `train_step(state, data)`, jitted, the state threaded
    from step to step as Keras' JAX `fit` does.

    Args:
        model: the model, its captured weights loaded.
        step: the replayed step (`_KerasStep` or `_CustomStep`).
        batches: the captured batches, as the step receives them.
        loss_scale: the run's loss scale at the capture (1.0: none).
    """

    def __init__(self, model, step, batches: list, loss_scale: float):
        super().__init__(model, batches, loss_scale)
        self._step = step
        self.uses_own_optimizers = isinstance(step, _CustomStep)

    def run_pass(self, candidate: verification.Candidate, batch: int,
                 loss_scale: float) -> PassResult:
        with replay_candidates.repeatable_random_draws(self.tree):
            return self._step.run(
                loss_scale, None, data=self.pass_data(candidate, batch),
                policies=self.policies(candidate), model_policy=candidate.default_policy)

    def trial_step(self, optimizer):
        model = self.model
        train_step = jax.jit(model.train_step)
        fresh_metrics = [jnp.zeros_like(v.value) for v in model.metrics_variables]
        state = ([v.value for v in model.trainable_variables],
                 [v.value for v in model.non_trainable_variables],
                 [v.value for v in optimizer.variables] if optimizer is not None else [],
                 fresh_metrics)
        # A skipped step leaves the optimizer's `iterations` as it was; a
        # custom step, which may use optimizers of its own (a GAN's, beside
        # an unused model.optimizer), shows it by leaving the trainable
        # weights as they were.
        counter = (None if optimizer is None or self.uses_own_optimizers else
                   [id(v) for v in optimizer.variables].index(id(optimizer.iterations)))

        def step(batch) -> float | None:
            nonlocal state
            before = state[0] if counter is None else int(state[2][counter])
            logs, state = train_step(state, batch)
            if counter is None:
                applied = any(not bool(jnp.array_equal(old, new))
                              for old, new in zip(before, state[0], strict=True))
            else:
                applied = int(state[2][counter]) != before
            # Metrics reset: the next logs hold that step's loss alone.
            state = (*state[:3], fresh_metrics)
            return replay_candidates.trial_loss(logs) if applied else None

        return step


def run_pass(model, batch, loss_scale: float | None, float32_layers, *,
             all_float32: bool = False, policies=None, model_policy: str | None = None,
             step=None) -> PassResult:
    """Traces the step with these policies and evaluates it equation by
    equation (the arguments are `mpprof.backends.tensorflow.replay_passes.run_pass`'s;
    `step(model, tree)` makes the pass, Keras' own step's by default).
    Nothing of the model changes: the pass is stateless, and the policies
    it sets are put back."""
    tree = layer_tree(model)
    wanted = {n: "float32" for name in (float32_layers or ()) for n in subtree(tree, name)}
    wanted.update(policies or {})
    if all_float32:
        wanted, model_policy = dict.fromkeys(tree, "float32"), "float32"
    with policies_applied(model, tree, wanted, model_policy):
        return (step or _Pass)(model, tree).run(batch, loss_scale)


class _Pass:
    """One trace of the step and its evaluation."""

    def __init__(self, model, tree: dict[str, object]):
        self._model = model
        self._names = list(tree)
        self._rows = {id(layer): row for row, layer in enumerate(tree.values())}
        self._skip = _inside_recurrent(tree)
        self._calls: dict[str, int] = {}
        self._probes = None
        self._keys: list = []
        self._outputs: list = []

    def run(self, batch, loss_scale: float) -> PassResult:
        model = self._model
        x, y, sample_weight = batch
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        metrics = [v.value for v in model.metrics_variables]

        def loss_function(trainable, probes):
            self._calls, self._probes, self._keys, self._outputs = {}, probes, [], []
            with jax.named_scope(MODEL_SCOPE):
                y_pred, new_non_trainable = model.stateless_call(
                    trainable, non_trainable, x, training=True)
            loss, _ = model.stateless_compute_loss(
                trainable, new_non_trainable, metrics, x=x, y=y, y_pred=y_pred,
                sample_weight=sample_weight, training=True)
            outputs, self._probes = self._outputs, None
            scaled = jnp.asarray(loss, jnp.float32) * loss_scale
            return scaled, (loss, outputs)

        def step(trainable, probes):
            (_, (loss, outputs)), (gradients, probe_gradients) = jax.value_and_grad(
                loss_function, argnums=(0, 1), has_aux=True)(trainable, probes)
            return loss, outputs, gradients, probe_gradients

        patches = Patches()
        try:
            for row, (name, layer) in enumerate(zip(self._names, self._tree_layers(),
                                                    strict=True)):
                if name not in self._skip:
                    patches.set(layer, called_method(layer),
                                self._wrap(row, getattr(layer, called_method(layer))))
            # The probes' shapes: each tapped output's, from a first trace.
            shapes = jax.eval_shape(lambda t: loss_function(t, None)[1][1], trainable)
            probes = [jnp.zeros(s.shape, s.dtype) for s in shapes]
            keys_by_trace = []

            def traced(trainable, probes):
                result = step(trainable, probes)
                keys_by_trace.append(list(self._keys))
                return result

            closed, shape = jax.make_jaxpr(traced, return_shape=True)(trainable, probes)
        finally:
            patches.restore()
        keys = keys_by_trace[-1]
        values, offenders = Evaluator(self._names).run(
            closed, jax.tree_util.tree_leaves((trainable, probes)))
        loss, outputs, gradients, probe_gradients = jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(shape), values)
        forward = {key: np.asarray(o).astype(np.float64) for key, o in zip(keys, outputs,
                                                                             strict=True)}
        backward = {key: np.asarray(g).astype(np.float64)
                    for key, g in zip(keys, probe_gradients, strict=True)}
        by_path = {variable_path(v): np.asarray(g)
                   for v, g in zip(model.trainable_variables, gradients, strict=True)}
        finite = all(bool(np.all(np.isfinite(g))) for g in by_path.values())
        return PassResult(
            forward=forward, backward=backward,
            offender=offenders.get("forward") or offenders.get("backward"),
            forward_clean="forward" not in offenders,
            loss=float(np.sum(np.asarray(loss, np.float64))), gradients_finite=finite,
            gradients=by_path)

    def _tree_layers(self) -> list:
        return [layer for _, layer, _ in walk_layers(self._model)]

    def _wrap(self, row: int, call):
        name = self._names[row]

        def tap(output):
            """Keeps the layer's output and adds its probe (whose gradient
            is the gradient flowing into the output)."""
            index = self._calls.get(name, 0)
            self._calls[name] = index + 1
            slot = len(self._outputs)
            self._keys.append((name, index))
            self._outputs.append(jax.lax.stop_gradient(output))
            return output if self._probes is None else output + self._probes[slot]

        return scoped_layer_call(row, call, tap)


def _inside_recurrent(tree: dict[str, object]) -> set[str]:
    """Layers called inside a recurrent layer's `lax.scan`: their values
    cannot leave it, so they are not tapped."""
    recurrent = [name for name, layer in tree.items()
                 if any(cls.__name__ == "RNN" for cls in type(layer).__mro__)]
    return {name for name in tree for r in recurrent if name.startswith(r + "/")}
