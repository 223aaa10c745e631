"""The collectors the JAX backend does not implement yet: each says so in the
run context (`{"state": "unavailable", "reason": ...}`), so the diagnosis
reports its rules as "not measured" rather than judging from nothing."""

from __future__ import annotations

from mpprof.recording.collectors.base import Collector

_NOT_YET = "not implemented on the JAX backend yet"


def _float8_layers(model) -> list:
    return [layer for layer in model._flatten_layers(include_self=False, recursive=True)
            if getattr(layer, "quantization_mode", None) == "float8"]


class Float8State(Collector):
    """Float8 scales and amax histories (TensorFlow: `backends/tensorflow/float8.py`)."""

    name = "float8"

    def __init__(self, model, loss_scales):
        self._float8 = bool(_float8_layers(model))

    def context(self) -> dict:
        if not self._float8:
            return {"state": "absent", "reason": "no float8 layers (model.quantize('float8'))"}
        return {"state": "unavailable", "reason": f"float8 scaling records are {_NOT_YET}"}


class Float8Shares(Float8State):
    """Float8 saturation/underflow shares on sampled steps."""

    name = "float8_shares"

    def __init__(self, model, sampling: bool):
        super().__init__(model, None)

    def instrument(self, on: bool) -> None:
        """(Nothing is tapped on JAX.)"""
