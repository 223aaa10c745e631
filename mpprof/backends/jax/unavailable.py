"""The collectors the JAX backend does not implement yet: each says so in the
run context (`{"state": "unavailable", "reason": ...}`), so the diagnosis
reports its rules as "not measured" rather than judging from nothing."""

from __future__ import annotations

from mpprof.backends.float8_replay import NO_FLOAT8_LAYERS, float8_layers
from mpprof.recording.collectors.base import Collector

_NOT_YET = "not implemented on the JAX backend yet"
_SHARES_REASON = (
    "float8 shares of values on sampled steps are " + _NOT_YET + ": they need taps on the "
    "quantized tensors inside the instrumented step; the float8 state (scales, amax "
    "histories, each step's saturation and underflow from its amax) is recorded"
)


class Float8Shares(Collector):
    """Float8 saturation/underflow shares on sampled steps (TensorFlow:
    `backends/tensorflow/float8_shares.py`). The float8 state, with each
    step's saturation and underflow judged from its amax, is recorded
    (`mpprof.backends.jax.float8`)."""

    name = "float8_shares"

    def __init__(self, model, sampling: bool):
        self._float8 = bool(float8_layers(model))

    def instrument(self, on: bool) -> None:
        """(Nothing is tapped on JAX.)"""

    def context(self) -> dict:
        if not self._float8:
            return dict(NO_FLOAT8_LAYERS)
        return {"state": "unavailable", "reason": _SHARES_REASON}
