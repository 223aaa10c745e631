"""Per-layer activation and gradient statistics on sampled steps, on PyTorch.

A sampled call runs Keras' own step with the layer wrappers' hooks on
(`train_functions`): each measured layer's output gets its forward row
(`tensor_statistics.raw_statistics`) as the layer returns, and a tensor hook
(`Tensor.register_hook`) that takes the row of the gradient flowing into it
during `loss.backward()`, the backward row. The variables' gradients are
measured where the step hands them to the optimizer (its `apply`, wrapped at
instance level for the fit): as they are (loss-scaled) and divided by the
step's loss scale. The rows stay on the device until the call is done, then
reach the host in one copy. Nothing runs on the other steps.

Measured: every leaf layer, and a recurrent layer at its boundary (its
cell's calls are not measured: they are listed with the layer that stands
for them); a layer called more than `MAX_CALLS` times in one step is
measured on its first calls only (also listed). A layer output that needs
no gradient (one that does not depend on the weights) has no backward row.
"""

from __future__ import annotations

import torch

from mpprof.backends.numerics_layers import LayerRows
from mpprof.backends.numerics_rows import RAW_COLUMNS, statistics_of_rows
from mpprof.backends.torch.tensor_statistics import merge_rows, raw_statistics
from mpprof.records import schema


def _float_output(outputs) -> torch.Tensor | None:
    """The first floating tensor of a layer's outputs (the one measured)."""
    stack = [outputs]
    while stack:
        item = stack.pop(0)
        if isinstance(item, torch.Tensor):
            if item.is_floating_point():
                return item
        elif isinstance(item, (list, tuple)):
            stack[:0] = list(item)
        elif isinstance(item, dict):
            stack[:0] = list(item.values())
    return None


class NumericsTaps(LayerRows):
    """Per-layer forward/backward and per-variable gradient statistics.

    Args:
        model: the built model.
        backend: the fit's `TorchBackend` (its train functions hand the
            sample's beginning and end here).
    """

    aggregation = "per layer, summed over its call sites in the sampled step (abs_max: maximum)"

    def __init__(self, model, backend):
        super().__init__(model, recurrent_loop="its time loop")
        self.instrumenting = False
        self._model = model
        self._forward: dict[int, list] = {}
        self._backward: dict[int, list] = {}
        self._calls: dict[int, int] = {}
        self._gradients: tuple | None = None
        self._sample = None
        # What a gradient hook raised in the sampled call (None: nothing).
        self._failure: Exception | None = None
        backend.numerics = self

    # The sampled step, as it runs.

    def begin_sample(self) -> None:
        self._forward, self._backward, self._calls = {}, {}, {}
        self._gradients = None
        self._failure = None

    def on_call(self, layer, args, kwargs, outputs):
        row = self._rows.get(id(layer))
        if not self.instrumenting or row is None or row not in self._measured_rows:
            return outputs
        output = _float_output(outputs)
        if output is None:
            return outputs
        if self._count_call(self._calls, row) is None:
            return outputs
        self._forward.setdefault(row, []).append(raw_statistics(output))
        if row not in self._call_order:
            self._call_order.append(row)
        if output.requires_grad:
            backward = self._backward.setdefault(row, [])

            def on_gradient(gradient, _rows=backward):
                # Runs inside the user's `loss.backward()`: whatever fails
                # here is raised after the call instead (`end_sample`).
                try:
                    _rows.append(raw_statistics(gradient))
                except Exception as error:  # noqa: BLE001 - never break the step
                    self._failure = error

            output.register_hook(on_gradient)
        return outputs

    def wrap_optimizer(self, optimizer, loss_scale_getter, patches) -> None:
        """Measures the gradients the step hands to `optimizer.apply` on
        sampled steps (scaled, and divided by the step's loss scale)."""
        apply = optimizer.apply
        positions = {id(v): i for i, v in enumerate(self._variables)}

        def measured_apply(grads, trainable_variables=None, *args, **kwargs):
            if self.instrumenting and self._failure is None:
                try:
                    variables = trainable_variables or optimizer._trainable_variables
                    self._measure_gradients(grads, variables, positions, loss_scale_getter())
                except Exception as error:  # noqa: BLE001 - never break the step
                    self._failure = error
            return apply(grads, trainable_variables, *args, **kwargs)

        patches.set(optimizer, "apply", measured_apply)

    def _measure_gradients(self, grads, variables, positions: dict, scale: float) -> None:
        scaled: list = [None] * len(self._variables)
        unscaled: list = [None] * len(self._variables)
        for gradient, variable in zip(grads, variables, strict=False):
            index = positions.get(id(variable))
            if index is None or gradient is None:
                continue
            scaled[index] = raw_statistics(gradient)
            unscaled[index] = raw_statistics(gradient.float() / scale)
        self._gradients = (scaled, unscaled)

    def end_sample(self) -> None:
        """Gathers the rows on the host (one copy), once the call is done;
        raises what a gradient hook raised during it."""
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        rows = len(self.layer_names)
        unseen = torch.zeros(RAW_COLUMNS, dtype=torch.float32)
        forward = [merge_rows(self._forward[r]).cpu() if r in self._forward else unseen
                   for r in range(rows)]
        backward = [merge_rows(self._backward[r]).cpu() if self._backward.get(r) else unseen
                    for r in range(rows)]
        scaled, unscaled = self._gradients or ([None] * len(self._variables),) * 2
        gradients = [r.cpu() if r is not None else unseen for r in scaled]
        unscaled = [r.cpu() if r is not None else unseen for r in unscaled]
        self._sample = {
            "forward": torch.stack(forward).numpy(),
            "backward": torch.stack(backward).numpy(),
            "gradients": torch.stack(gradients).numpy() if gradients else None,
            "unscaled_gradients": torch.stack(unscaled).numpy() if unscaled else None,
        }
        self._forward, self._backward = {}, {}

    # The core's interface (`mpprof.recording.collectors.numerics_samples`).

    def read(self) -> dict:
        sample, self._sample = self._sample, None
        order = self.call_order
        forward, forward_hist = statistics_of_rows(sample["forward"])
        backward, backward_hist = statistics_of_rows(sample["backward"])
        columns = len(schema.NUMERICS_STAT_COLUMNS)

        def variables(rows):
            if rows is None:
                return torch.zeros((0, columns)).numpy()
            return statistics_of_rows(rows)[0]

        return {
            schema.NUMERICS_FORWARD: forward[order],
            schema.NUMERICS_BACKWARD: backward[order],
            schema.NUMERICS_FORWARD_HIST: forward_hist[order],
            schema.NUMERICS_BACKWARD_HIST: backward_hist[order],
            schema.NUMERICS_GRADIENTS: variables(sample["gradients"]),
            schema.NUMERICS_UNSCALED_GRADIENTS: variables(sample["unscaled_gradients"]),
        }
