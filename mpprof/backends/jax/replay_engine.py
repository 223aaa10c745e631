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
3. The greedy float32 set, as on TensorFlow.
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax.extend.core import DropVar, Literal

from mpprof.backends import keras_capture
from mpprof.backends.layer_records import called_method, walk_layers
from mpprof.recording.patching import Patches
from mpprof.replay import files, search
from mpprof.replay.files import ReplayError
from mpprof.replay.search import BETWEEN_LAYERS, LOSS, Offender, PassResult, subtree

# The scopes mpprof's layer wrappers open while the step is traced.
_LAYER_SCOPE = "mpprof_layer_"
_LAYER_SCOPE_RE = re.compile(r"mpprof_layer_(\d+)")
_MODEL_SCOPE = "mpprof_model"
# Call-like primitives whose inner equations are evaluated one by one; the
# parameter holding their (closed) jaxpr.
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
          "core_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
          "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
          "remat": "jaxpr", "checkpoint": "jaxpr"}


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
    _load_weights(model, capture)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(capture.batch())
    batch = (x, y, sample_weight)
    scale = float(capture.manifest.get("loss_scale") or 1.0)
    try:
        run_policy = run_pass(model, batch, scale, None)
    except Exception as e:
        raise ReplayError(
            f"the step could not be traced as model.stateless_call and "
            f"model.stateless_compute_loss ({type(e).__name__}: {str(e)[:300]}); a model "
            "whose train_step computes its loss otherwise cannot be replayed yet"
        ) from e
    reference = run_pass(model, batch, scale, None, all_float32=True)
    tree = layer_tree(model)
    divergence = search.divergence(run_policy, reference, tree)
    fix = search.find_fix(
        lambda float32_layers: run_pass(model, batch, 1.0, float32_layers), scale,
        run_policy, reference, divergence, tree, capture.manifest.get("layer_paths", {}))
    offender = run_policy.offender
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
        "replayed_as": "a jaxpr, equation by equation (jax.make_jaxpr)",
        "backend": "jax",
        "versions": capture.manifest.get("versions", {}),
    }


def _load_weights(model, capture: files.Capture) -> None:
    captured = capture.weights()
    variables = list(model.weights)
    paths = [getattr(v, "path", None) or v.name for v in variables]
    if set(paths) == set(captured):
        values = [captured[p] for p in paths]
    else:
        values = list(captured.values())
        if len(values) != len(variables) or any(
                tuple(v.shape) != a.shape for v, a in zip(variables, values, strict=True)):
            raise ReplayError(
                f"the model's {len(variables)} variables do not match the "
                f"{len(values)} captured at step {capture.step}: replay with the model "
                "that was trained"
            )
    for variable, value in zip(variables, values, strict=True):
        variable.assign(value)
    for _, layer, _ in walk_layers(model):
        if not isinstance(layer, keras.layers.BatchNormalization):
            continue
        for variable, initializer in ((layer.moving_mean, layer.moving_mean_initializer),
                                      (layer.moving_variance,
                                       layer.moving_variance_initializer)):
            if not np.all(np.isfinite(np.asarray(variable.value))):
                variable.assign(initializer(variable.shape, variable.dtype))


def layer_tree(model) -> dict[str, object]:
    """Qualified name -> layer, for every nested layer."""
    return {name: layer for name, layer, _ in walk_layers(model)}


def _policy_of(layer) -> tuple:
    """What setting `layer.dtype_policy` changes (a `DTypePolicyMap` keeps
    the map: its entry for the layer's path is what is put back)."""
    policy = layer.dtype_policy
    path = getattr(layer, "path", None)
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap) and path:
        return policy, path in policy, policy[path] if path in policy else None
    return policy, None, None


def _restore_policy(layer, saved: tuple) -> None:
    policy, had_entry, entry = saved
    path = getattr(layer, "path", None)
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap) and path:
        if path in policy:
            del policy[path]
        if had_entry:
            policy[path] = entry
        return
    layer.dtype_policy = policy


def run_pass(model, batch, loss_scale: float, float32_layers, *,
             all_float32: bool = False) -> PassResult:
    """Traces the step with these policies and evaluates it equation by
    equation (the arguments are `mpprof.backends.tensorflow.replay_passes.run_pass`'s).
    Nothing of the model changes: the pass is stateless, and the policies
    it sets are put back."""
    tree = layer_tree(model)
    chosen = set(tree) if all_float32 else {
        n for name in (float32_layers or ()) for n in subtree(tree, name)
    }
    policies = {name: _policy_of(tree[name]) for name in chosen}
    model_policy = _policy_of(model)
    try:
        for name in chosen:
            tree[name].dtype_policy = "float32"
        if all_float32:
            model.dtype_policy = "float32"
        return _Pass(model, tree).run(batch, loss_scale)
    finally:
        for name, policy in policies.items():
            _restore_policy(tree[name], policy)
        _restore_policy(model, model_policy)


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
            with jax.named_scope(_MODEL_SCOPE):
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
        values, offenders = _Evaluator(self._names).run(
            closed, jax.tree_util.tree_leaves((trainable, probes)))
        loss, outputs, gradients, probe_gradients = jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(shape), values)
        forward = {key: np.asarray(o).astype(np.float64) for key, o in zip(keys, outputs,
                                                                             strict=True)}
        backward = {key: np.asarray(g).astype(np.float64)
                    for key, g in zip(keys, probe_gradients, strict=True)}
        finite = all(bool(np.all(np.isfinite(np.asarray(g)))) for g in gradients)
        return PassResult(
            forward=forward, backward=backward,
            offender=offenders.get("forward") or offenders.get("backward"),
            forward_clean="forward" not in offenders,
            loss=float(np.sum(np.asarray(loss, np.float64))), gradients_finite=finite)

    def _tree_layers(self) -> list:
        return [layer for _, layer, _ in walk_layers(self._model)]

    def _wrap(self, row: int, call):
        name = self._names[row]

        def scoped_call(*args, **kwargs):
            with jax.named_scope(f"{_LAYER_SCOPE}{row}"):
                outputs = call(*args, **kwargs)
            return self._tap(name, outputs)

        return scoped_call

    def _tap(self, name: str, outputs):
        """Keeps the layer's first floating output and adds its probe (whose
        gradient is the gradient flowing into the output)."""
        flat, structure = jax.tree_util.tree_flatten(outputs)
        position = next((i for i, t in enumerate(flat) if hasattr(t, "dtype")
                         and jnp.issubdtype(t.dtype, jnp.floating)), None)
        if position is None:
            return outputs
        index = self._calls.get(name, 0)
        self._calls[name] = index + 1
        output = flat[position]
        slot = len(self._outputs)
        self._keys.append((name, index))
        self._outputs.append(jax.lax.stop_gradient(output))
        if self._probes is not None:
            flat[position] = output + self._probes[slot]
        return jax.tree_util.tree_unflatten(structure, flat)


