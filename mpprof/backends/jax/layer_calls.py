"""Instance-level wrapping of the method each layer's `__call__` runs, on JAX.

As on TensorFlow (`mpprof.backends.tensorflow.layer_calls`), an instance
attribute shadows the class's `call` (or `quantized_call`) for one layer, and
the fit's `Patches` undo it. The hooks run after the original method while
the step is traced by `jax.jit` (once per traced function), so they cost
nothing per step; JAX has no graph to remember, so nothing else is kept.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from mpprof.backends.layer_records import called_method, walk_layers
from mpprof.recording.patching import Patches

_PATCH_MARKER = "_mpprof_wrapped"

# The casts `Layer.__call__` made while a step was traced: by id of the cast
# value, (the value before the cast, the value after). Keras casts a layer's
# inputs to its compute dtype through `layer.dtype_policy.convert_input`
# before `call` runs, so the wrapped `call` sees only the cast value; this
# leads it back to the layer that produced the input. Both values are kept
# alive, so an id is never reused while it is here.
_CASTS: dict[int, tuple] = {}


def cast_source(value):
    """The value `value` was cast from by a layer's input conversion, or None."""
    entry = _CASTS.get(id(value))
    return entry[0] if entry is not None and entry[1] is value else None


def clear_casts() -> None:
    _CASTS.clear()


class LayerCallPatch:
    """Wraps the called method of `model` and every nested layer so that
    `hooks` (objects with `on_call(layer, args, kwargs, outputs)`, returning
    the outputs) see every call. Children a parent creates in its `build`
    are wrapped just before the parent's call runs."""

    def __init__(self, model, hooks: Sequence):
        self._model = model
        self._hooks = list(hooks)
        self._patches: Patches | None = None
        self._wrapped: set[int] = set()

    def add_hook(self, hook) -> None:
        self._hooks.append(hook)

    def install(self, patches: Patches) -> None:
        self._patches = patches
        self._wrapped.clear()
        self._policies: set[int] = set()
        clear_casts()
        self._patch(self._model)
        for _, layer, _ in walk_layers(self._model):
            self._patch(layer)

    def _patch(self, layer) -> None:
        method = called_method(layer)
        if is_patched(layer):
            delattr(layer, method)
        self._patches.set(layer, method, self._wrap(layer, getattr(layer, method)))
        self._wrapped.add(id(layer))
        self._watch_casts(getattr(layer, "dtype_policy", None))

    def _watch_casts(self, policy) -> None:
        """Wraps `policy.convert_input` (policies may be shared by layers:
        each is wrapped once) to remember each cast it makes."""
        convert = getattr(policy, "convert_input", None)
        if not callable(convert) or id(policy) in self._policies:
            return
        self._policies.add(id(policy))

        def convert_input(x, *args, **kwargs):
            y = convert(x, *args, **kwargs)
            if y is not x and getattr(y, "dtype", None) != getattr(x, "dtype", None):
                _CASTS[id(y)] = (x, y)
            return y

        self._patches.set(policy, "convert_input", convert_input)

    def _patch_new_children(self, parent) -> None:
        for child in parent._flatten_layers(include_self=False, recursive=False):
            if id(child) not in self._wrapped and type(child).__name__ != "InputLayer":
                self._patch(child)

    def _wrap(self, layer, call: Callable) -> Callable:
        hooks = self._hooks

        @functools.wraps(call)
        def wrapped_call(*args, **kwargs):
            self._patch_new_children(layer)
            outputs = call(*args, **kwargs)
            for hook in hooks:
                outputs = hook.on_call(layer, args, kwargs, outputs)
            return outputs

        setattr(wrapped_call, _PATCH_MARKER, True)
        return wrapped_call


def is_patched(layer) -> bool:
    """Whether the method `layer.__call__` runs is an mpprof wrapper."""
    return getattr(layer.__dict__.get(called_method(layer)), _PATCH_MARKER, False)
