"""Instance-level wrapping of the method each layer's `__call__` runs, for
every backend (framework-free: what a backend adds around each call is its
own subclass's, in its `layer_calls.py`).

`Operation.__call__` looks up `self.call`, or `self.quantized_call` for a
quantized layer (`model.quantize("float8")`, "int8", "int4", ...: its
`quantization_mode` is set), so an instance attribute shadows the class
method for that layer alone (`called_method` names the one). The patches go
through the fit's `mpprof.backends.patching.Patches`, which undoes them with
every other patch. The wrapper runs each hook after the original method
while the train step is traced (or on every call when the model runs
eagerly): a hook costs nothing per step of a compiled step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from mpprof.backends.layer_records import called_method, child_layers, walk_layers
from mpprof.backends.patching import Patches
from mpprof.backends.protocol import LayerCallHook

_PATCH_MARKER = "_mpprof_wrapped"


class LayerCallPatch:
    """Wraps the called method (`called_method`) of `model` and every nested
    layer so that `hooks` see calls (`mpprof.backends.protocol.LayerCallPatch`).

    Layers that a parent creates in its `build` (MultiHeadAttention's
    projections, say) do not exist before the first trace: the parent's
    wrapper patches them just before the parent's `call` runs.

    Args:
        model: the model whose layers to wrap.
        hooks: objects with `on_call(layer, args, kwargs, outputs)`, run in
            order after the original `call`.
    """

    def __init__(self, model, hooks: Sequence[LayerCallHook]):
        self._model = model
        self._hooks = list(hooks)
        self._patches: Patches | None = None
        # Layers wrapped for this fit, by id: another collector's wrapper
        # over the same method (float8_shares' over `quantized_call`) hides
        # the marker of this one, and the layer must not be wrapped twice.
        self._wrapped: set[int] = set()

    def add_hook(self, hook: LayerCallHook) -> None:
        """Adds a hook; wrappers already installed see it from their next call."""
        self._hooks.append(hook)

    def install(self, patches: Patches) -> None:
        """Wraps every layer there is now, and later its new children, through
        `patches` (restoring them unwraps every layer)."""
        self._patches = patches
        self._wrapped.clear()
        self._patch(self._model)
        for _, layer, _ in walk_layers(self._model):
            self._patch(layer)

    # What a backend adds.

    def _call(self, call: Callable, args: tuple, kwargs: dict) -> Any:
        """Runs the original method (a backend may keep state around it)."""
        return call(*args, **kwargs)

    def _patched(self, layer) -> None:
        """`layer` was just wrapped (a backend may patch more of it)."""

    def _patch(self, layer) -> None:
        # A wrapper left behind by a profiler that never ended must not be
        # wrapped again, nor put back when this fit's patches are undone.
        method = called_method(layer)
        if is_patched(layer):
            delattr(layer, method)
        assert self._patches is not None  # (set by install)
        self._patches.set(layer, method, self._wrap(layer, getattr(layer, method)))
        self._wrapped.add(id(layer))
        self._patched(layer)

    def _patch_new_children(self, parent) -> None:
        for child in child_layers(parent):
            if id(child) not in self._wrapped and type(child).__name__ != "InputLayer":
                self._patch(child)

    def _wrap(self, layer, call: Callable) -> Callable:
        hooks = self._hooks

        @functools.wraps(call)
        def wrapped_call(*args, **kwargs):
            self._patch_new_children(layer)
            outputs = self._call(call, args, kwargs)
            for hook in hooks:
                outputs = hook.on_call(layer, args, kwargs, outputs)
            return outputs

        setattr(wrapped_call, _PATCH_MARKER, True)
        return wrapped_call


def is_patched(layer) -> bool:
    """Whether the method `layer.__call__` runs is an mpprof wrapper."""
    return getattr(layer.__dict__.get(called_method(layer)), _PATCH_MARKER, False)
