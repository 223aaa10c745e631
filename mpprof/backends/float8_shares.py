"""Float8 saturation and underflow shares on sampled steps: what the backends'
`Float8Shares` collectors share, framework-free.

On the steps the numerics schedule samples, each float8 layer's three
quantized tensors are measured as Keras quantizes them
(`keras.quantizers.quantize_and_dequantize`: `x / scale` in the compute
dtype, clipped to the format's max, cast to float8, rounding to nearest
even), with the scale the step quantizes with:

- inputs (e4m3): the `inputs` its `quantized_call` receives (already in the
  compute dtype), with `inputs_scale`;
- kernel (e4m3): the kernel, with `kernel_scale`;
- output gradient (e5m2): the gradient flowing into the layer's activation,
  with `outputs_grad_scale`. Keras quantizes the gradient of the matmul's
  output; the bias add between the two passes it through unchanged.

A value saturates where its quotient is beyond the format's max, and a
non-zero value quantizes to zero where its quotient is at most half the
smallest subnormal (round to nearest even; a float16 quotient that
underflows float16 itself included). Each backend computes these counts in
its step (`quantization_counts` in `mpprof.backends.tensorflow.float8_shares`
and `mpprof.backends.jax.float8_shares`); this module holds the wrapping of
the layers, the limits, and the writing of the records.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np

from mpprof.backends.collector import Collector
from mpprof.backends.float8_replay import NO_FLOAT8_LAYERS, float8_layers
from mpprof.backends.traced_guard import TracedGuard
from mpprof.dtypes import FLOAT8_RANGES
from mpprof.records import schema

COLUMN = schema.FLOAT8_SHARE_COLUMN
# The leading columns of a row add up (counts); the others take the maximum.
COUNTS = len(schema.FLOAT8_SHARE_COUNT_COLUMNS)
TENSOR = {name: index for index, name in enumerate(schema.FLOAT8_TENSORS)}


def quantization_limits(fmt: str) -> tuple[float, float]:
    """(the format's max, half its smallest subnormal): a quotient beyond the
    first saturates, a non-zero one at most the second quantizes to zero.

    Args:
        fmt: the float8 format, a key of `mpprof.dtypes.FLOAT8_RANGES`.
    """
    limits = FLOAT8_RANGES[fmt]
    return limits.max, limits.smallest_subnormal / 2


def merge_rows(rows: np.ndarray, axis: int) -> np.ndarray:
    """FLOAT8_SHARE_COLUMNS rows merged along `axis` (a layer's calls): the
    counts add up, the scale and the largest magnitude take the maximum.

    Args:
        rows: float [..., len(FLOAT8_SHARE_COLUMNS)].
        axis: the axis to merge (not the last).
    """
    return np.concatenate([rows[..., :COUNTS].sum(axis=axis),
                           rows[..., COUNTS:].max(axis=axis)], axis=-1)


class Float8SharesCollector(Collector):
    """Writes a FLOAT8_SHARES record for each sampled step of a float8 model.

    Keras calls a quantized layer through its `quantized_call`, not its
    `call`: each float8 layer's `quantized_call` is wrapped at instance level
    for the fit (`wrap`). While the instrumented train step is traced (a
    backend's `_begin_call` says so), the wrapper measures the layer's inputs
    and kernel (`_measure_forward`), and wraps the layer's activation for the
    length of that call so that the gradient Keras quantizes is measured on
    its way back (`_gradient_tap`). What a backend's taps raise is reported
    through `traced` and never reaches the user's step.

    Args:
        model: the model being fit.
        sampling: whether the fit samples steps at all (`numerics_every`).
    """

    name = "float8_shares"

    def __init__(self, model, sampling: bool):
        self._layers = float8_layers(model)
        self._sampling = sampling
        self.traced = TracedGuard()
        self._ok = lambda: True
        self._samples = 0
        self._tapping_lock = threading.Lock()
        self._tapping_calls: dict[int, int] = {}

    def _guard(self, fit) -> None:
        """Reports what the traced taps raise to the fit's guard."""
        self.traced.on_error = lambda error: fit.guard.fail(self.name, error)
        self._ok = lambda: fit.guard.ok(self.name)

    def instrument(self, on: bool) -> None:
        """The sampled call about to run (`on`), or its end: a backend whose
        taps cannot tell the instrumented trace by themselves notes it."""

    # The backend's taps, while the step is traced.

    def _begin_call(self, row: int, inputs) -> bool:
        """Whether this call of the layer at `row` is measured."""
        raise NotImplementedError

    def _measure_forward(self, row: int, layer, inputs) -> None:
        """Measures the call's inputs and the layer's kernel."""
        raise NotImplementedError

    def _gradient_tap(self, tensor, row: int, layer):
        """`tensor`, whose gradient is measured against the layer's
        `outputs_grad_scale` as the step uses it."""
        raise NotImplementedError

    def wrap(self, layer, row: int, quantized_call):
        """`layer.quantized_call`, measured on the instrumented step."""
        activation = getattr(layer, "activation", None)
        tapped_activation = None
        if callable(activation):
            # One tapped activation per layer, whichever replica calls it: the
            # tap reads the scale and the replica context where it runs.
            def tapped_activation(x):
                tapped = self.traced(lambda: self._gradient_tap(x, row, layer))
                return activation(x if tapped is None else tapped)

        def measured_quantized_call(*args, **kwargs):
            inputs = args[0] if args else kwargs["inputs"]
            if not self._ok() or not self.traced(lambda: self._begin_call(row, inputs)):
                return quantized_call(*args, **kwargs)
            self.traced(lambda: self._measure_forward(row, layer, inputs))
            if tapped_activation is None:
                # No activation to wrap: the output is the matmul's (plus the bias).
                outputs = quantized_call(*args, **kwargs)
                tapped = self.traced(lambda: self._gradient_tap(outputs, row, layer))
                return outputs if tapped is None else tapped
            with self._tapping(layer, row, activation, tapped_activation):
                return quantized_call(*args, **kwargs)

        return measured_quantized_call

    @contextlib.contextmanager
    def _tapping(self, layer, row: int, activation, tapped_activation):
        """`layer.activation` is `tapped_activation` for the length of the call.

        Set for the call alone, so that a checkpoint saving the layer's config
        never sees the wrapper. MirroredStrategy traces each replica in its
        own thread, and an all-reduce in a hook inside the call (the layer's
        numerics) hands over to the next replica mid-call: the layer's own
        activation is put back only when the last replica's call ends, and
        never read back from the layer (where it may be the tapped one).
        """
        with self._tapping_lock:
            self._tapping_calls[row] = self._tapping_calls.get(row, 0) + 1
            layer.activation = tapped_activation
        try:
            yield
        finally:
            with self._tapping_lock:
                self._tapping_calls[row] -= 1
                if not self._tapping_calls[row]:
                    layer.activation = activation

    # After each sampled call.

    def write(self, fit, rows: np.ndarray) -> None:
        """Writes the sampled call's rows [layers, tensors, columns], unless
        no float8 layer was measured in it."""
        if not rows[..., COLUMN.count].any():
            return
        fit.writer.write_array(schema.FLOAT8_SHARES, rows, fit.sample_step)
        self._samples += 1

    def context(self) -> dict:
        if not self._layers:
            return dict(NO_FLOAT8_LAYERS)
        if not self._sampling:
            return {"state": "off", "reason": "numerics_every=None: no step is sampled"}
        return {"state": "ok", "samples": self._samples}
