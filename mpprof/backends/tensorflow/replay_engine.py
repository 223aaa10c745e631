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
   then dropped again. The last replay is the verification.
"""

from __future__ import annotations

import math
import os

import keras
import numpy as np

from mpprof import dtypes
from mpprof.backends.tensorflow.layer_calls import called_method, walk_layers
from mpprof.backends.tensorflow.replay_passes import LOSS, PassResult, layer_tree, run_pass, subtree
from mpprof.jsonsafe import json_safe
from mpprof.records import schema
from mpprof.replay import files
from mpprof.replay.files import ReplayError

# Replays a fix search may run at most (each is one forward and backward).
MAX_FIX_REPLAYS = 24


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
    model = None
    if isinstance(logdir_or_model, keras.Model):
        model = logdir_or_model
        if logdir is None:
            raise ReplayError("replay(model, ...) needs logdir=: where the capture is")
    else:
        logdir = logdir_or_model
    capture = files.select_capture(logdir, run or schema.TRAIN_RUN, step)
    if model is None:
        model = _rebuild(capture)
        result = _replay_with_weights(model, capture)
    else:
        saved = [np.array(v.numpy()) for v in model.weights]
        try:
            result = _replay_with_weights(model, capture)
        finally:
            for variable, value in zip(model.weights, saved, strict=True):
                variable.assign(value)
    result = json_safe(result)
    if save:
        files.write_result(capture, result)
    return result


def _rebuild(capture: files.Capture):
    config = capture.model_config()
    if config is None:
        raise ReplayError(
            f"the capture of step {capture.step} holds no model config "
            f"({capture.manifest.get('model_config', {}).get('note')}); replay it in "
            "the process that has the model: mpprof.replay.replay(model, logdir=...)"
        )
    try:
        model = keras.saving.deserialize_keras_object(config)
        # The model's own policy (its input cast) is not in every config.
        model.dtype_policy = capture.manifest.get("model_policy") or model.dtype_policy
        return model
    except Exception as e:
        raise ReplayError(
            f"the model of step {capture.step} cannot be rebuilt from its config "
            f"({type(e).__name__}: {e}); import the module defining its custom layers "
            "first, or replay in-process: mpprof.replay.replay(model, logdir=...)"
        ) from e


def _replay_with_weights(model, capture: files.Capture) -> dict:
    quantized = [name for name, layer, _ in walk_layers(model)
                 if called_method(layer) == "quantized_call"]
    if quantized:
        # Keras 3's float8 Dense fails under an eager GradientTape ("too
        # many values to unpack" in its custom gradient), so the backward
        # pass cannot run op by op.
        raise ReplayError(
            f"the model has quantized layers ({', '.join(quantized[:5])}): their "
            "custom gradients do not run eagerly, so the step cannot be replayed op by "
            "op; the float8 findings (MP015-MP017) and the numerics cover them"
        )
    _load_weights(model, capture)
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
    reference = run_pass(model, batch, scale, None, all_float32=True)
    tree = layer_tree(model)
    divergence = _divergence(run_policy, reference, tree)
    fix = _find_fix(model, batch, scale, run_policy, reference, divergence, tree,
                    capture.manifest.get("layer_paths", {}))
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
        "versions": capture.manifest.get("versions", {}),
    }


def _load_weights(model, capture: files.Capture) -> None:
    captured = capture.weights()
    variables = list(model.weights)
    paths = [_path(v) for v in variables]
    if set(paths) == set(captured):
        values = [captured[p] for p in paths]
    else:
        # A model rebuilt in another process may number its paths anew.
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
    _reset_nonfinite_moving_statistics(model)


def _reset_nonfinite_moving_statistics(model) -> None:
    """Puts BatchNormalization moving statistics the capture holds non-finite
    back to their initial values. A training step computes with the batch's
    statistics and only updates the moving ones, so this changes none of
    the step's outputs or gradients; but an overflow before the captured
    step leaves them NaN, and reading them would pass for an overflow in
    every replay, float32 included."""
    for _, layer, _ in walk_layers(model):
        if not isinstance(layer, keras.layers.BatchNormalization):
            continue
        for variable, initializer in ((layer.moving_mean, layer.moving_mean_initializer),
                                      (layer.moving_variance,
                                       layer.moving_variance_initializer)):
            if not np.all(np.isfinite(variable.numpy())):
                variable.assign(initializer(variable.shape, variable.dtype))


def _path(variable) -> str:
    return getattr(variable, "path", None) or variable.name


def _divergence(run_policy: PassResult, reference: PassResult, tree: dict) -> list[dict]:
    """Per layer computing in a half dtype: how far its output and incoming
    gradient are from float32's, largest first."""
    rows = []
    for name, layer in tree.items():
        if layer.dtype_policy.compute_dtype not in dtypes.HALF_DTYPES:
            continue
        forward = _layer_error(run_policy.forward, reference.forward, name)
        backward = _layer_error(run_policy.backward, reference.backward, name)
        if forward is None and backward is None:
            continue
        rows.append({"layer": name, "compute_dtype": layer.dtype_policy.compute_dtype,
                     "forward_rel_error": forward, "backward_rel_error": backward})
    rows.sort(key=_rank_key, reverse=True)
    return rows


