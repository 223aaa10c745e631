"""Forensic replay of a step that went wrong (see `mpprof.backends.tensorflow.replay_engine`).

`replay(...)` imports TensorFlow and Keras; reading a capture or a saved
result (`mpprof.replay.files`) does not.
"""

from __future__ import annotations

__all__ = ["replay"]


def replay(logdir_or_model, run: str | None = None, step: int | None = None, **kwargs) -> dict:
    """Replays a captured step: see `mpprof.backends.tensorflow.replay_engine.replay`."""
    from mpprof.backends.tensorflow import replay_engine as engine

    return engine.replay(logdir_or_model, run, step, **kwargs)
