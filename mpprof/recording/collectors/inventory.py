"""The INVENTORY record: every layer's precision, as the first step traced it."""

from __future__ import annotations

from mpprof.backends.collector import Collector
from mpprof.backends.patching import Patches
from mpprof.recording.guard import GuardedHook
from mpprof.records import schema


class Inventory(Collector):
    """Wraps every layer's `call` (`LayerCallPatch`) for the precision
    collector, and writes its inventory once the step was traced.

    The same layer wrappers serve the numerics collector (`add_hook`).

    Args:
        backend: the model's `mpprof.backends.base.Backend`.
        model: the model.
        guard: the profiler's `Guard` (a failing hook switches its own
            collector off).
    """

    name = "precision"

    def __init__(self, backend, model, guard):
        self.precision = backend.PrecisionTracer(model)
        self._guard = guard
        self.layer_patch = backend.LayerCallPatch(
            model, [GuardedHook(self.name, self.precision, guard)])
        self._written = False
        self._steps_ran = False

    def install(self, fit, patches: Patches) -> None:
        self.layer_patch.install(patches)
        self._watch_loss_input(fit.model, patches)

    def _watch_loss_input(self, model, patches: Patches) -> None:
        """Wraps `model.compute_loss` (instance level) so that the trace sees
        the dtype of the `y_pred` the loss receives: the model's output is not
        always it (a subclassed model's custom train_step)."""
        compute_loss = getattr(model, "compute_loss", None)
        if not callable(compute_loss):
            return
        precision, guard, name = self.precision, self._guard, self.name

        def watched_compute_loss(*args, **kwargs):
            y_pred = kwargs["y_pred"] if "y_pred" in kwargs else (
                args[2] if len(args) > 2 else None)
            guard.run(name, precision.note_loss_input, y_pred)
            return compute_loss(*args, **kwargs)

        patches.set(model, "compute_loss", watched_compute_loss)

    def add_hook(self, collector: str, hook) -> None:
        """Lets `hook` see every layer call too, guarded as `collector`."""
        self.layer_patch.add_hook(GuardedHook(collector, hook, self._guard))

    @property
    def after_each_call(self) -> bool:
        return not self._written

    def after_call(self, fit) -> None:
        self._steps_ran = True
        if not self._written and self.precision.traced:
            self._written = True
            fit.writer.write_json(schema.INVENTORY, self.precision.inventory(), fit.step)

    def context(self) -> dict:
        state = {"state": "ok", "traced": self.precision.traced}
        if self.precision.traced:
            return state
        if not self._steps_ran:
            reason = "no train step has run yet: the step never traced"
        else:
            # Every layer's called method is wrapped (`LayerCallPatch`): a
            # step that ran without calling any is not a Keras layer call.
            reason = ("the train step ran but called no layer of the model through "
                      "Keras' Layer.__call__ (a custom train_step that never calls "
                      "the model?)")
        return {**state, "reason": reason}
