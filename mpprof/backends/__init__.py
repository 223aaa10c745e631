"""The backends, and the one place that chooses among them.

Every backend mpprof can profile is registered here, once, by the name Keras
gives it (`KERAS_BACKEND`), with where its code is: its `Backend` (what the
recording core asks, `mpprof.backends.protocol`), its replay engine, and the
framework-free reader of its XProf op names and spelling of its fixes' code.
Nothing else names a backend: `backend_for(model)` gives a model's `Backend`
(tf-keras models get `tf_keras`, Keras 3 models the backend Keras runs on),
`registration(name)` the rest (`mpprof.backends.replay_engines` picks a
capture's engine with it, `mpprof.fix_syntax` a run's spelling). Callers
never branch on the backend or flavour.

A new backend is its folder `mpprof/backends/<name>/` (its `fix_spelling.py`
among its modules) and one line in `REGISTRY`.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

from mpprof.backends.base import Backend
from mpprof.backends.flavor import is_tf_keras


@dataclass(frozen=True)
class Registration:
    """Where one backend's code is (each a "module:attribute" or module path,
    imported only when needed: the frameworks are optional).

    Attributes:
        name: the backend, as Keras names it (`KERAS_BACKEND`) and as a
            replay capture's manifest says which backend wrote it.
        framework: the framework, as people write it ("TensorFlow").
        backend: its `Backend` class, made with the model of each fit.
        fix_spelling: the framework-free `mpprof.fix_syntax.Spelling` of
            its fixes' code (custom train step, compile and input advice,
            promotion rule, ...), which `FixSyntax` reads.
        replay_engine: the module whose `replay(logdir_or_model, run, step,
            **kwargs)` re-runs its captures (None: it has none).
        op_names: the framework-free module whose `layer_of(op_name)` gives
            the layer of an XProf op name in its naming, or None when the
            name is not in it (None: no XProf window); and, for a framework
            whose ops XProf cannot judge, whose
            `tensor_core_eligible(op_name)` says which could run on Tensor
            Cores.
        extra: the pip extra of mpprof that installs the framework
            (`pip install "mpprof[<extra>]"`).
    """

    name: str
    framework: str
    backend: str
    fix_spelling: str
    replay_engine: str | None = None
    op_names: str | None = None
    extra: str = ""


REGISTRY: dict[str, Registration] = {r.name: r for r in (
    Registration("tensorflow", "TensorFlow",
                 "mpprof.backends.tensorflow.backend:TensorFlowBackend",
                 "mpprof.backends.tensorflow.fix_spelling:SPELLING",
                 "mpprof.backends.tensorflow.replay_engine",
                 "mpprof.backends.tensorflow.op_names", "tensorflow"),
    Registration("jax", "JAX", "mpprof.backends.jax.backend:JaxBackend",
                 "mpprof.backends.jax.fix_spelling:SPELLING",
                 "mpprof.backends.jax.replay_engine", "mpprof.backends.jax.op_names", "jax"),
    Registration("torch", "PyTorch", "mpprof.backends.torch.backend:TorchBackend",
                 "mpprof.backends.torch.fix_spelling:SPELLING",
                 "mpprof.backends.torch.replay_engine", "mpprof.backends.torch.op_names",
                 "torch"),
)}

# tf-keras (Keras 2) is a flavour, not a backend: its models train on
# TensorFlow whatever `KERAS_BACKEND` says, chosen by the model's class.
TF_KERAS = Registration("tensorflow", "TensorFlow",
                        "mpprof.backends.tf_keras.backend:TfKerasBackend",
                        "mpprof.backends.tf_keras.fix_spelling:SPELLING",
                        REGISTRY["tensorflow"].replay_engine, REGISTRY["tensorflow"].op_names,
                        "tf-keras")

# The backend of records that do not name one, written before they did, when
# TensorFlow was the only backend: replay captures whose manifest has no
# "backend", runs whose context has no "keras_backend" (their fixes' code).
LEGACY_BACKEND = "tensorflow"

# The Keras 3 backends mpprof can profile.
SUPPORTED = tuple(REGISTRY)


class UnsupportedBackendError(RuntimeError):
    """Keras runs on a backend mpprof cannot profile yet."""


def registration(name: str) -> Registration | None:
    """The registration of backend `name` (None: not one mpprof knows)."""
    return REGISTRY.get(name)


def check_backend() -> None:
    """Raises `UnsupportedBackendError` unless Keras 3 runs on a supported backend.

    tf-keras always runs on TensorFlow; a tf-keras model does not depend on
    `KERAS_BACKEND`, so only Keras 3's own backend is checked.
    """
    import keras

    backend = keras.backend.backend()
    if backend not in REGISTRY:
        frameworks = [r.framework for r in REGISTRY.values()]
        names = " or ".join(filter(None, [", ".join(frameworks[:-1]), frameworks[-1]]))
        settings = " or ".join(f"KERAS_BACKEND={name}" for name in REGISTRY)
        raise UnsupportedBackendError(
            f"mpprof.MixedPrecisionProfiler profiles Keras on {names} "
            f"(KERAS_BACKEND is {os.environ.get('KERAS_BACKEND', backend)!r}). "
            f"Set {settings} before importing keras, "
            "or train without the profiler."
        )


def load(path: str):
    """The object a registration names ("module:attribute"), or the module."""
    module, _, attribute = path.partition(":")
    found = importlib.import_module(module)
    return getattr(found, attribute) if attribute else found


def backend_for(model) -> Backend:
    """The `Backend` of the Keras `model` belongs to (one per fit)."""
    if is_tf_keras(model):
        return load(TF_KERAS.backend)(model)
    check_backend()
    import keras

    return load(REGISTRY[keras.backend.backend()].backend)(model)
