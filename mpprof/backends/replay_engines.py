"""Picks the replay engine of the backend that trained a capture.

The one way from the front ends (`mpprof.replay.replay`, `mpprof replay`) to
a framework: a capture's manifest says which backend wrote it (`"backend"`),
and that backend's engine (its `Registration.replay_engine` in
`mpprof.backends`) is imported only here, only when a replay runs.
"""

from __future__ import annotations

import os
import sys

from mpprof.backends import LEGACY_BACKEND, TF_KERAS, load, registration
from mpprof.backends.flavor import is_tf_keras
from mpprof.records import schema
from mpprof.replay import files
from mpprof.replay.files import ReplayError

# A missing module among these means the backend's extra is not installed
# (a base install reads and diagnoses, but cannot re-run a step).
_FRAMEWORK_MODULES = {"keras", "tensorflow", "jax", "jaxlib", "ml_dtypes", "torch"}


def capture_backend(manifest: dict) -> str:
    """The backend that trained a capture (captures that do not say:
    `LEGACY_BACKEND`)."""
    return str(manifest.get("backend") or LEGACY_BACKEND)


def framework(manifest: dict) -> str:
    """The framework a replay of this capture imports ("TensorFlow", "JAX")."""
    backend = capture_backend(manifest)
    registered = registration(backend)
    return registered.framework if registered is not None else backend


def _model_backend(model) -> str:
    if is_tf_keras(model):
        return TF_KERAS.name
    import keras

    return keras.backend.backend()


def _engine(backend: str):
    registered = registration(backend)
    if registered is None or registered.replay_engine is None:
        raise ReplayError(f"captures trained on {backend!r} cannot be replayed by this mpprof")
    if "keras" not in sys.modules:
        # Keras picks its backend once, at import: this process replays on
        # the capture's.
        os.environ.setdefault("KERAS_BACKEND", backend)
    keras = sys.modules.get("keras")
    running = keras.backend.backend() if keras is not None else None
    if running is not None and running != backend:
        raise ReplayError(
            f"this capture was trained on {registered.framework} but Keras runs on "
            f"{running!r} in this process: replay it with KERAS_BACKEND={backend} "
            f"(e.g. KERAS_BACKEND={backend} mpprof replay LOGDIR)")
    try:
        return load(registered.replay_engine)
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] not in _FRAMEWORK_MODULES:
            raise
        raise ReplayError(
            f"this capture was trained on {registered.framework}: replaying it needs Keras "
            f"and {registered.framework}, and {e.name} is not installed here. Install them "
            f'with pip install "mpprof[{registered.extra}]" (from a checkout: '
            f'pip install ".[{registered.extra}]"), or replay where the run was trained'
        ) from e


def replay(logdir_or_model, run: str | None = None, step: int | None = None,
           **kwargs) -> dict:
    """Replays a captured step with the engine of the backend that trained it
    (each engine's `replay` documents the arguments and the result)."""
    if isinstance(logdir_or_model, (str, os.PathLike)):
        capture = files.select_capture(logdir_or_model, run or schema.TRAIN_RUN, step)
        backend = capture_backend(capture.manifest)
    else:
        backend = _model_backend(logdir_or_model)
    return _engine(backend).replay(logdir_or_model, run, step, **kwargs)


def verification_engine(model, batches: list, loss_scale: float = 1.0):
    """A `mpprof.replay.verification.Engine` for `model` in this process's
    Keras backend, on `batches` from the model's current weights (the
    precision advisor's way in: `Verifier(verification_engine(...))`)."""
    return _engine(_model_backend(model)).engine_for(model, batches, loss_scale)


def advise_model(captures: list):
    """The model of the precision advisor's kept batches (`advise_batches=N`,
    `mpprof.advisor.verify`), rebuilt from their config on the backend that
    trained them, with the weights of the last of them (the most trained the
    run kept) and its layers' captured policies; and its loss scale there.

    Raises:
        ReplayError: the model cannot be rebuilt, or Keras runs on another
            backend in this process.
    """
    backend = capture_backend(captures[0].manifest)
    _engine(backend)  # refuses a process whose Keras runs on another backend
    from mpprof.backends import keras_capture

    model = keras_capture.rebuild(captures[-1])
    keras_capture.load_weights(model, captures[-1])
    # A subclassed model rebuilt here makes its layers under this process's
    # global policy: give them the ones they trained with.
    keras_capture.captured_policies(model, captures[-1])
    return model, float(captures[-1].manifest.get("loss_scale") or 1.0)
