"""Instance-level wrapping of the method each layer's `__call__` runs.

`Operation.__call__` looks up `self.call`, or `self.quantized_call` for a
quantized layer (`model.quantize("float8")`, "int8", "int4", ...: its
`quantization_mode` is set), so an instance attribute shadows the class
method for that layer alone (`called_method` names the one). The patches go
through the fit's `mpprof.recording.patching.Patches`, which undoes them with every
other patch. The wrapper runs each hook after the original method while the
train step is traced (or on every call when the model runs eagerly), and
keeps the graph each call started in, so that a hook can tell whether its
layer was called inside control flow of its enclosing layer
(`control_flow_inside_caller`).
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Sequence
from typing import Protocol

import tensorflow as tf

from mpprof.backends.layer_records import called_method, walk_layers
from mpprof.recording.patching import Patches

_PATCH_MARKER = "_mpprof_wrapped"

# The graphs in which the calls of wrapped layers now under way started,
# outermost first: a hook, run after its layer's call, finds its caller's
# (the enclosing layer's) graph last.
_CALL_GRAPHS: contextvars.ContextVar[tuple] = contextvars.ContextVar(
    "mpprof_call_graphs", default=()
)


class CallHook(Protocol):
    def on_call(self, layer, args: tuple, kwargs: dict, outputs):
        """Sees one call of `layer`; returns `outputs` (possibly replaced)."""


class LayerCallPatch:
    """Wraps the called method (`called_method`) of `model` and every nested
    layer so that `hooks` see calls.

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
        self._patches: Patches | None = None
        # Layers wrapped for this fit, by id: another collector's wrapper
        # over the same method (float8_shares' over `quantized_call`) hides
        # the marker of this one, and the layer must not be wrapped twice.
        self._wrapped: set[int] = set()

    def add_hook(self, hook: CallHook) -> None:
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

    def _patch(self, layer) -> None:
        # A wrapper left behind by a profiler that never ended must not be
        # wrapped again, nor put back when this fit's patches are undone.
        method = called_method(layer)
        if is_patched(layer):
            delattr(layer, method)
        self._patches.set(layer, method, self._wrap(layer, getattr(layer, method)))
        self._wrapped.add(id(layer))

    def _patch_new_children(self, parent) -> None:
        for child in parent._flatten_layers(include_self=False, recursive=False):
            if id(child) not in self._wrapped and type(child).__name__ != "InputLayer":
                self._patch(child)

    def _wrap(self, layer, call: Callable) -> Callable:
        hooks = self._hooks

        @functools.wraps(call)
        def wrapped_call(*args, **kwargs):
            self._patch_new_children(layer)
            graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
            token = _CALL_GRAPHS.set((*_CALL_GRAPHS.get(), graph))
            try:
                outputs = call(*args, **kwargs)
            finally:
                _CALL_GRAPHS.reset(token)
            for hook in hooks:
                outputs = hook.on_call(layer, args, kwargs, outputs)
            return outputs

        setattr(wrapped_call, _PATCH_MARKER, True)
        return wrapped_call


def is_patched(layer) -> bool:
    """Whether the method `layer.__call__` runs is an mpprof wrapper."""
    return getattr(layer.__dict__.get(called_method(layer)), _PATCH_MARKER, False)


def control_flow_inside_caller() -> str | None:
    """For a hook: the control-flow body its layer was called in, below the
    graph its enclosing layer's call started in ("a tf.while_loop body", "a
    tf.cond branch"), or None.

    TensorFlow marks the FuncGraphs of `tf.while_loop` and `tf.cond` bodies
    with `is_control_flow_graph`. Only control flow opened inside the
    enclosing layer counts: a whole train step that runs in a loop (tf-keras
    with `steps_per_execution > 1`) computes its gradients inside that loop.
    """
    if tf.executing_eagerly():
        return None
    callers = _CALL_GRAPHS.get()
    caller = callers[-1] if callers else None
    graph = tf.compat.v1.get_default_graph()
    while graph is not None and graph is not caller:
        if getattr(graph, "is_control_flow_graph", False):
            kind = type(graph).__name__
            if kind.startswith("While"):
                return "a tf.while_loop body"
            if kind.startswith("Cond"):
                return "a tf.cond branch"
            return f"a control-flow body ({kind})"
        graph = getattr(graph, "outer_graph", None)
    return None
