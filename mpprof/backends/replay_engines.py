"""Picks the replay engine of the backend that trained a capture.

The one way from the front ends (`mpprof.replay.replay`, `mpprof replay`) to
a framework: a capture's manifest says which backend wrote it (`"backend"`;
captures written before JAX had captures are TensorFlow's), and that
backend's engine is imported only here, only when a replay runs.
"""

from __future__ import annotations

import os
import sys

from mpprof.records import schema
from mpprof.replay import files
from mpprof.replay.files import ReplayError

TENSORFLOW = "tensorflow"
JAX = "jax"
# Each backend's framework as users name it, and the extra that installs it.
FRAMEWORKS = {TENSORFLOW: "TensorFlow", JAX: "JAX"}
EXTRAS = {TENSORFLOW: "tensorflow", JAX: "jax"}
# A missing module among these means the backend's extra is not installed
# (a base install reads and diagnoses, but cannot re-run a step).
_FRAMEWORK_MODULES = {"keras", "tensorflow", "jax", "jaxlib", "ml_dtypes"}


def capture_backend(manifest: dict) -> str:
    """The backend that trained a capture (old captures: TensorFlow)."""
    return str(manifest.get("backend") or TENSORFLOW)


def framework(manifest: dict) -> str:
    """The framework a replay of this capture imports ("TensorFlow", "JAX")."""
    backend = capture_backend(manifest)
    return FRAMEWORKS.get(backend, backend)


def _model_backend() -> str:
    import keras

    backend = keras.backend.backend()
    return JAX if backend == JAX else TENSORFLOW


def _engine(backend: str):
    try:
        return _import_engine(backend)
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] not in _FRAMEWORK_MODULES:
            raise
        name = FRAMEWORKS[backend]
        raise ReplayError(
            f"this capture was trained on {name}: replaying it needs Keras and {name}, "
            f"and {e.name} is not installed here. Install them with "
            f'pip install "mpprof[{EXTRAS[backend]}]" (from a checkout: '
            f'pip install ".[{EXTRAS[backend]}]"), or replay where the run was trained'
        ) from e


def _import_engine(backend: str):
    if backend == JAX:
        keras = sys.modules.get("keras")
        if keras is None:
            # Keras picks its backend once, at import: this process replays on JAX.
            os.environ.setdefault("KERAS_BACKEND", JAX)
        elif keras.backend.backend() != JAX:
            raise ReplayError(
                "this capture was trained on JAX but Keras runs on "
                f"{keras.backend.backend()!r} in this process: replay it with "
                "KERAS_BACKEND=jax (e.g. KERAS_BACKEND=jax mpprof replay LOGDIR)")
        from mpprof.backends.jax import replay_engine
    elif backend == TENSORFLOW:
        from mpprof.backends.tensorflow import replay_engine
    else:
        raise ReplayError(f"captures trained on {backend!r} cannot be replayed by this mpprof")
    return replay_engine


def replay(logdir_or_model, run: str | None = None, step: int | None = None,
           **kwargs) -> dict:
    """Replays a captured step with the engine of the backend that trained it
    (see `mpprof.backends.tensorflow.replay_engine.replay`)."""
    if isinstance(logdir_or_model, (str, os.PathLike)):
        capture = files.select_capture(logdir_or_model, run or schema.TRAIN_RUN, step)
        backend = capture_backend(capture.manifest)
    else:
        backend = _model_backend()
    return _engine(backend).replay(logdir_or_model, run, step, **kwargs)


def verification_engine(model, batches: list, loss_scale: float = 1.0):
    """A `mpprof.replay.verification.Engine` for `model` in this process's
    Keras backend, on `batches` from the model's current weights (the
    precision advisor's way in: `Verifier(verification_engine(...))`)."""
    return _engine(_model_backend()).engine_for(model, batches, loss_scale)
