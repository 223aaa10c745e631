"""The wrapping of every layer's call on PyTorch: the shared wrapper
(`mpprof.backends.layer_call_patch`) with JAX's cast memory
(`mpprof.backends.layer_casts`, shared with JAX), switched by `active`.
On JAX the hooks run while the step is traced, once; on PyTorch every step
calls the wrappers, so their hooks (and the cast memory) run only while the
patch is `active` (the first call, which fills the precision inventory, and
sampled calls): other steps pay one attribute test per layer call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from mpprof.backends import layer_call_patch, layer_casts
from mpprof.backends.layer_casts import cast_source, clear_casts

__all__ = ["LayerCallPatch", "cast_source", "clear_casts"]


class LayerCallPatch(layer_casts.LayerCallPatch):
    """As `mpprof.backends.layer_casts.LayerCallPatch`, with `active`.

    Args:
        model: the model.
        hooks: objects with `on_call(layer, args, kwargs, outputs)`.
        backend: the fit's `TorchBackend` (its train functions switch the
            hooks on and off).
    """

    def __init__(self, model, hooks, backend=None):
        super().__init__(model, hooks)
        # On until a fit's train functions take over (they switch it off
        # between the calls that need it): a patch used on its own runs its
        # hooks on every call.
        self.active = True
        if backend is not None:
            backend.layer_patch = self

    def _watch_casts(self, policy) -> None:
        convert = getattr(policy, "convert_input", None)
        if not callable(convert) or id(policy) in self._policies:
            return
        self._policies.add(id(policy))
        casts = layer_casts._CASTS

        def convert_input(x, *args, **kwargs):
            y = convert(x, *args, **kwargs)
            if self.active and y is not x and getattr(y, "dtype", None) != getattr(
                    x, "dtype", None):
                casts[id(y)] = (x, y)
            return y

        assert self._patches is not None  # (set by install)
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

        setattr(wrapped_call, layer_call_patch._PATCH_MARKER, True)
        return wrapped_call
