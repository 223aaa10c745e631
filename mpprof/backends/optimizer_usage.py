"""Which optimizers a train step really uses, seen while it is traced.

`model.optimizer` is what `compile` got; a custom `train_step` may use other
optimizers instead (a GAN's `self.g_opt` and `self.d_opt`) and never touch
it, and may apply one without ever passing the loss through it (Keras 3's
`apply` without `scale_loss`; tf-keras's `apply_gradients` without `minimize`
or `get_scaled_loss`). Tracing the step calls the Python methods it uses,
so instance-level wrappers that set a flag when called tell, after the first
trace, which optimizers ran and how: at no cost per step, since the flags
are set at trace time and the wrappers add no operation to the graph.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpprof.backends.patching import Patches


@dataclass
class OptimizerUse:
    """One optimizer a step may use, and what the traced step did with it.

    `apply_called` / `scale_loss_called` are None until a step was traced.
    `scale_loss_called` says whether the step handed its loss to one of the
    flavour's loss methods (`Backend.loss_methods`).
    """

    name: str
    optimizer: object
    loss_scale: bool
    apply_called: bool | None = None
    scale_loss_called: bool | None = None
    # Position among the candidates in the order the traced step first
    # called one of their methods (None: never called).
    first_called: int | None = None

    def describe(self) -> dict:
        inner = getattr(self.optimizer, "inner_optimizer", None)
        return {
            "name": self.name,
            "class": type(self.optimizer).__name__,
            "inner": type(inner).__name__ if inner is not None else None,
            "loss_scale": self.loss_scale,
            "apply_called": self.apply_called,
            "scale_loss_called": self.scale_loss_called,
        }


def applied_steps(optimizer):
    """The variable counting `optimizer`'s apply calls: one per train step
    that applied it (Keras 3 does not count a step its loss scale skipped).

    Keras 3's `iterations` counts updates instead: under
    `gradient_accumulation_steps=N` it is the apply calls floor-divided by N
    (`BaseOptimizer.iterations`), which would date every step N times too
    early; its `_iterations` counts the calls.
    """
    owner = getattr(optimizer, "inner_optimizer", optimizer)
    if getattr(owner, "gradient_accumulation_steps", None) and hasattr(owner, "_iterations"):
        return owner._iterations
    return optimizer.iterations


class OptimizerUsage:
    """Watches the candidate optimizers' apply and loss methods.

    Args:
        keras_api: the model's `mpprof.backends.base.Backend`.
        model: the compiled model.
    """

    def __init__(self, keras_api, model):
        self._api = keras_api
        self.uses = [
            OptimizerUse(name, optimizer, keras_api.is_loss_scale_optimizer(optimizer))
            for name, optimizer in keras_api.candidate_optimizers(model)
        ]
        self.traced = False
        self._used: list[OptimizerUse] = []

    def install(self, patches: Patches) -> None:
        for use in self.uses:
            use.apply_called = use.scale_loss_called = False
            use.first_called = None
            self._watch(patches, use, self._api.apply_method, "apply_called")
            for method in self._api.loss_methods:
                self._watch(patches, use, method, "scale_loss_called")

    def _watch(self, patches: Patches, use: OptimizerUse, method: str, flag: str) -> None:
        original = getattr(use.optimizer, method, None)
        if not callable(original):
            return

        def watched(*args, **kwargs):
            setattr(use, flag, True)
            if use.first_called is None:
                use.first_called = sum(u.first_called is not None for u in self.uses)
            return original(*args, **kwargs)

        patches.set(use.optimizer, method, watched)

    def used(self) -> list[OptimizerUse]:
        """The optimizers the traced step applied; all candidates until a
        step was traced."""
        if not self.traced:
            return list(self.uses)
        return self._used

    def mark_traced(self) -> None:
        """The step has run (so has been traced) at least once: which
        optimizers it applied is known, and asked after every step."""
        self.traced = True
        self._used = self.applied()

    def applied(self) -> list[OptimizerUse]:
        """The optimizers applied so far (while a step is traced: by the
        trace up to now), the compiled one first, then in the order the step
        used them."""
        used = [use for use in self.uses if use.apply_called]
        return sorted(used, key=lambda u: (u.name != "optimizer", u.first_called))

    def primary(self) -> OptimizerUse | None:
        """The optimizer whose steps are the run's step axis: the compiled one
        when the step uses it, else the first one used."""
        used = self.used()
        return used[0] if used else None

    def describe(self) -> list[dict]:
        """The run context's "optimizers": the ones used (all candidates until
        the step was traced)."""
        return [use.describe() for use in self.used()]