def _inside_recurrent(tree: dict[str, object]) -> set[str]:
    """Layers called inside a recurrent layer's `lax.scan`: their values
    cannot leave it, so they are not tapped."""
    recurrent = [name for name, layer in tree.items()
                 if any(cls.__name__ == "RNN" for cls in type(layer).__mro__)]
    return {name for name in tree for r in recurrent if name.startswith(r + "/")}


class _Evaluator:
    """Evaluates a closed jaxpr equation by equation, finding the first
    forward and the first backward equation with a bad floating output."""

    def __init__(self, names: list[str]):
        self._names = names
        self.offenders: dict[str, Offender] = {}
        self._cast_pending = False

    def run(self, closed, arguments: list) -> tuple[list, dict[str, Offender]]:
        outputs = self._eval(closed.jaxpr, closed.consts, arguments, "")
        return outputs, self.offenders

    def _eval(self, jaxpr, consts, arguments, prefix: str) -> list:
        env = {}

        def read(var):
            return var.val if isinstance(var, Literal) else env[var]

        for var, value in zip(jaxpr.constvars, consts, strict=True):
            env[var] = value
        for var, value in zip(jaxpr.invars, arguments, strict=True):
            env[var] = value
        for eqn in jaxpr.eqns:
            inputs = [read(v) for v in eqn.invars]
            stack = f"{prefix}/{eqn.source_info.name_stack}".strip("/")
            inner = _CALLS.get(eqn.primitive.name)
            sub = eqn.params.get(inner) if inner else None
            if sub is not None and (hasattr(sub, "eqns") or hasattr(sub, "consts")):
                jaxpr_of = getattr(sub, "jaxpr", sub)
                sub_consts = getattr(sub, "consts", [])
                outputs = self._eval(jaxpr_of, sub_consts, inputs, stack)
            else:
                outputs = _bind(eqn, inputs)
                if not eqn.primitive.multiple_results:
                    outputs = [outputs]
                self._check(eqn, stack, inputs, outputs)
            for var, value in zip(eqn.outvars, outputs, strict=True):
                if not isinstance(var, DropVar):
                    env[var] = value
        return [read(v) for v in jaxpr.outvars]

    def _layer(self, stack: str) -> str | None:
        rows = _LAYER_SCOPE_RE.findall(stack)
        return self._names[int(rows[-1])] if rows else None

    def _check(self, eqn, stack: str, inputs, outputs) -> None:
        phase = "backward" if "transpose(" in stack else "forward"
        layer = self._layer(stack)
        if self._cast_pending and phase == "forward":
            # An offending cast outside any layer, just before a layer's
            # call: that layer's input cast (`Layer.__call__`).
            self._cast_pending = False
            if layer is not None:
                self.offenders["forward"].layer = layer
        if phase in self.offenders:
            return
        for output in outputs:
            if not _is_float(output):
                continue
            values = np.asarray(output)
            problem = search.problem(values, np.dtype(output.dtype).name)
            if problem is None:
                continue
            where = layer or (BETWEEN_LAYERS if _MODEL_SCOPE in stack else LOSS)
            self.offenders[phase] = Offender(
                layer=where, op=eqn.primitive.name, phase=phase,
                input_abs_max=[search.abs_max(np.asarray(t)) for t in inputs if _is_float(t)],
                output=problem, dtype=np.dtype(output.dtype).name)
            self._cast_pending = (phase == "forward" and layer is None
                                  and eqn.primitive.name == "convert_element_type")
            return


def _bind(eqn, inputs):
    """Runs one equation whole (as `jax.core.eval_jaxpr` does)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(params, tuple):  # (subfuns, params) before JAX 0.7
        subfuns, params = params
        return eqn.primitive.bind(*subfuns, *inputs, **params)
    return eqn.primitive.bind(*inputs, **params)


def _is_float(value) -> bool:
    dtype = getattr(value, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def policy_map_object(result: dict, default_policy: str):
    """The result's fix as a `keras.dtype_policies.DTypePolicyMap`."""
    policy_map = keras.dtype_policies.DTypePolicyMap(default_policy=default_policy)
    for path, policy in result["policy_map"].items():
        policy_map[path] = policy
    return policy_map
