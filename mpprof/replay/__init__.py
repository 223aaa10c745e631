"""Forensic replay of a step that went wrong (the engine of the backend that trained
the capture: `mpprof.backends.replay_engines`).

`replay(...)` imports Keras and its backend; reading a capture or a saved
result (`mpprof.replay.files`) does not.
"""

from __future__ import annotations

__all__ = ["replay"]


def replay(logdir_or_model, run: str | None = None, step: int | None = None, **kwargs) -> dict:
    """Replays a captured step: see `mpprof.backends.tensorflow.replay_engine.replay`
    (a capture trained on JAX replays with `mpprof.backends.jax.replay_engine`)."""
    from mpprof.backends import replay_engines

    return replay_engines.replay(logdir_or_model, run, step, **kwargs)
