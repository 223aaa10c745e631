"""The PyTorch suite: run in its own pytest process with KERAS_BACKEND=torch
(`make test` does), since Keras picks its backend once, at import. The
recipes are tests/jax/jax_runs.py's (Keras 3 only, any backend); the
real-model families and checks are tests/models/'s, the keras-io builders
tests/keras_io/'s."""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")
sys.path.insert(0, os.path.dirname(__file__))
# jax_runs (the recipes), then parity_runs and float8_runs.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "jax"))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
# The real-model suite's families and checks, and the keras-io builders,
# shared with TensorFlow and JAX.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "models"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "keras_io"))

import keras

if keras.backend.backend() != "torch":
    raise RuntimeError(
        "tests/torch needs Keras on PyTorch: run `KERAS_BACKEND=torch python -m pytest "
        f"tests/torch` (Keras runs on {keras.backend.backend()!r} in this process)"
    )
