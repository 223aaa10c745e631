"""Float8 saturation and underflow shares on sampled steps, on PyTorch (what
is measured, and how the layers are wrapped: `mpprof.backends.float8_shares`).

The step runs eagerly: while a sampled call runs (`instrument(True)`), each
wrapped `quantized_call` measures its inputs and kernel as it is called, and
a tensor hook on the activation's input (`Tensor.register_hook`) measures
the gradient flowing back into the layer during `loss.backward()`, against
`outputs_grad_scale` as the step quantizes with it (read as the layer is
called, before the step's update). The rows stay on the device until the
call is done, then reach the host in one copy. Other calls measure nothing.
"""

from __future__ import annotations

import numpy as np
import torch

from mpprof.backends.float8_shares import (
    COUNTS,
    TENSOR,
    Float8SharesCollector,
    quantization_limits,
)
from mpprof.backends.patching import Patches
from mpprof.records import schema


def quantization_counts(values: torch.Tensor, scale, fmt: str) -> torch.Tensor:
    """`schema.FLOAT8_SHARE_COLUMNS` of one tensor quantized as Keras does
    (`x / scale` in the compute dtype): float32 [columns], on its device."""
    with torch.no_grad():
        x = values.detach().reshape(-1)
        scale = torch.as_tensor(scale, device=x.device)
        fmax, half_smallest = quantization_limits(fmt)
        quotient = (x / scale.to(x.dtype)).abs()
        nonzero = x != 0
        magnitude = x.abs()
        largest = torch.where(torch.isfinite(x), magnitude, torch.zeros_like(magnitude))
        return torch.stack([
            torch.tensor(float(x.numel()), device=x.device),
            nonzero.sum(dtype=torch.float32),
            (quotient > fmax).sum(dtype=torch.float32),
            (nonzero & (quotient <= half_smallest)).sum(dtype=torch.float32),
            scale.to(torch.float32).reshape(()),
            (largest.max() if x.numel() else torch.zeros((), device=x.device)).float(),
        ])


def _scale_of(variable) -> torch.Tensor:
    """A scale variable's value now (a copy: the update overwrites it)."""
    return variable.value.detach().clone()


class Float8Shares(Float8SharesCollector):
    """FLOAT8_SHARES on PyTorch, measured as the sampled step runs.

    Args:
        model: the model being fit.
        sampling: whether the fit samples steps at all (`numerics_every`).
    """

    def __init__(self, model, sampling: bool):
        super().__init__(model, sampling)
        self.instrumenting = False
        self._installed = False
        # (row, tensor, counts on the device) measured in the sampled call.
        self._rows: list[tuple[int, int, torch.Tensor]] = []

    def install(self, fit, patches: Patches) -> None:
        if not self._layers or not self._sampling:
            return
        self._guard(fit)
        for row, layer in enumerate(self._layers):
            patches.set(layer, "quantized_call", self.wrap(layer, row, layer.quantized_call))
        self._installed = True

    def instrument(self, on: bool) -> None:
        self.instrumenting = on and self._installed

    def _begin_call(self, row: int, inputs) -> bool:
        return self.instrumenting

    def _measure_forward(self, row: int, layer, inputs) -> None:
        kernel = layer._kernel.value if hasattr(layer._kernel, "value") else layer._kernel
        self._record(row, "inputs", inputs, _scale_of(layer.inputs_scale))
        self._record(row, "kernel", kernel.to(getattr(torch, layer.compute_dtype)),
                     _scale_of(layer.kernel_scale))

    def _gradient_tap(self, tensor: torch.Tensor, row: int, layer) -> torch.Tensor:
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            scale = _scale_of(layer.outputs_grad_scale)
            tensor.register_hook(
                lambda gradient: self.traced(
                    lambda: self._record(row, "outputs_grad", gradient, scale)))
        return tensor

    def _record(self, row: int, name: str, values, scale) -> None:
        self._rows.append((row, TENSOR[name],
                           quantization_counts(values, scale, schema.FLOAT8_FORMATS[name])))

    def after_sample(self, fit) -> None:
        """Writes the shares of the call just sampled (one copy to the host)."""
        rows, self._rows = self._rows, []
        if not rows:
            return
        host = torch.stack([counts for _, _, counts in rows]).cpu().numpy().astype(np.float64)
        table = np.zeros((len(self._layers), len(schema.FLOAT8_TENSORS),
                          len(schema.FLOAT8_SHARE_COLUMNS)))
        for (row, tensor, _), counts in zip(rows, host, strict=True):
            table[row, tensor, :COUNTS] += counts[:COUNTS]
            table[row, tensor, COUNTS:] = np.maximum(table[row, tensor, COUNTS:],
                                                     counts[COUNTS:])
        self.write(fit, table)
