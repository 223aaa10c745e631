"""The loss of every tf-keras train step, checked inside the traced step.

tf-keras optimizers have no `scale_loss`; tf-keras's train step hands the loss
to `optimizer.minimize(loss, variables, tape=tape)` instead, for every
optimizer (the LossScaleOptimizer, the new and the legacy ones), and only in
training: `evaluate` never calls it, so validation losses are not counted.
"""

from __future__ import annotations

from mpprof.collectors.health import LossHealthCollector
from mpprof.patching import Patches


class TfKerasLossHealthCollector(LossHealthCollector):
    """`LossHealthCollector` watching tf-keras's `optimizer.minimize`."""

    def __init__(self, optimizer, strategy, step):
        super().__init__(optimizer, strategy, step)
        self.available = callable(getattr(optimizer, "minimize", None))

    def install(self, patches: Patches) -> None:
        if not self.available:
            return
        minimize = self.optimizer.minimize

        def watched_minimize(loss, var_list, *args, **kwargs):
            if not callable(loss):  # a loss callable is traced by minimize itself
                self.traced(lambda: self._watch(loss))
            return minimize(loss, var_list, *args, **kwargs)

        patches.set(self.optimizer, "minimize", watched_minimize)
