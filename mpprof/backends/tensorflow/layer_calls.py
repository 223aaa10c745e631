"""The wrapping of every layer's call on TensorFlow: the shared wrapper
(`mpprof.backends.layer_call_patch`) keeps the graph each call started in,
so that a hook can tell whether its layer was called inside control flow of
its enclosing layer (`control_flow_inside_caller`).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable

import tensorflow as tf

from mpprof.backends import layer_call_patch

# (Imported from here by the replay engine and its passes.)
from mpprof.backends.layer_records import called_method, walk_layers  # noqa: F401

# The graphs in which the calls of wrapped layers now under way started,
# outermost first: a hook, run after its layer's call, finds its caller's
# (the enclosing layer's) graph last.
_CALL_GRAPHS: contextvars.ContextVar[tuple] = contextvars.ContextVar(
    "mpprof_call_graphs", default=()
)


class LayerCallPatch(layer_call_patch.LayerCallPatch):
    """The shared wrapper (`mpprof.backends.layer_call_patch`), keeping the
    graph each call started in (`control_flow_inside_caller`)."""

    def _call(self, call: Callable, args: tuple, kwargs: dict):
        graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        token = _CALL_GRAPHS.set((*_CALL_GRAPHS.get(), graph))
        try:
            return call(*args, **kwargs)
        finally:
            _CALL_GRAPHS.reset(token)


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
