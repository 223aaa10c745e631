"""A replay pass of a model whose `train_step(self, state, data)` is its own, on JAX.

Keras' own step is replayed as `stateless_call` plus `stateless_compute_loss`
(`mpprof.backends.jax.replay_engine`); a custom step computes its loss, its
gradients and its updates itself (a GAN: two losses, two optimizers), so
that would replay another step. Here the jaxpr is the model's own
`train_step(state, data)`, traced whole (forward, `jax.value_and_grad`'s
backward, the optimizers' `stateless_apply`, the metrics) with:

- each layer's call in a `mpprof_layer_<row>` scope, its first floating
  output sent to the host by `jax.debug.callback` and, through an identity
  with a custom VJP, the gradient flowing into it (the evaluator runs each
  callback as it reaches its equation);
- each optimizer's `stateless_apply` in the `mpprof_optimizer` scope (its
  handling of non-finite gradients is never the culprit), sending the
  gradients it is handed, unscaled by the loss scale it holds;
- each loss metric (`"loss"`, `"..._loss"`, as the numerics find a custom
  step's loss) sending the values it is given: the step's loss.

The state is the one Keras' JAX `fit` hands the step: the captured weights
(trainable, then non-trainable: a GAN's optimizer state tracked by the model
included), `model.optimizer`'s variables with its loss scale set to the
captured one (its other slots are not captured: they are the model's
current ones), and zeroed metric variables (a reset metric).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import keras
import numpy as np

from mpprof.backends.jax.backend import JaxBackend
from mpprof.backends.jax.jaxpr_eval import (
    MODEL_SCOPE,
    OPTIMIZER_SCOPE,
    Evaluator,
    scoped_layer_call,
)
from mpprof.backends.layer_records import called_method
from mpprof.backends.loss_metrics import loss_metrics
from mpprof.backends.patching import Patches
from mpprof.replay.search import PassResult


def loss_scale_optimizers(model) -> list:
    """The LossScaleOptimizers the step may use (`model.optimizer` and those
    held in the model's attributes)."""
    return [optimizer for _, optimizer in JaxBackend(model).candidate_optimizers(model)
            if isinstance(optimizer, keras.optimizers.LossScaleOptimizer)]


def step_state(model, optimizer_scale: float | None, loss_scale: float | None) -> tuple:
    """The state Keras' JAX `fit` passes `train_step`, from the model's
    variables (the captured weights).

    Args:
        optimizer_scale: the captured loss scale of `model.optimizer` (whose
            variables are not captured), or None.
        loss_scale: every LossScaleOptimizer's scale for this pass (None:
            as captured).
    """
    optimizer = model.optimizer
    state = ([v.value for v in model.trainable_variables],
             [v.value for v in model.non_trainable_variables],
             [v.value for v in optimizer.variables] if optimizer is not None else [],
             [jnp.zeros_like(v.value) for v in model.metrics_variables])
    slots = {id(v): (1, i) for i, v in enumerate(model.non_trainable_variables)}
    if optimizer is not None:
        slots.update({id(v): (2, i) for i, v in enumerate(optimizer.variables)})
    for scaled in loss_scale_optimizers(model):
        value = loss_scale
        if value is None and scaled is optimizer:
            value = optimizer_scale
        where = slots.get(id(scaled.dynamic_scale))
        if value is not None and where is not None:
            state[where[0]][where[1]] = jnp.asarray(value, scaled.dynamic_scale.dtype)
    return state


def largest_scale(model, optimizer_scale: float | None) -> float:
    """The largest loss scale the captured step ran with (1: none)."""
    state = step_state(model, optimizer_scale, None)
    slots = {id(v): value for v, value in zip(model.non_trainable_variables, state[1],
                                              strict=True)}
    if model.optimizer is not None:
        slots.update({id(v): value for v, value in zip(model.optimizer.variables, state[2],
                                                       strict=True)})
    scales = [float(np.asarray(slots[id(o.dynamic_scale)]))
              for o in loss_scale_optimizers(model) if id(o.dynamic_scale) in slots]
    return max(scales, default=1.0)


class StepPass:
    """One trace of the model's own `train_step` and its evaluation.

    Args:
        model: the model, its captured weights loaded.
        tree: qualified name -> layer (`replay_engine.layer_tree`).
        skip: layers not tapped (inside a recurrent layer's loop).
        optimizer_scale: the captured loss scale of `model.optimizer`.
    """

    def __init__(self, model, tree: dict[str, object], skip: set[str],
                 optimizer_scale: float | None):
        self._model = model
        self._tree = tree
        self._names = list(tree)
        self._skip = skip
        self._optimizer_scale = optimizer_scale
        self._calls: dict[str, int] = {}
        self._seen: dict[str, dict] = {}
        self.loss_watched = False
        self.optimizers_applied = False

    def run(self, data, loss_scale: float | None) -> PassResult:
        """Evaluates the step on `data` (the captured batch) with every loss
        scale at `loss_scale` (None: as captured)."""
        model = self._model
        state = step_state(model, self._optimizer_scale, loss_scale)
        self._seen = {"forward": {}, "backward": {}, "gradients": [], "loss": []}
        self._calls = {}
        patches = Patches()
        try:
            self._patch(patches)
            closed = jax.make_jaxpr(model.train_step)(state, data)
        finally:
            patches.restore()
        _, offenders = Evaluator(self._names).run(
            closed, jax.tree_util.tree_leaves((state, data)))
        jax.effects_barrier()  # callbacks of control flow run whole
        seen = self._seen
        self.loss_watched = bool(seen["loss"])
        self.optimizers_applied = bool(seen["gradients"])
        # No loss metric: the loss is unknown (the result says so), not bad.
        loss = float(sum(np.sum(v) for v in seen["loss"])) if seen["loss"] else 0.0
        return PassResult(
            forward=seen["forward"], backward=seen["backward"],
            offender=offenders.get("forward") or offenders.get("backward"),
            forward_clean="forward" not in offenders, loss=loss,
            gradients_finite=all(bool(np.all(np.isfinite(g))) for g in seen["gradients"]),
            # In the order the step hands them to its optimizers, unscaled.
            gradients={f"gradient {i}": g for i, g in enumerate(seen["gradients"])},
            gradient_scale=1.0)

    def _patch(self, patches: Patches) -> None:
        model = self._model
        for row, (name, layer) in enumerate(self._tree.items()):
            if name not in self._skip:
                method = called_method(layer)
                patches.set(layer, method, self._layer_call(row, getattr(layer, method)))
        method = called_method(model)
        patches.set(model, method, _scoped(MODEL_SCOPE, getattr(model, method)))
        for optimizer in {id(o): o for _, o in JaxBackend(model).candidate_optimizers(
                model)}.values():
            patches.set(optimizer, "stateless_apply",
                        self._optimizer_apply(optimizer, optimizer.stateless_apply))
        for metric in loss_metrics(model):
            patches.set(metric, "update_state", self._loss_update(metric.update_state))

    def _record(self, kind: str, key, value) -> None:
        # The first value: a loop run again to name its equation sends twice.
        self._seen[kind].setdefault(key, np.asarray(value).astype(np.float64))

    def _append(self, kind: str, value) -> None:
        self._seen[kind].append(np.asarray(value).astype(np.float64))

    def _layer_call(self, row: int, call):
        name = self._names[row]

        def tap(output):
            index = self._calls.get(name, 0)
            self._calls[name] = index + 1
            key = (name, index)
            jax.debug.callback(functools.partial(self._record, "forward", key),
                               jax.lax.stop_gradient(output))
            return _gradient_tap(output, (self, key))

        return scoped_layer_call(row, call, tap)

    def _optimizer_apply(self, optimizer, apply):
        scale_slot = None
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            scale_slot = [id(v) for v in optimizer.variables].index(
                id(optimizer.dynamic_scale))

        def stateless_apply(optimizer_variables, grads, trainable_variables):
            with jax.named_scope(OPTIMIZER_SCOPE):
                # Unscaled, as a LossScaleOptimizer hands them on (its scale
                # is in its variables); a plain optimizer's as the step made
                # them. In the optimizer's scope: never judged.
                scale = (1.0 if scale_slot is None
                         else jnp.asarray(optimizer_variables[scale_slot], jnp.float32))
                for gradient in grads:
                    if gradient is not None:
                        jax.debug.callback(functools.partial(self._append, "gradients"),
                                           jnp.asarray(gradient, jnp.float32) / scale)
                return apply(optimizer_variables, grads, trainable_variables)

        return stateless_apply

    def _loss_update(self, update_state):
        def watched(values, *args, **kwargs):
            jax.debug.callback(functools.partial(self._append, "loss"),
                               jax.lax.stop_gradient(values))
            return update_state(values, *args, **kwargs)

        return watched


def _scoped(scope: str, call):
    def scoped_call(*args, **kwargs):
        with jax.named_scope(scope):
            return call(*args, **kwargs)

    return scoped_call


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gradient_tap(x, where):
    return x


def _gradient_tap_fwd(x, where):
    return x, None


def _gradient_tap_bwd(where, _, gradient):
    replay_pass, key = where
    jax.debug.callback(functools.partial(replay_pass._record, "backward", key), gradient)
    return (gradient,)


_gradient_tap.defvjp(_gradient_tap_fwd, _gradient_tap_bwd)
