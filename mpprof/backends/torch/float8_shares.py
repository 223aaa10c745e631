"""FLOAT8_SHARES on PyTorch: not measured yet.

On TensorFlow and JAX the instrumented step measures, on sampled steps, the
shares of each float8 layer's inputs, kernel and gradient that saturate or
underflow its format (`mpprof.backends.float8_shares`). On PyTorch the
float8 layers' scales and amax histories are recorded (`float8`), their
shares not yet: the run context says so for a model with float8 layers.
"""

from __future__ import annotations

from mpprof.backends.float8_shares import Float8SharesCollector


class Float8Shares(Float8SharesCollector):
    """Says that the shares are not measured on PyTorch (arguments: as
    `mpprof.backends.float8_shares.Float8SharesCollector`)."""

    def context(self) -> dict:
        if not self._layers:
            return super().context()
        return {"state": "unavailable", "reason": (
            "the float8 layers' saturated and underflowing shares are not measured on "
            "PyTorch yet (their scales and amax histories are: see the float8 "
            "collector); train on TensorFlow or JAX to measure them")}
