"""Instance-level wrapping of `layer.call`, the one patch mpprof puts on layers.

`Operation.__call__` looks up `self.call`, so an instance attribute shadows the
class method for that layer alone; deleting the attribute restores it. The
wrapper runs each hook after the original `call` while the train step is
traced (or on every call when the model runs eagerly).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Protocol

_PATCH_MARKER = "_mpprof_wrapped"


class CallHook(Protocol):
    def on_call(self, layer, args: tuple, kwargs: dict, outputs):
        """Sees one call of `layer`; returns `outputs` (possibly replaced)."""


def walk_layers(model) -> list[tuple[str, object, str | None]]:
    """(qualified name, layer, parent's qualified name) of every nested layer.

    Depth first from `model` (not included); a layer reachable from several
    parents is listed once, under the first.
    """
    found: list[tuple[str, object, str | None]] = []
    seen: set[int] = set()

    def visit(parent, parent_name: str | None) -> None:
        for child in parent._flatten_layers(include_self=False, recursive=False):
            if id(child) in seen or type(child).__name__ == "InputLayer":
                continue
            seen.add(id(child))
            name = child.name if parent_name is None else f"{parent_name}/{child.name}"
            found.append((name, child, parent_name))
            visit(child, name)

    visit(model, None)
    return found


class LayerCallPatch:
    """Wraps `call` of `model` and every nested layer so that `hooks` see calls.

    Layers that a parent creates in its `build` (MultiHeadAttention's
    projections, say) do not exist before the first trace: the parent's
    wrapper patches them just before the parent's `call` runs.

    Args:
        model: the model whose layers to wrap.
        hooks: objects with `on_call(layer, args, kwargs, outputs)`, run in
            order after the original `call`.
    """

    def __init__(self, model, hooks: Sequence[CallHook]):
        self._model = model
        self._hooks = list(hooks)
        self._patched: list = []

    def add_hook(self, hook: CallHook) -> None:
        """Adds a hook; wrappers already installed see it from their next call."""
        self._hooks.append(hook)

    def install(self) -> None:
        self._patch(self._model)
        for _, layer, _ in walk_layers(self._model):
            self._patch(layer)

    def remove(self) -> None:
        for layer in self._patched:
            remove_patch(layer)
        self._patched.clear()

    def _patch(self, layer) -> None:
        remove_patch(layer)
        layer.call = self._wrap(layer, layer.call)
        self._patched.append(layer)

    def _patch_new_children(self, parent) -> None:
        for child in parent._flatten_layers(include_self=False, recursive=False):
            if not is_patched(child) and type(child).__name__ != "InputLayer":
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
    return getattr(layer.__dict__.get("call"), _PATCH_MARKER, False)


def remove_patch(layer) -> None:
    """Removes mpprof's wrapper from `layer.call`, if there is one."""
    if is_patched(layer):
        del layer.call
