"""The wrapping of every layer's call on the Keras 3 backends that run the
step in Python (JAX, PyTorch): the shared wrapper
(`mpprof.backends.layer_call_patch`), and the casts each layer's dtype
policy makes, remembered so that the precision tracer finds the layer a cast
input came from (`cast_source`). JAX uses it as it is (its hooks run while
`jax.jit` traces the step, once per traced function, so they cost nothing
per step); PyTorch switches it on only for the calls that need it
(`mpprof.backends.torch.layer_calls`). And the precision tracer both build on
those wrappers (`CastTracer`). Imports no framework.
"""

from __future__ import annotations

from mpprof.backends import layer_call_patch
from mpprof.backends.layer_records import InventoryBuilder
from mpprof.backends.patching import Patches

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


class LayerCallPatch(layer_call_patch.LayerCallPatch):
    """The shared wrapper (`mpprof.backends.layer_call_patch`), remembering
    the casts each layer's dtype policy makes (`cast_source`)."""

    def install(self, patches: Patches) -> None:
        self._policies: set[int] = set()
        clear_casts()
        super().install(patches)

    def _patched(self, layer) -> None:
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

        assert self._patches is not None  # (set by install)
        self._patches.set(policy, "convert_input", convert_input)


class CastTracer(InventoryBuilder):
    """The precision inventory from the values each layer call sees (JAX's
    tracers, PyTorch's tensors); a `LayerCallPatch` hook. A value's producer
    is the layer that output it, looked up by id (kept with the value, so a
    reused id is never taken for it); behind a cast of a layer's input
    conversion, the value it was cast from (`cast_source`).

    A subclass says what the framework's values are:
    `_values(structure)`, the arrays of a nest (a layer's outputs, or its
    args and kwargs); `_followed(values)`, those of the step (JAX: the
    tracers, not a concrete array a layer keeps); `_dtype_name(value)`.
    """

    def _values(self, structure) -> list:
        raise NotImplementedError

    def _followed(self, values: list) -> list:
        return values

    def _dtype_name(self, value) -> str:
        raise NotImplementedError

    def _producer(self, value) -> int | None:
        entry = self._producers.get(id(value))
        return entry[0] if entry is not None and entry[1] is value else None

    def on_call(self, layer, args, kwargs, outputs):
        key = id(layer)
        flat_outputs = self._values(outputs)
        dtypes = {self._dtype_name(t) for t in flat_outputs}
        followed_outputs = self._followed(flat_outputs)
        if layer is self._model:
            self._model_output_dtypes |= dtypes
            if followed_outputs and not self._outputs:
                self._outputs = [
                    {"producer": self._producer(t), "final_op": None,
                     "units": int(t.shape[-1]) if t.ndim else None}
                    for t in followed_outputs
                ]
        else:
            self._layer_output(key, dtypes, flat_outputs)
        producers = self._inputs_from.setdefault(key, {})
        for value in self._followed(self._values((args, kwargs))):
            source = cast_source(value)
            producer = self._producer(source if source is not None else value)
            if source is not None:
                self._casts.setdefault((key, producer, self._dtype_name(source),
                                        self._dtype_name(value)), None)
            if producer is not None and producer != key:
                producers.setdefault(producer, None)
        for value in followed_outputs:
            self._producers[id(value)] = (key, value)
        return outputs
