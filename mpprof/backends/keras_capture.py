"""What every backend's replay capture and replay engine do alike, in Keras.

A capture is the same files on every backend (`mpprof.replay.files`): the
batch, the weights the step ran with, the model's config and each layer's
policy. Writing them, rebuilding the model from them, loading its weights
(and refusing weights already non-finite) and the `replay(...)` entry are
the same code; the backends differ only in how they get the
step's values and in how they run the step again.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import sys
from collections.abc import Callable, Iterator

import keras
import numpy as np

from mpprof._version import __version__
from mpprof.backends.layer_records import variable_path, walk_layers
from mpprof.jsonsafe import json_safe
from mpprof.records import schema
from mpprof.replay import files
from mpprof.replay.files import ReplayError


def model_config(model) -> tuple[dict | None, str]:
    """The model's Keras serialization, or None with why not."""
    try:
        with _tensorflow_left_unimported():
            config = keras.saving.serialize_keras_object(model)
        files.json_bytes(config)
    except Exception as e:  # noqa: BLE001 - a custom model without get_config
        return None, (f"not serializable ({type(e).__name__}: {str(e)[:200]}); "
                      "replay it in-process: mpprof.replay.replay(model, logdir=...)")
    return config, "rebuilt by keras.saving.deserialize_keras_object"


@contextlib.contextmanager
def _tensorflow_left_unimported() -> Iterator[None]:
    """Keras' serializer asks `tf.available` (its lazy TensorFlow module) to
    test whether a value is a `tf.TensorShape`, which imports TensorFlow when
    it is installed: seconds and hundreds of MB a JAX fit would pay for
    nothing. While TensorFlow is not imported no value can be one of its
    objects, so for the call Keras is told it is unavailable; a Keras without
    that module is left as it is."""
    try:
        from keras.src.utils import module_utils
    except ImportError:
        yield
        return
    lazy = getattr(module_utils, "tensorflow", None)
    if "tensorflow" in sys.modules or getattr(lazy, "_available", True) is not None:
        yield  # imported already, decided already, or not Keras' lazy module
        return
    lazy._available = False
    try:
        yield
    finally:
        if lazy._available is False:
            lazy._available = None  # undecided again: Keras asks for itself later


def write_capture(fit, captured: list[dict], *, step: int, batch: list[np.ndarray],
                  weights: list[np.ndarray], reasons: list[str], loss: float,
                  loss_scale: float, skipped: bool, structure, config: tuple[dict | None, str],
                  backend: dict[str, str], weights_before: bool = False,
                  folder: str = files.REPLAY_FOLDER) -> None:
    """Writes one capture into `fit.writer`'s run, noting it in `captured`.

    Args:
        batch: the step's batch, as flat arrays (`structure` rebuilds it).
        weights: the model's weights the step ran with, in `model.weights`
            order (the non-trainable ones as the step found them).
        skipped: whether the step was skipped (its weights are then the ones
            it ran with, trainable ones included).
        config: `model_config(model)`.
        backend: the manifest's "backend" entry (the backend's registered
            name, `mpprof.backends.REGISTRY`; older TensorFlow captures have
            none) and framework versions, e.g. `{"backend": "jax", "jax": "0.10.2"}`.
        weights_before: whether `weights` were copied before the step ran
            (then they are the ones it ran with, skipped or not).
        folder: `files.REPLAY_FOLDER`, or `files.ADVISE_FOLDER` for a batch
            kept for the precision advisor (`AdviseBatches`).
    """
    model = fit.model
    config_dict, config_note = config
    framework = dict(backend)
    manifest = {
        "capture_version": files.CAPTURE_VERSION,
        **({"backend": framework.pop("backend")} if "backend" in framework else {}),
        "run": schema.TRAIN_RUN,
        "purpose": "advise" if folder == files.ADVISE_FOLDER else "replay",
        # The fit that wrote it: its run is its writer's (`files.step_folder`).
        "writer": fit.writer.writer_id,
        "step": step,
        "reasons": reasons,
        "loss": loss if math.isfinite(loss) else str(loss),
        "loss_scale": loss_scale,
        "batch_structure": structure,
        "batch_shapes": [list(a.shape) for a in batch],
        "batch_dtypes": [str(a.dtype) for a in batch],
        "batch_bytes": int(sum(a.nbytes for a in batch)),
        "batch_size": int(batch[0].shape[0]) if batch and batch[0].ndim else None,
        "weight_paths": [variable_path(v) for v in model.weights],
        "weight_bytes": int(sum(w.nbytes for w in weights)),
        "weights_are_the_steps": skipped or weights_before,
        "weights_note": (
            "the weights as the step found them (copied before it ran)" if weights_before
            else "the step was skipped: the weights after it are the ones it ran with "
            "(non-trainable state, such as moving statistics, as the step found it)"
            if skipped else
            "the step was not skipped (no loss scaling, or its gradients were "
            "finite): its update was applied, so these are the trainable weights "
            "after it (non-trainable state as the step found it)"
        ),
        "model_class": type(model).__name__,
        "model_policy": model.dtype_policy.name,
        "layer_policies": {
            name: layer.dtype_policy.name for name, layer, _ in walk_layers(model)
        },
        # DTypePolicyMap keys: the paths of this model's layers, which a model
        # rebuilt elsewhere may not share.
        "layer_paths": {
            name: layer.path for name, layer, _ in walk_layers(model)
            if getattr(layer, "path", None)
        },
        "model_config": {"saved": config_dict is not None, "note": config_note},
        "jit_compile": bool(getattr(model, "jit_compile", False)),
        "versions": {
            "mpprof": __version__, **framework, "keras": keras.__version__,
            "python": platform.python_version(), "numpy": np.__version__,
        },
    }
    folder = files.step_folder(step, fit.writer.writer_id, folder)
    payloads = [
        (files.BATCH, files.npz_bytes({f"leaf_{i}": a for i, a in enumerate(batch)})),
        (files.WEIGHTS, files.npz_bytes({f"weight_{i}": w for i, w in enumerate(weights)})),
    ]
    if config_dict is not None:
        payloads.append((files.MODEL_CONFIG, files.json_bytes(config_dict)))
    manifest["bytes"] = sum(len(data) for _, data in payloads)
    # The manifest last: a folder without one is not a capture.
    payloads.append((files.MANIFEST, files.json_bytes(manifest)))
    captured.append({"step": step, "bytes": manifest["bytes"]})
    for name, data in payloads:
        if not fit.writer.write_file(f"{folder}/{name}", data):
            captured[-1]["written"] = False
            return


