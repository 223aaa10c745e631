"""What the eager replay passes share (TensorFlow's op callbacks,
`mpprof.backends.tensorflow.replay_passes`; PyTorch's dispatch mode,
`mpprof.backends.torch.replay_passes`), framework-free.

A pass runs the step once with every layer's call wrapped at instance level
(`mpprof.backends.patching.Patches` puts back what was there): a forward op
belongs to the innermost layer whose call is running (`LayerWatch`), and an
offending cast just before a layer's call, in its caller's frame, is that
layer's input cast (Keras casts a layer's inputs in `Layer.__call__`); a
backward op belongs to the layer whose output's gradient was computed last.
The framework's half sees each op (`offend` records the first bad one per
phase) and keeps each layer's output and incoming gradient (`tap`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from mpprof.backends.layer_records import called_method
from mpprof.backends.patching import Patches
from mpprof.replay.search import LOSS, Offender, PassResult, subtree


def pass_policies(tree: dict[str, object], float32_layers: Iterable[str] | None,
                  policies: Mapping[str, str] | None, all_float32: bool,
                  model_policy: str | None) -> tuple[dict[str, str], str | None]:
    """The layer policies and the model's policy of one pass: the named
    layers (each with its sublayers) in float32, then a verification
    candidate's `policies`; everything in float32 with `all_float32`."""
    if all_float32:
        return dict.fromkeys(tree, "float32"), "float32"
    wanted = {n: "float32" for name in (float32_layers or ()) for n in subtree(tree, name)}
    wanted.update(policies or {})
    return wanted, model_policy


class LayerWatch:
    """Which layer runs each op of one eager pass, each layer's first
    floating output and incoming gradient, and the first offender of each
    phase. A backend completes it with `tap` and calls `offend` for each bad
    op it sees.

    Args:
        tree: qualified name -> layer (`replay_candidates.layer_tree`).
    """

    def __init__(self, tree: Mapping[str, object]):
        self._tree = tree
        self._stack: list[str] = []
        self._backward_layer = LOSS
        self._phase = "forward"
        self._calls: dict[str, int] = {}
        self.forward: dict = {}
        self.backward: dict = {}
        self.offenders: dict[str, Offender] = {}
        self._inside = False  # mpprof's own ops (the taps) run
        self._outside = LOSS
        self._cast_offended = False
        self._cast_stack: tuple[str, ...] = ()
        self._patches = Patches()

    def install_layers(self) -> None:
        for name, layer in self._tree.items():
            method = called_method(layer)
            self._patches.set(layer, method, self._wrap(name, getattr(layer, method)))

    def remove_layers(self) -> None:
        self._patches.restore()

    def tap(self, name: str, index: int, outputs):
        """Keeps call `index` of layer `name`'s output and the gradient that
        will flow into it; returns the outputs the model goes on with."""
        return outputs

    def _wrap(self, name: str, call):
        watch = self

        def watched_call(*args, **kwargs):
            watch._claim_input_cast(name)
            index = watch._calls.get(name, 0)
            watch._calls[name] = index + 1
            watch._stack.append(name)
            try:
                outputs = call(*args, **kwargs)
            finally:
                watch._stack.pop()
            return watch.tap(name, index, outputs)

        return watched_call

    def _claim_input_cast(self, name: str) -> None:
        """A layer's call begins: an offending cast just before it, in the
        caller's frame (not the last op of a sibling's call), was its input
        cast."""
        if self._cast_offended and tuple(self._stack) == self._cast_stack:
            self.offenders["forward"].layer = name
        self._cast_offended = False

    def judged_phase(self) -> str | None:
        """An op ran: the phase it is judged in, or None (the pass is done, or
        its phase has its offender already)."""
        self._cast_offended = False
        phase = self._phase
        return None if phase == "done" or phase in self.offenders else phase

    def offend(self, phase: str, op: str, input_abs_max: list, problem: str, dtype: str,
               cast: bool) -> None:
        """The first bad op of `phase`, attributed to its layer (`cast`: the
        op is a dtype cast, perhaps the next layer's input cast)."""
        layer = (self._stack[-1] if self._stack else self._outside) \
            if phase == "forward" else self._backward_layer
        self.offenders[phase] = Offender(layer=layer, op=op, phase=phase,
                                         input_abs_max=input_abs_max, output=problem,
                                         dtype=dtype)
        self._cast_offended = phase == "forward" and cast
        self._cast_stack = tuple(self._stack)

    def result(self, loss: float, gradients: dict) -> PassResult:
        """What the pass saw (`gradients`: variable path -> its gradient)."""
        return PassResult(
            forward=self.forward, backward=self.backward,
            offender=self.offenders.get("forward") or self.offenders.get("backward"),
            forward_clean="forward" not in self.offenders, loss=loss,
            gradients_finite=all(bool(np.all(np.isfinite(g))) for g in gradients.values()),
            gradients=gradients)
