"""The backends, and the one place that chooses among them.

`backend_for(model)` gives the `Backend` (`mpprof.backends.base`) of the
Keras a model belongs to: tf-keras models get `tf_keras`, Keras 3 models
the backend Keras runs on. Callers never branch on the backend or flavour.
"""

from __future__ import annotations

import os

from mpprof.backends.base import Backend
from mpprof.backends.flavor import is_tf_keras

# The Keras 3 backends mpprof can profile.
SUPPORTED = ("tensorflow", "jax", "torch")


class UnsupportedBackendError(RuntimeError):
    """Keras runs on a backend mpprof cannot profile yet."""


def check_backend() -> None:
    """Raises `UnsupportedBackendError` unless Keras 3 runs on a supported backend.

    tf-keras always runs on TensorFlow; a tf-keras model does not depend on
    `KERAS_BACKEND`, so only Keras 3's own backend is checked.
    """
    import keras

    backend = keras.backend.backend()
    if backend not in SUPPORTED:
        raise UnsupportedBackendError(
            "mpprof.MixedPrecisionProfiler profiles Keras on TensorFlow, JAX or PyTorch "
            f"(KERAS_BACKEND is {os.environ.get('KERAS_BACKEND', backend)!r}). "
            "Set KERAS_BACKEND=tensorflow, jax or torch before importing keras, "
            "or train without the profiler."
        )


def backend_for(model) -> Backend:
    """The `Backend` of the Keras `model` belongs to."""
    if is_tf_keras(model):
        from mpprof.backends.tf_keras.backend import TfKerasBackend

        return TfKerasBackend()
    check_backend()
    import keras

    if keras.backend.backend() == "jax":
        from mpprof.backends.jax.backend import JaxBackend

        return JaxBackend(model)
    if keras.backend.backend() == "torch":
        from mpprof.backends.torch.backend import TorchBackend

        return TorchBackend(model)
    from mpprof.backends.tensorflow.backend import TensorFlowBackend

    return TensorFlowBackend()