class AdviseBatches:
    """Which sampled steps keep their batch for the precision advisor
    (`MixedPrecisionProfiler(advise_batches=N)`): N of the fit's own batches,
    spread across it. The fit's steps are split into N equal parts and the
    first sampled (instrumented) step at or after the middle of each part is
    kept (only a sampled step returns its batch); when the fit does not say
    how many steps it runs, the first N sampled steps.

    Args:
        wanted: N (0: off).
        params: the callback's `params` (Keras: "epochs", "steps").
        origin: the step the fit starts at.
    """

    def __init__(self, wanted: int, params: dict | None, origin: int = 0):
        self.wanted = wanted
        self.kept: list[dict] = []
        self._origin = int(origin)
        params = params or {}
        steps, epochs = params.get("steps"), params.get("epochs")
        total = int(steps) * int(epochs or 1) if steps else None
        self.targets = ([int((i + 0.5) * total / wanted) for i in range(wanted)]
                        if total and wanted else None)

    def due(self, step: int) -> bool:
        """Whether the sampled `step` is one to keep."""
        if len(self.kept) >= self.wanted:
            return False
        if self.targets is None:
            return True
        return step - self._origin >= self.targets[len(self.kept)]

    def context(self) -> dict:
        return {"wanted": self.wanted, "kept": self.kept, "targets": self.targets}


def load_weights(model, capture: files.Capture) -> None:
    """Sets the model's variables to the capture's.

    BatchNormalization moving statistics the capture holds non-finite go
    back to their initial values: a training step computes with the batch's
    statistics and only updates the moving ones, so this changes none of
    the step's outputs or gradients; but an overflow before the captured
    step leaves them NaN, and reading them would pass for an overflow in
    every replay, float32 included.

    Raises:
        ReplayError: the variables do not match the capture's, or some
            captured weight the step computes with is already non-finite
            (`_non_finite_weights_error`).
    """
    captured = capture.weights()
    variables = list(model.weights)
    paths = [variable_path(v) for v in variables]
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
    for _, layer, _ in walk_layers(model):
        if not isinstance(layer, keras.layers.BatchNormalization):
            continue
        for variable, initializer in ((layer.moving_mean, layer.moving_mean_initializer),
                                      (layer.moving_variance,
                                       layer.moving_variance_initializer)):
            if not _finite(variable):
                variable.assign(initializer(variable.shape, variable.dtype))
    # Named trainable first: a layer's weights say more than an optimizer's slots.
    trainable = {id(v) for v in model.trainable_weights}
    bad = [variable_path(v) for v in sorted(variables, key=lambda v: id(v) not in trainable)
           if not _finite(v)]
    if bad:
        raise _non_finite_weights_error(capture, bad, len(variables))


