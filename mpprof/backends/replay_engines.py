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


def capture_backend(manifest: dict) -> str:
    """The backend that trained a capture (old captures: TensorFlow)."""
    return str(manifest.get("backend") or TENSORFLOW)


def _model_backend() -> str:
    import keras

    backend = keras.backend.backend()
    return JAX if backend == JAX else TENSORFLOW


def _engine(backend: str):
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
    module = _engine(backend)
    if backend == TENSORFLOW and _model_backend() != TENSORFLOW:
        raise ReplayError("this run was trained on TensorFlow but Keras runs on JAX in this "
                          "process: verify it without KERAS_BACKEND=jax")
    from mpprof.backends import keras_capture

    model = keras_capture.rebuild(captures[-1])
    keras_capture.load_weights(model, captures[-1])
    if backend == JAX:
        # A subclassed model rebuilt here makes its layers under this
        # process's global policy: give them the ones they trained with.
        module._captured_policies(model, captures[-1])
    return model, float(captures[-1].manifest.get("loss_scale") or 1.0)