def _rank_key(row: dict) -> tuple[float, float]:
    """The larger of the two errors; between equals (non-finite gradients
    reach every layer below an overflow) the forward error, which marks
    where it began."""
    forward = row["forward_rel_error"] or 0.0
    errors = [e for e in (row["forward_rel_error"], row["backward_rel_error"]) if e is not None]
    return max(errors, default=0.0), forward


def _layer_error(run_values: dict, reference_values: dict, name: str) -> float | None:
    """The largest relative error over the layer's calls (inf where the run
    is non-finite and float32 is not; None where float32 is non-finite too)."""
    errors = []
    for key, expected in reference_values.items():
        if key[0] != name or key not in run_values:
            continue
        got = run_values[key]
        if got.shape != expected.shape or not np.all(np.isfinite(expected)):
            continue
        if not np.all(np.isfinite(got)):
            errors.append(math.inf)
            continue
        norm = float(np.linalg.norm(expected))
        difference = float(np.linalg.norm(got - expected))
        errors.append(difference / norm if norm else (0.0 if difference == 0 else math.inf))
    return max(errors) if errors else None


def _find_fix(model, batch, scale: float, run_policy: PassResult, reference: PassResult,
              divergence: list[dict], tree: dict, paths: dict[str, str]) -> dict:
    """The greedy float32 set, verified by a replay with it.

    The fix is judged without loss scaling: gradients that overflow only once
    multiplied by the step's loss scale are what the dynamic loss scale
    handles itself (it halves), not a per-layer precision problem.
    """
    if not reference.forward_clean:
        where = reference.offender
        return _fix_result([], tree, paths, False, (
            "not verified: the step overflows in float32 too "
            f"({where.op} in {where.layer}: {where.output}); no per-layer float32 "
            "policy fixes it: lower the learning rate, clip, or normalise the inputs"), None)
    unscaled = run_policy if scale == 1.0 else run_pass(model, batch, 1.0, None)
    if _healthy(unscaled):
        return _fix_result([], tree, paths, False, (
            "not verified: with the run's policy the forward pass, the loss and the "
            "unscaled gradients are finite; only the gradients scaled by the loss scale "
            f"{scale:g} overflow, which the dynamic loss scale handles by halving (no "
            "per-layer change needed)" if scale != 1.0 else
            "not verified: this replay of the step has no overflow (the capture's weights "
            "may differ from the step's, see weights_are_the_steps)"), None)
    candidates = _candidates(run_policy, divergence, tree)
    chosen: list[str] = []
    replays = 0
    last = unscaled
    for candidate in candidates:
        if replays >= MAX_FIX_REPLAYS:
            break
        while (candidate is not None and candidate not in chosen
               and replays < MAX_FIX_REPLAYS):
            outcome = _try_pass(model, batch, [*chosen, candidate])
            replays += 1
            if outcome is not None:
                # A parent tried whole covers the sublayers chosen before it.
                chosen = [*(c for c in chosen if not c.startswith(f"{candidate}/")), candidate]
                last = outcome
                break
            # The layer cannot compute in float32 alone (its parent mixes
            # its output with half-precision values): try the parent whole.
            candidate = _parent(candidate, tree)
        if _healthy(last):
            break
    if not _healthy(last):
        return _fix_result(chosen, tree, paths, False, (
            f"not verified: with {len(chosen)} layers in float32 the replay still "
            f"overflows ({_describe(last)})"), None)
    # The layers added before the last one may no longer be needed: drop
    # them, latest first (the first offender's layer is tried last).
    for candidate in reversed(chosen[:-1]):
        if replays >= MAX_FIX_REPLAYS:
            break
        trial = [c for c in chosen if c != candidate]
        outcome = _try_pass(model, batch, trial)
        replays += 1
        if outcome is not None and _healthy(outcome):
            chosen, last = trial, outcome
    error = _max_forward_error(last, reference)
    return _fix_result(chosen, tree, paths, True, (
        f"verified: no overflow and max relative error {error:.3g} with this map "
        "(forward pass, loss and unscaled gradients finite)"), error)


