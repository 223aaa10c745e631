"""The wrapping of every layer's call on the Keras 3 backends that run the
step in Python (JAX, PyTorch): the shared wrapper
(`mpprof.backends.layer_call_patch`), and the casts each layer's dtype
policy makes, remembered so that the precision tracer finds the layer a cast
input came from (`cast_source`). JAX uses it as it is (its hooks run while
`jax.jit` traces the step, once per traced function, so they cost nothing
per step); PyTorch switches it on only for the calls that need it
(`mpprof.backends.torch.layer_calls`). Imports no framework.
"""

from __future__ import annotations

from mpprof.backends import layer_call_patch
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