def captured_policies(model, capture: files.Capture) -> None:
    """Gives each layer the policy it trained with: a subclassed model
    rebuilt from its config makes its layers in `__init__` under this
    process's global policy, not the one it was trained under (a layer
    whose policy is already the captured one is left as it is)."""
    captured = capture.manifest.get("layer_policies") or {}
    for name, layer, _ in walk_layers(model):
        policy = captured.get(name)
        if policy and layer.dtype_policy.name != policy:
            layer.dtype_policy = policy


def _non_finite_weights_error(capture: files.Capture, bad: list[str],
                             count: int) -> ReplayError:
    """Why a capture whose weights hold NaN or inf is not replayed.

    Those weights are not the ones the step that first went non-finite ran
    with: an update made from its non-finite gradients (no loss scaling
    skipped it) wrote them. Any replay from them goes non-finite at the
    first op that reads them, in float32 too, so its first op, ranking and
    fix would be about the damage, not its cause.

    Args:
        bad: the paths of the non-finite variables.
        count: how many variables the model has.
    """
    manifest = capture.manifest
    if manifest.get("weights_are_the_steps"):
        # Copied before the step: an earlier, unsampled step wrote them.
        how = ("an earlier step's update, made from non-finite gradients that no loss "
               "scaling skipped, wrote them before this sampled step ran")
        fix = ("train with a LossScaleOptimizer (a step whose gradients are non-finite is "
               "then skipped, and captured with the weights it ran with), or sample every "
               "step (numerics_every=1) so that the first step that goes non-finite is "
               "the one captured")
    else:
        how = ("the capture holds the weights after the step, and its update, made from "
               "non-finite gradients that no loss scaling skipped, wrote them (or an "
               "earlier step's did)")
        fix = ("train with a LossScaleOptimizer (mixed_float16's automatic loss scaling, "
               "or keras.optimizers.LossScaleOptimizer): a step whose gradients are "
               "non-finite is then skipped, and captured with the weights it ran with")
    shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
    batch = _non_finite_batch_values(capture)
    data = (f"; its batch holds {batch} non-finite values: the data itself may be the "
            "cause" if batch else "")
    return ReplayError(
        f"the weights captured at step {capture.step} are already non-finite ({len(bad)} "
        f"of {count} variables hold NaN or inf: {shown}): {how}. The step that went "
        "non-finite cannot be run again from them, and a replay would blame the first "
        f"layer that reads them, in float32 too{data}. To replay it, {fix}"
    )


def _finite(variable) -> bool:
    return bool(np.all(np.isfinite(keras.ops.convert_to_numpy(variable))))


def _non_finite_batch_values(capture: files.Capture) -> int:
    """How many of the captured batch's floating values are NaN or inf."""
    return sum(int(np.size(leaf) - np.isfinite(leaf).sum())
               for leaf in keras.tree.flatten(capture.batch())
               if isinstance(leaf, np.ndarray) and np.issubdtype(leaf.dtype, np.floating))


def replay_entry(logdir_or_model, run: str | None, step: int | None,
                 logdir: str | os.PathLike | None, save: bool,
                 replay_with_weights: Callable[[object, files.Capture], dict]) -> dict:
    """`replay(...)` of every engine: finds the capture, rebuilds the model
    (or replays the one given, putting its weights back after), runs
    `replay_with_weights(model, capture)` and saves the result."""
    model = None
    if isinstance(logdir_or_model, keras.Model):
        model = logdir_or_model
        if logdir is None:
            raise ReplayError("replay(model, ...) needs logdir=: where the capture is")
    else:
        logdir = logdir_or_model
    capture = files.select_capture(logdir, run or schema.TRAIN_RUN, step)
    if model is None:
        result = replay_with_weights(rebuild(capture), capture)
    else:
        saved = [keras.ops.convert_to_numpy(v) for v in model.weights]
        try:
            result = replay_with_weights(model, capture)
        finally:
            for variable, value in zip(model.weights, saved, strict=True):
                variable.assign(value)
    result = json_safe(result)
    if save:
        files.write_result(capture, result)
    return result


def rebuild(capture: files.Capture):
    """The captured model, rebuilt from its config in the current backend."""
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
