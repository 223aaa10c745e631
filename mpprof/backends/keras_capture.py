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
import posixpath
import sys
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np

from mpprof._version import __version__
from mpprof.backends.collector import Collector
from mpprof.backends.layer_records import called_method, variable_path, walk_layers
from mpprof.jsonsafe import json_safe
from mpprof.records import schema
from mpprof.replay import files, fixes, search, verification
from mpprof.replay.files import ReplayError
from mpprof.replay.search import PassResult


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


def shard_notes(manifest: dict) -> list[str]:
    """What a replay of a capture that holds one process's rows must say."""
    shard = manifest.get("batch_shard")
    if not shard:
        return []
    return [f"the captured batch is process {shard['process']}'s {shard['rows']} of the "
            f"global batch's {shard['global_rows']} rows (a job of {shard['processes']} "
            "processes): the replay judges those rows, and a value that went wrong only in "
            "another process's rows is not in them"]


def write_capture(fit, captured: list[dict], *, step: int, batch: list[np.ndarray],
                  weights: list[np.ndarray], reasons: list[str], loss: float,
                  loss_scale: float, skipped: bool, structure, config: tuple[dict | None, str],
                  backend: dict[str, str], weights_before: bool = False,
                  folder: str = files.REPLAY_FOLDER, batch_shard: dict | None = None) -> None:
    """Writes one capture into `fit.writer`'s run, noting it in `captured`;
    one process's rows of a job's batch (`batch_shard`) into that process's
    own run (`fit.host_writer`), where they are replayed as what they are.

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
        batch_shard: where `batch` is one process's rows of a batch sharded
            across the processes of a job: {"process", "processes", "rows",
            "global_rows"} (`shard_notes` says what that means to a replay).
    """
    model = fit.model
    config_dict, config_note = config
    framework = dict(backend)
    writer, run = fit.writer, schema.TRAIN_RUN
    if batch_shard:
        # A JAX process's own run is numbered by its process index
        # (`mpprof.backends.jax.context.worker_role`).
        writer = fit.host_writer
        run = posixpath.join(schema.TRAIN_RUN, f"worker_{batch_shard['process']}")
    manifest = {
        "capture_version": files.CAPTURE_VERSION,
        **({"backend": framework.pop("backend")} if "backend" in framework else {}),
        "run": run,
        "purpose": "advise" if folder == files.ADVISE_FOLDER else "replay",
        # The fit that wrote it: its run is its writer's (`files.step_folder`).
        "writer": writer.writer_id,
        "step": step,
        "reasons": reasons,
        "loss": loss if math.isfinite(loss) else str(loss),
        "loss_scale": loss_scale,
        "batch_structure": structure,
        "batch_shapes": [list(a.shape) for a in batch],
        "batch_dtypes": [str(a.dtype) for a in batch],
        "batch_bytes": int(sum(a.nbytes for a in batch)),
        "batch_size": int(batch[0].shape[0]) if batch and batch[0].ndim else None,
        **({"batch_shard": batch_shard} if batch_shard else {}),
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
    folder = files.step_folder(step, writer.writer_id, folder)
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
        if not writer.write_file(f"{folder}/{name}", data):
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


class ReplayCaptureBase(Collector):
    """What every backend's replay capture holds and reports alike
    (`mpprof.backends.protocol.ReplayCapture`): its budget, the captures it
    wrote, why it takes none, the precision advisor's kept batches.

    Args:
        budget: captures this fit may write (0: off).
        keras_api: the fit's `Backend` (a backend whose train functions hand
            over each sampled step finds the collector at `keras_api.replay`).
        loss_scales: the `LossScales` (TensorFlow: the in-graph skip counter
            and step; unused where the step state counts).
        health: the `RunHealth` (whether the step's loss is watched).
        instrumenting: tells, while a train function is traced, whether it is
            the instrumented one (TensorFlow; unused where the sampled step is
            marked otherwise).
        advise_batches: how many of the fit's own sampled batches to keep for
            the precision advisor (`AdviseBatches`; 0: none).
        fit_params: the callback's `params` (how many steps the fit runs).
    """

    name = "replay_capture"

    def __init__(self, budget: int, keras_api, loss_scales, health, instrumenting,
                 advise_batches: int = 0, fit_params: dict | None = None):
        self.budget = budget
        self.advise_batches = advise_batches
        self._fit_params = fit_params
        self._advise: AdviseBatches | None = None
        self._api = keras_api
        self._loss_scales = loss_scales
        self._health = health
        self._instrumenting = instrumenting
        self._unavailable: str | None = None
        self.captured: list[dict] = []
        self.initial_descent_skipped = 0

    def context(self) -> dict:
        if self._unavailable is not None:
            off = self.budget == 0 or self._unavailable.startswith("numerics_every")
            return {"state": "off" if off else "unavailable", "reason": self._unavailable,
                    "budget": self.budget}
        entry = {"state": "ok", "budget": self.budget, "captures": self.captured}
        if self._advise is not None:
            entry["advise_batches"] = self._advise.context()
        if self.initial_descent_skipped:
            entry["initial_descent_not_captured"] = self.initial_descent_skipped
        return entry


class SampledStepCapture(ReplayCaptureBase):
    """The replay capture of a backend whose train functions hand it each
    sampled step (JAX, PyTorch): what they share. The backend's subclass
    gathers the step's values (`before_sampled`, `after_sampled`, called by
    its train functions) and writes them; this class registers it with the
    backend (`keras_api.replay`), says when captures are off, and decides
    what a sampled step that ran gets (`decide`). Its arguments are
    `ReplayCaptureBase`'s.

    Example:
        class ReplayCapture(SampledStepCapture):
            def overrides_train_step(self, model): ...
            def after_sample(self, fit):
                decided = self.decide(step, skipped, loss_finite, applied_before)
                ...
    """

    def __init__(self, budget: int, keras_api, loss_scales, health, instrumenting,
                 advise_batches: int = 0, fit_params: dict | None = None):
        super().__init__(budget, keras_api, loss_scales, health, instrumenting,
                         advise_batches, fit_params)
        self._config: tuple = (None, "")
        self._custom_step = False
        self.model: Any = None  # the fit's, once it begins

    def overrides_train_step(self, model) -> bool:
        """Whether the model's `train_step` is its own (the backend's test)."""
        raise NotImplementedError

    def unavailable_on_backend(self, model) -> str | None:
        """Why this backend takes no capture of this model's fit (None: it does)."""
        return None

    def wrap_train_step(self, fit, patches) -> None:
        """Registers with the backend, whose train functions hand over each
        sampled step."""
        self.model = fit.model
        self._unavailable = self._why_unavailable(fit.model, fit.schedule.every)
        self._custom_step = self.overrides_train_step(fit.model)
        if self._unavailable is None:
            if self.advise_batches:
                self._advise = AdviseBatches(self.advise_batches, self._fit_params, fit.step)
            self._api.replay = self
            # Now: during an epoch Keras' JAX fit keeps the state outside the
            # variables, and serializing reads some of them.
            self._config = model_config(fit.model)

    def _why_unavailable(self, model, sample_every: int | None) -> str | None:
        if self.budget == 0 and not self.advise_batches:
            return "replay_budget=0"
        if sample_every is None:
            return "numerics_every=None: only sampled (instrumented) steps are captured"
        return self.unavailable_on_backend(model)

    def wanted(self) -> bool:
        """Whether the next sampled step may be written (a capture left in the
        budget, or an advisor's batch still wanted)."""
        advising = self._advise is not None and len(self._advise.kept) < self._advise.wanted
        return len(self.captured) < self.budget or advising

    def decide(self, step: int, skipped: int, loss_finite: bool | None,
               applied_before: int) -> tuple[list[str], str, list[dict]] | None:
        """What a sampled step that ran gets: (reasons, folder, the list the
        capture is noted in), or None (nothing written).

        Args:
            step: the step.
            skipped: steps the loss scale skipped during it.
            loss_finite: whether its loss was finite (None: not watched).
            applied_before: updates the primary optimizer applied before it.
        """
        if skipped == 0 and loss_finite is not False:
            if self._advise is not None and self._advise.due(step):
                return (["advise: one of the run's own batches"], files.ADVISE_FOLDER,
                        self._advise.kept)
            return None
        if len(self.captured) >= self.budget:
            return None
        if loss_finite and skipped and applied_before == 0:
            # The loss scale's initial descent: halving handles it.
            self.initial_descent_skipped += 1
            return None
        reasons = []
        if skipped:
            reasons.append("overflow: the loss scale skipped the step")
        if loss_finite is False:
            reasons.append("non-finite loss")
        return reasons, files.REPLAY_FOLDER, self.captured

    def end(self, fit) -> None:
        if self._api.replay is self:
            self._api.replay = None


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


def replay_function(replay_with_weights: Callable[[object, files.Capture], dict]
                    ) -> Callable[..., dict]:
    """The `replay(...)` of an engine: finds the capture, rebuilds the model
    (or replays the one given, putting its weights back after), runs
    `replay_with_weights(model, capture)` and saves the result."""

    def replay(logdir_or_model, run: str | None = None, step: int | None = None, *,
               logdir: str | os.PathLike | None = None, save: bool = True) -> dict:
        """Replays a captured step (see the engine's module docstring).

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

    return replay


def captured_model(model, capture: files.Capture) -> None:
    """Sets `model` to the capture's step: float8 refused (`refuse_quantized`),
    the capture's weights and its layers' policies."""
    refuse_quantized(model)
    load_weights(model, capture)
    captured_policies(model, capture)


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


def refuse_quantized(model, why: str = "float8 replays are not supported") -> None:
    """Raises `ReplayError` when the model has layers that run
    `quantized_call` (float8), saying `why` they are not replayed.

    Raises:
        ReplayError: the model has quantized layers.
    """
    quantized = [name for name, layer, _ in walk_layers(model)
                 if called_method(layer) == "quantized_call"]
    if quantized:
        raise ReplayError(
            f"the model has quantized layers ({', '.join(quantized[:5])}): {why}; the "
            "float8 findings (MP015-MP017) and the numerics cover them")


def replay_result(model, capture: files.Capture, *, scale: float, run_policy: PassResult,
                  reference: PassResult, engine: verification.Engine,
                  run_unscaled: Callable[[list[str] | None], PassResult], inputs: list,
                  backend: str, **extra) -> dict:
    """Every engine's result from its two passes: the layers ranked float16
    against float32, the fixes found and verified (`mpprof.replay.fixes`,
    through `engine`), and the result's common keys.

    Args:
        scale: the loss scale the passes ran with.
        run_policy, reference: the passes with the run's policies and all in
            float32.
        run_unscaled: one pass without loss scaling, those layers in float32.
        inputs: the captured batch's model inputs, flattened.
        backend: the registered backend, for the fix's code and the result.
        extra: the engine's own keys ("replayed_as", "notes").
    """
    tree = {name: layer for name, layer, _ in walk_layers(model)}
    divergence = search.divergence(run_policy, reference, tree)
    fix = fixes.find_fixes(
        verifier=verification.Verifier(engine), run_unscaled=run_unscaled, scale=scale,
        run_policy=run_policy, reference=reference, divergence=divergence, tree=tree,
        paths=capture.manifest.get("layer_paths", {}), inputs=inputs, backend=backend)
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
        **extra,
        "backend": backend,
        "versions": capture.manifest.get("versions", {}),
    }
