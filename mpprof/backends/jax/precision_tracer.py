"""The precision inventory on JAX: every layer's dtypes, float32 islands and casts.

Policies are read from the layers (`mpprof.backends.layer_records`); the
dtypes each layer ACTUALLY outputs, the call order, which layers feed which
and the casts between them are seen while `jax.jit` traces the train step,
through the layer wrappers of `LayerCallPatch`: the values a layer sees then
are tracers, whose dtype is the one the compiled step computes in. Tracing
happens once, so this costs nothing per step.

What TensorFlow's graph tells and a JAX trace does not: the op that made a
model output (`final_op` is None: the rule that reads it then judges from
the layer's activation alone) and whether an input was computed by a
parent's own ops (a layer input of no known producer that is not the data).
"""

from __future__ import annotations

import jax

from mpprof.backends.layer_casts import CastTracer


class PrecisionTracer(CastTracer):
    """Builds the precision inventory of `model`; a `LayerCallPatch` hook."""

    def _values(self, structure) -> list:
        return [t for t in jax.tree_util.tree_leaves(structure) if isinstance(t, jax.Array)]

    def _followed(self, values: list) -> list:
        """The values of the function being traced (a layer may also be called
        on a concrete array it keeps)."""
        return [t for t in values if isinstance(t, jax.core.Tracer)]

    def _dtype_name(self, value) -> str:
        return jax.numpy.dtype(value.dtype).name
