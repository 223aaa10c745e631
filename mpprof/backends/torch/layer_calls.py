"""The wrapping of every layer's call on PyTorch: the shared wrapper
(`mpprof.backends.layer_call_patch`) with JAX's cast memory
(`mpprof.backends.layer_casts`, shared with JAX), switched by `active`.
On JAX the hooks run while the step is traced, once; on PyTorch every step
calls the wrappers, so their hooks (and the cast memory) run only while the
patch is `active` (the first call, which fills the precision inventory, and
sampled calls): other steps pay one attribute test per layer call.

Inside the `profile_steps` window (`kernels.ProfileWindow` switches
`ranges` on and off) each layer call is also a `torch.profiler`
range named `LAYER_RANGE` + the layer's path, which ties the trace's ops to
their layer (`kernels.op_layers`); outside it the same one attribute test
is all a call pays. A model compiled with `jit_compile=True` gets no
ranges (`ranges_off`): switching them on would change what torch.compile
traced.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from mpprof.backends import layer_call_patch, layer_casts
from mpprof.backends.layer_casts import cast_source, clear_casts

__all__ = ["COMPILED", "LAYER_RANGE", "LayerCallPatch", "cast_source", "clear_casts"]

# The prefix of a layer call's profiler range: no user's range or op starts so.
LAYER_RANGE = "mpprof.layer:"

# Why a compiled model's layer calls are no ranges (`LayerCallPatch.ranges_off`).
COMPILED = ("jit_compile=True: the ops carry no layer (layer ranges switched on in the "
            "window would make torch.compile recompile the step and could change its "
            "fusion, so the traced kernels would not be those of the other steps)")


class LayerCallPatch(layer_casts.LayerCallPatch):
    """As `mpprof.backends.layer_casts.LayerCallPatch`, with `active` (the
    hooks run) and `ranges` (each call is a profiler range).

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
        self._active = True
        self._ranges = False
        # What the wrappers test first: neither hooks nor ranges, the call alone.
        self._plain = False
        if backend is not None:
            backend.layer_patch = self

    @property
    def active(self) -> bool:
        """Whether the hooks (and the cast memory) run."""
        return self._active

    @active.setter
    def active(self, on: bool) -> None:
        self._active = on
        self._plain = not (on or self._ranges)

    @property
    def ranges(self) -> bool:
        """Whether each layer call is a `torch.profiler` range (`LAYER_RANGE`)."""
        return self._ranges

    @ranges.setter
    def ranges(self, on: bool) -> None:
        self._ranges = on
        self._plain = not (self._active or on)

    @property
    def ranges_off(self) -> str | None:
        """Why the layer calls may not be ranges (`COMPILED`: the model's step
        runs under torch.compile, whose guards see the switch), or None."""
        return COMPILED if getattr(self._model, "jit_compile", False) else None

    def _watch_casts(self, policy) -> None:
        convert = getattr(policy, "convert_input", None)
        if not callable(convert) or id(policy) in self._policies:
            return
        self._policies.add(id(policy))
        casts = layer_casts._CASTS

        def convert_input(x, *args, **kwargs):
            y = convert(x, *args, **kwargs)
            if self._active and y is not x and getattr(y, "dtype", None) != getattr(
                    x, "dtype", None):
                casts[id(y)] = (x, y)
            return y

        assert self._patches is not None  # (set by install)
        self._patches.set(policy, "convert_input", convert_input)

    def _wrap(self, layer, call: Callable) -> Callable:
        hooks = self._hooks

        def hooked_call(args, kwargs):
            if not self._active:
                return call(*args, **kwargs)
            self._patch_new_children(layer)
            outputs = call(*args, **kwargs)
            for hook in hooks:
                outputs = hook.on_call(layer, args, kwargs, outputs)
            return outputs

        @functools.wraps(call)
        def wrapped_call(*args, **kwargs):
            if self._plain:
                return call(*args, **kwargs)
            if self._ranges:
                # (A layer has its path once built; the name stands in before.)
                with torch.profiler.record_function(LAYER_RANGE + (layer.path or layer.name)):
                    return hooked_call(args, kwargs)
            return hooked_call(args, kwargs)

        setattr(wrapped_call, layer_call_patch._PATCH_MARKER, True)
        return wrapped_call
