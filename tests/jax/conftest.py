"""The JAX suite: run in its own pytest process with KERAS_BACKEND=jax
(`make test` does), since Keras picks its backend once, at import."""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, os.path.dirname(__file__))  # jax_runs
# The real-model suite's families and checks, shared with TensorFlow.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "models"))

import keras

if keras.backend.backend() != "jax":
    raise RuntimeError(
        "tests/jax needs Keras on JAX: run `KERAS_BACKEND=jax python -m pytest tests/jax` "
        f"(Keras runs on {keras.backend.backend()!r} in this process)"
    )
