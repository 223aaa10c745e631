"""One eager pass of a captured step on PyTorch: forward, loss, scaled
backward, every aten op watched.

Keras' PyTorch step runs eagerly, so a pass is the step itself, run once
more: `model(x, training=True)`, `model.compute_loss`, and
`torch.autograd.grad` of the loss times the loss scale (the variables'
`.grad` are left alone). A `TorchDispatchMode` (`_OpWatch`) sees every aten
op the forward and the backward pass run, after autograd has recorded it:
the first op whose floating output is non-finite or beyond its dtype's
maximum is the offender (`mpprof.replay.search.Offender`, its `op` the aten
op's name: `mm`, `addmm`, `exp`, ...).

Where an op ran: every layer's call is wrapped at instance level for the
length of the pass (`mpprof.backends.patching.Patches` puts back what was
there), so a forward op belongs to the innermost layer running it (an
offending cast just before a layer's call is that layer's input cast, as on
TensorFlow); each layer's first floating output is kept and gets a tensor
hook, which keeps the gradient flowing into it and marks the backward ops
that follow as that layer's (as TensorFlow's custom gradient does). The
pass runs eagerly whatever the model was compiled with (`jit_compile=True`
included).

Each pass starts from the same state: the non-trainable variables (moving
statistics, random seeds) are put back after it, the metrics reset, and the
dtype policies it changed restored.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping

import keras
import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mpprof.backends.layer_records import variable_path
from mpprof.backends.replay_candidates import REPLAY_SEED, layer_tree, policies_applied
from mpprof.backends.replay_watch import LayerWatch, pass_policies
from mpprof.backends.torch.step_state import host_array
from mpprof.dtypes import DTYPE_MAX
from mpprof.replay import search
from mpprof.replay.search import BETWEEN_LAYERS, LOSS, PassResult

# The aten op of a dtype cast (`ops.cast` on PyTorch is `Tensor.to`).
_CAST_OPS = {"_to_copy", "to", "convert_element_type"}
# Ops whose output is memory left uninitialised, filled by the next op
# (`torch.nn.functional.dropout` draws its mask into `empty_like`): what they
# hold is never a value the step computed.
_UNINITIALISED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                  "empty_permuted"}


@contextlib.contextmanager
def seeded_global_rng() -> Iterator[None]:
    """PyTorch's global generators start from `REPLAY_SEED` inside the
    block and are put back after. Keras' PyTorch dropout without a seed draws
    from them (`torch.nn.functional.dropout`), not from its layer's
    SeedGenerator (which `replay_candidates.repeatable_random_draws` seeds):
    so every pass and trial draws the same masks, and the user's generator
    is left as it was."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(REPLAY_SEED)
        yield


def as_tensors(batch):
    """The batch's arrays as tensors on Keras' device (what the step gets
    from Keras' PyTorch data adapter)."""
    return keras.tree.map_structure(
        lambda leaf: keras.ops.convert_to_tensor(leaf) if isinstance(leaf, np.ndarray)
        else leaf, batch)


def run_pass(model, batch, loss_scale: float, float32_layers: Iterable[str] | None,
             *, all_float32: bool = False, policies: Mapping[str, str] | None = None,
             model_policy: str | None = None) -> PassResult:
    """Runs the step once, eagerly, and watches every op (the arguments are
    `mpprof.backends.tensorflow.replay_passes.run_pass`'s: `batch` is (x, y,
    sample_weight); `float32_layers` each with its sublayers in float32;
    `policies` a verification candidate's, after them)."""
    tree = layer_tree(model)
    wanted, model_policy = pass_policies(tree, float32_layers, policies, all_float32,
                                         model_policy)
    with torch.no_grad():
        state = [(v, v.value.detach().clone()) for v in model.non_trainable_variables]
    watch = _Watch(tree)
    try:
        with policies_applied(model, tree, wanted, model_policy), seeded_global_rng():
            watch.install_layers()
            return watch.run(model, as_tensors(batch), loss_scale)
    finally:
        watch.remove_layers()
        for variable, value in state:
            variable.assign(value)
        for metric in model.metrics:
            metric.reset_state()


class _OpWatch(TorchDispatchMode):
    """Hands every aten op (its outputs computed) to the pass's `_Watch`."""

    def __init__(self, watch: _Watch):
        super().__init__()
        self._watch = watch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        outputs = func(*args, **(kwargs or {}))
        # (The mode is off in here: the checks' own ops are not watched.)
        self._watch.on_op(func, args, outputs)
        return outputs


class _Watch(LayerWatch):
    """The layer wrappers, tensor hooks and op watch of one pass."""

    def run(self, model, batch, loss_scale: float) -> PassResult:
        x, y, sample_weight = batch
        variables = model.trainable_variables
        with _OpWatch(self):
            self._outside = BETWEEN_LAYERS
            y_pred = model(x, training=True)
            self._outside = LOSS
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                      training=True)
            scaled = loss.float() * loss_scale
            self._phase = "backward"
            gradients = torch.autograd.grad(scaled, [v.value for v in variables],
                                            allow_unused=True)
            self._phase = "done"
        by_path = {variable_path(v): host_array(g) for v, g in zip(variables, gradients,
                                                                     strict=True)
                   if g is not None}
        return self.result(float(host_array(loss).astype(np.float64).sum()), by_path)

    def tap(self, name: str, index: int, outputs):
        """Keeps the layer's first floating output and hooks the gradient
        flowing into it."""
        output = next((t for t in keras.tree.flatten(outputs)
                       if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
        if output is None:
            return outputs
        key = (name, index)
        self._inside = True
        try:
            self.forward[key] = host_array(output).astype(np.float64)
        finally:
            self._inside = False
        if output.requires_grad:

            def on_gradient(gradient):
                self._backward_layer = name
                self._inside = True
                try:
                    self.backward[key] = host_array(gradient).astype(np.float64)
                finally:
                    self._inside = False

            output.register_hook(on_gradient)
        return outputs

    def on_op(self, func, args, outputs) -> None:
        op = func.overloadpacket.__name__
        if self._inside or op in _UNINITIALISED:
            return
        phase = self.judged_phase()
        if phase is None:
            return
        for output in tree_flatten(outputs)[0]:
            if not _is_float(output) or _in_range(output):
                continue
            dtype = _dtype_name(output)
            problem = search.problem(host_array(output), dtype)
            if problem is None:
                continue
            inputs = [t for t in tree_flatten(args)[0] if _is_float(t)]
            self.offend(phase, op, [search.abs_max(host_array(t)) for t in inputs],
                        problem, dtype, cast=op in _CAST_OPS)
            return


def _is_float(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _in_range(tensor: torch.Tensor) -> bool:
    """Whether every value is finite and within its dtype's max: one
    reduction on the tensor's device (the common case needs no copy)."""
    if tensor.numel() == 0:
        return True
    peak = tensor.detach().abs().amax()
    limit = DTYPE_MAX.get(_dtype_name(tensor))
    return bool(torch.isfinite(peak)) and (limit is None or float(peak) <= limit)
