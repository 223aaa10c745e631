"""Instance-level wrapping of the method each layer's `__call__` runs, on PyTorch.

The wrappers are the JAX backend's (`mpprof.backends.jax.layer_calls`, which
imports no framework: an instance attribute shadows the class's `call` for
one layer, and the input casts of `convert_input` are remembered). On JAX
they run while the step is traced, once; on PyTorch every step calls them,
so their hooks run only while the patch is `active` (the first call, which
fills the precision inventory, and sampled calls): other steps pay one
attribute test per layer call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from mpprof.backends.jax import layer_calls
from mpprof.backends.jax.layer_calls import cast_source, clear_casts, is_patched

__all__ = ["LayerCallPatch", "cast_source", "clear_casts", "is_patched"]


class LayerCallPatch(layer_calls.LayerCallPatch):
    """As `mpprof.backends.jax.layer_calls.LayerCallPatch`, with `active`.

    Args:
        model: the model.
        hooks: objects with `on_call(layer, args, kwargs, outputs)`.
        backend: the fit's `TorchBackend` (its train functions switch the
            hooks on and off).
    """

    def __init__(self, model, hooks, backend=None):
        super().__init__(model, hooks)
        self.active = False
        if backend is not None:
            backend.layer_patch = self

    def _watch_casts(self, policy) -> None:
        convert = getattr(policy, "convert_input", None)
        if not callable(convert) or id(policy) in self._policies:
            return
        self._policies.add(id(policy))
        casts = layer_calls._CASTS

        def convert_input(x, *args, **kwargs):
            y = convert(x, *args, **kwargs)
            if self.active and y is not x and getattr(y, "dtype", None) != getattr(
                    x, "dtype", None):
                casts[id(y)] = (x, y)
            return y

        self._patches.set(policy, "convert_input", convert_input)

    def _wrap(self, layer, call: Callable) -> Callable:
        hooks = self._hooks

        @functools.wraps(call)
        def wrapped_call(*args, **kwargs):
            if not self.active:
                return call(*args, **kwargs)
            self._patch_new_children(layer)
            outputs = call(*args, **kwargs)
            for hook in hooks:
                outputs = hook.on_call(layer, args, kwargs, outputs)
            return outputs

        setattr(wrapped_call, layer_calls._PATCH_MARKER, True)
        return wrapped_call
