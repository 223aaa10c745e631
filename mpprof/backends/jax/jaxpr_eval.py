"""Evaluates a replay's jaxpr equation by equation and finds the first
forward and the first backward equation whose floating output is non-finite
or beyond its dtype's maximum (`mpprof.backends.jax.replay_engine`).

Where an equation ran is read from its name stack: the innermost
`mpprof_layer_<row>` scope is its layer, a `transpose(...)` marks the
backward pass, and `mpprof_optimizer` an optimizer's update, whose handling
of non-finite gradients (a LossScaleOptimizer skipping) is deliberate and
never the culprit. Once an update has run after an offender, nothing later
is judged: later values come from weights that update made from bad
gradients (or left unchanged), not from the step's own computation.

Call-like equations (`jit`, custom JVP/VJP calls, remat) are entered. Control
flow runs whole; when a `scan` (a recurrent layer's loop) or a `cond` gives a
bad output, its body is run again step by step to name the equation inside
it (a body's equations belong to the layer that ran the loop).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

try:
    from jax.extend.core import DropVar
except ImportError:  # older JAX (0.4.36) has it in jax.core only
    from jax.core import DropVar

from mpprof.backends.jax.numerics_taps import float_output
from mpprof.replay import search
from mpprof.replay.search import BETWEEN_LAYERS, LOSS, Offender

# The scopes the replay opens while the step is traced.
LAYER_SCOPE = "mpprof_layer_"
MODEL_SCOPE = "mpprof_model"
OPTIMIZER_SCOPE = "mpprof_optimizer"
_LAYER_SCOPE_RE = re.compile(r"mpprof_layer_(\d+)")
# Call-like primitives whose inner equations are evaluated one by one; the
# parameter holding their (closed) jaxpr.
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
          "core_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
          "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
          "remat": "jaxpr", "checkpoint": "jaxpr"}


def scoped_layer_call(row: int, call, tap):
    """`call` (a layer's) in its `mpprof_layer_<row>` scope, its first
    floating output (the one a replay compares) replaced by `tap(output)`."""

    def scoped_call(*args, **kwargs):
        with jax.named_scope(f"{LAYER_SCOPE}{row}"):
            outputs = call(*args, **kwargs)
        found = float_output(outputs)
        if found is None:
            return outputs
        flat, structure, position = found
        flat[position] = tap(flat[position])
        return jax.tree_util.tree_unflatten(structure, flat)

    return scoped_call


class Evaluator:
    """Evaluates a closed jaxpr, finding the first forward and the first
    backward equation with a bad floating output.

    Args:
        names: layer names by row (the rows of the `mpprof_layer_<row>` scopes).
    """

    def __init__(self, names: list[str]):
        self._names = names
        self.offenders: dict[str, Offender] = {}
        self._cast_pending = False
        self._frozen = False

    def run(self, closed, arguments: list) -> tuple[list, dict[str, Offender]]:
        """Returns the jaxpr's outputs and the offenders by phase."""
        outputs = self._eval(closed.jaxpr, closed.consts, arguments, "")
        return outputs, self.offenders

    def _eval(self, jaxpr, consts, arguments, prefix: str) -> list:
        env = {}

        def read(var):
            return var.val if isinstance(var, Literal) else env[var]

        for var, value in zip(jaxpr.constvars, consts, strict=True):
            env[var] = value
        for var, value in zip(jaxpr.invars, arguments, strict=True):
            env[var] = value
        for eqn in jaxpr.eqns:
            inputs = [read(v) for v in eqn.invars]
            stack = f"{prefix}/{eqn.source_info.name_stack}".strip("/")
            inner = _CALLS.get(eqn.primitive.name)
            sub = eqn.params.get(inner) if inner else None
            if sub is not None and (hasattr(sub, "eqns") or hasattr(sub, "consts")):
                outputs = self._eval(getattr(sub, "jaxpr", sub), getattr(sub, "consts", []),
                                     inputs, stack)
            else:
                outputs = _bind(eqn, inputs)
                if not eqn.primitive.multiple_results:
                    outputs = [outputs]
                self._check(eqn, stack, inputs, outputs)
            for var, value in zip(eqn.outvars, outputs, strict=True):
                if not isinstance(var, DropVar):
                    env[var] = value
        return [read(v) for v in jaxpr.outvars]

    def _layer(self, stack: str) -> str | None:
        rows = _LAYER_SCOPE_RE.findall(stack)
        return self._names[int(rows[-1])] if rows else None

    def _check(self, eqn, stack: str, inputs, outputs) -> None:
        if OPTIMIZER_SCOPE in stack:
            # An update ran: after an offender, what follows is its fallout.
            self._frozen = self._frozen or bool(self.offenders)
            return
        if self._frozen:
            return
        phase = "backward" if "transpose(" in stack else "forward"
        layer = self._layer(stack)
        if self._cast_pending and phase == "forward":
            # An offending cast outside any layer, just before a layer's
            # call: that layer's input cast (`Layer.__call__`).
            self._cast_pending = False
            if layer is not None:
                self.offenders["forward"].layer = layer
        if phase in self.offenders:
            return
        for output in outputs:
            if not _is_float(output):
                continue
            values = np.asarray(output)
            problem = search.problem(values, np.dtype(output.dtype).name)
            if problem is None:
                continue
            if eqn.primitive.name in _BODIES:
                # Name the equation inside the loop or branch, if one is bad.
                _BODIES[eqn.primitive.name](self, eqn, inputs, stack)
                if phase in self.offenders:
                    return
            where = layer or (BETWEEN_LAYERS if MODEL_SCOPE in stack else LOSS)
            self.offenders[phase] = Offender(
                layer=where, op=eqn.primitive.name, phase=phase,
                input_abs_max=[search.abs_max(np.asarray(t)) for t in inputs if _is_float(t)],
                output=problem, dtype=np.dtype(output.dtype).name)
            self._cast_pending = (phase == "forward" and layer is None
                                  and eqn.primitive.name == "convert_element_type")
            return

    def _scan_body(self, eqn, inputs, stack: str) -> None:
        """Runs a `scan`'s body iteration by iteration (as `lax.scan` does)
        until one of its equations offends."""
        params = eqn.params
        body = params["jaxpr"]
        consts_count, carry_count = params["num_consts"], params["num_carry"]
        consts = inputs[:consts_count]
        carry = inputs[consts_count:consts_count + carry_count]
        xs = inputs[consts_count + carry_count:]
        found = len(self.offenders)
        steps = range(params["length"])
        for t in (reversed(steps) if params["reverse"] else steps):
            outputs = self._eval(body.jaxpr, body.consts,
                                 [*consts, *carry, *(x[t] for x in xs)], stack)
            carry = outputs[:carry_count]
            if len(self.offenders) > found:
                return

    def _cond_branch(self, eqn, inputs, stack: str) -> None:
        """Runs the branch a `cond` took, equation by equation."""
        branch = eqn.params["branches"][int(np.asarray(inputs[0]))]
        self._eval(branch.jaxpr, branch.consts, inputs[1:], stack)


_BODIES = {"scan": Evaluator._scan_body, "cond": Evaluator._cond_branch}


def _bind(eqn, inputs):
    """Runs one equation whole (as `jax.core.eval_jaxpr` does)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(params, tuple):  # (subfuns, params) before JAX 0.7
        subfuns, params = params
        return eqn.primitive.bind(*subfuns, *inputs, **params)
    return eqn.primitive.bind(*inputs, **params)


def _is_float(value) -> bool:
    dtype = getattr(value, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)