def _try_pass(model, batch, float32_layers: list[str]) -> PassResult | None:
    """The step replayed unscaled with `float32_layers` in float32, or None
    when the model cannot run so (a layer in float32 whose output meets a
    half-precision tensor inside its parent: a dtype error)."""
    try:
        return run_pass(model, batch, 1.0, float32_layers)
    except Exception:  # noqa: BLE001 - that map is not a fix; others are tried
        return None


def _parent(name: str, tree: dict) -> str | None:
    """The qualified name of the layer enclosing `name`, if any."""
    parent = name.rpartition("/")[0]
    return parent if parent in tree else None


def _candidates(run_policy: PassResult, divergence: list[dict], tree: dict) -> list[str]:
    """Layers to try in float32: the first offender's, then by divergence."""
    order = []
    offender = run_policy.offender
    if offender is not None and offender.layer != LOSS:
        order.append(offender.layer)
    order += [row["layer"] for row in divergence]
    order += [name for name, layer in tree.items()
              if layer.dtype_policy.compute_dtype in dtypes.HALF_DTYPES]
    return list(dict.fromkeys(order))


def _healthy(result: PassResult) -> bool:
    return (result.forward_clean and math.isfinite(result.loss)
            and result.gradients_finite)


def _describe(result: PassResult) -> str:
    if result.offender is not None:
        o = result.offender
        return f"{o.phase} {o.op} in {o.layer}: {o.output}"
    return "non-finite loss" if not math.isfinite(result.loss) else "non-finite gradients"


def _max_forward_error(result: PassResult, reference: PassResult) -> float:
    names = {key[0] for key in reference.forward}
    errors = [_layer_error(result.forward, reference.forward, n) for n in names]
    return max((e for e in errors if e is not None), default=0.0)


def _fix_result(chosen: list[str], tree: dict, paths: dict[str, str], verified: bool,
                detail: str, error: float | None) -> dict:
    """The fix as a DTypePolicyMap (layer path in the trained model -> policy,
    each chosen layer with its sublayers) and as `dtype="float32"` lines."""
    policy_map = {}
    for name in chosen:
        for inner in subtree(tree, name):
            path = paths.get(inner) or getattr(tree[inner], "path", None) or inner
            policy_map[path] = "float32"
    lines = [
        f'{name}: {type(tree[name]).__name__}(..., name="{tree[name].name}", dtype="float32")'
        for name in chosen
    ]
    return {"float32_layers": chosen, "policy_map": policy_map, "dtype_lines": lines,
            "verified": verified, "verified_detail": detail,
            "max_rel_error_with_fix": error}


def policy_map_object(result: dict, default_policy: str):
    """The result's fix as a `keras.dtype_policies.DTypePolicyMap`."""
    policy_map = keras.dtype_policies.DTypePolicyMap(default_policy=default_policy)
    for path, policy in result["policy_map"].items():
        policy_map[path] = policy
    return policy_map
