"""The loss-scale series of a JAX fit: the compiled optimizer's, when it is
a LossScaleOptimizer.

Keras' JAX train step passes the compiled optimizer's variables in
`state[2]`: that is the optimizer whose skips the step state sees, so a JAX
fit has one series at most (written under the plain loss-scale tags). A
custom step's own LossScaleOptimizers (a GAN's, whose variables the step
keeps wherever its author put them) are recorded as used, but their scales
and skips are not followed: the run context says so, and the step axis is
the host's count of steps run.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mpprof.recording import step_origin
from mpprof.recording.collectors.base import Collector
from mpprof.recording.distributed import keras_3_skip_decided_by
from mpprof.recording.optimizer_usage import OptimizerUsage, applied_steps
from mpprof.recording.patching import Patches
from mpprof.recording.step_origin import EarlierRecords
from mpprof.records import schema


class LossScales(Collector):
    """The loss-scale collector of the compiled LossScaleOptimizer, if any.

    Args: as `mpprof.backends.tensorflow.loss_scales.LossScales` (`strategy`
        is the JAX backend's stand-in: one replica per process).
    """

    name = "loss_scale"

    def __init__(self, keras_api, usage: OptimizerUsage, strategy, capacity: int,
                 reuse: dict[int, object], earlier: Callable[[], EarlierRecords | str]):
        self._usage = usage
        self._replicas = int(strategy.num_replicas_in_sync)
        self._overflows_seen = 0
        self._start: dict[str, object] = {}
        self.by_name = {}
        model_optimizer = usage.uses[0].optimizer if usage.uses else None
        step_state = self._step_state = keras_api.make_step_state(capacity)
        for use in usage.uses:
            if not use.loss_scale or use.optimizer is not model_optimizer:
                continue
            collector = reuse.get(id(use.optimizer))
            if collector is None:
                collector = keras_api.loss_scale_series(use.optimizer, step_state, capacity)
                collector.start_from(
                    step_origin.FIRST_STEP if collector.nothing_ran()
                    else step_origin.origin(collector, use.name, earlier())
                )
            else:
                collector.attach(step_state)
            self.by_name[use.name] = collector

    def __bool__(self) -> bool:
        return bool(self.active())

    def install(self, fit, patches: Patches) -> None:
        # (After `TrainFunctions.install`, which starts the step state.)
        self._overflows_seen = self.skipped_steps()
        # Where each scale starts; written at the first flush.
        self._start = {name: c.read()[1] for name, c in self.by_name.items()}

    def note_overflows(self, fit) -> None:
        """After a call whose alarm rang: arms a forensic sample when a step
        overflowed since the last look."""
        if not fit.schedule.watching_overflows:
            return
        skipped = self.skipped_steps()
        if skipped > self._overflows_seen:
            fit.schedule.overflowed()
        self._overflows_seen = skipped

    def flush(self, fit) -> None:
        for name, collector in self.active().items():
            start = self._start.pop(name, None)
            if start is not None:
                fit.writer.write_array(schema.LOSS_SCALE_PROGRESS, start, int(start[0]))
            events, progress = collector.read()
            step = int(progress[schema.LOSS_SCALE_PROGRESS_COLUMN.steps_run])
            if len(events):
                fit.writer.write_array(schema.LOSS_SCALE_EVENTS, events, step)
            fit.writer.write_array(schema.LOSS_SCALE_PROGRESS, progress, step)

    def active(self) -> dict[str, object]:
        used = {use.name for use in self._usage.used()}
        return {name: c for name, c in self.by_name.items() if name in used}

    def primary(self):
        primary = self._usage.primary()
        return self.by_name.get(primary.name) if primary is not None else None

    def skipped_counters(self) -> list:
        """(The JAX alarm is made by the step itself: no counters to sum.)"""
        return []

    def skipped_steps(self) -> int:
        return sum(c.skipped_steps() for c in self.active().values())

    def step_of(self, use) -> int | None:
        """Steps `use` has run: from the step state once the fit has one;
        None for an optimizer other than the compiled one (its steps are not
        followed: the caller counts steps run itself)."""
        if not self._usage.uses or use.optimizer is not self._usage.uses[0].optimizer:
            return None
        collector = self.by_name.get(use.name)
        if collector is not None:
            return collector.current_step()
        state = self._step_state
        if state.arrays is not None:
            return state.applied()
        return int(np.asarray(applied_steps(use.optimizer).value))

    def scale_value(self) -> float:
        primary = self.primary()
        return primary.scale() if primary is not None else 1.0

    def context(self) -> dict:
        active = self.active()
        if not active:
            used = self._usage.used()
            scaled = [u.name for u in used if u.loss_scale]
            if scaled:
                return {"state": "absent", "reason": (
                    f"the step applies its own LossScaleOptimizers ({', '.join(scaled)}), "
                    "not the compiled one: on JAX only the compiled optimizer's scale and "
                    "skips are followed (its variables are the state Keras passes in "
                    "state[2]; a custom step keeps its own optimizers' state elsewhere)")}
            names = ", ".join(f"{u.name} ({type(u.optimizer).__name__})" for u in used)
            return {
                "state": "absent",
                "reason": (
                    f"no LossScaleOptimizer among the optimizers the step uses ({names}): "
                    "no dynamic loss scale to record" if used
                    else "the train step applied no optimizer: no loss scale to record"
                ),
            }
        context = {"state": "ok"}
        for name, collector in active.items():
            settings = collector.settings()
            settings.setdefault("skip_decided_by", keras_3_skip_decided_by(self._replicas))
            settings["step_axis_origin"] = collector.origin.describe()
            context.update(settings, primary=name)
        return context

    def graph_step_of(self, name: str):
        """(TensorFlow's in-graph step; the JAX step state dates its own
        events, so nothing asks it here.)"""
        return lambda: None

    def scale_of(self, name: str):
        return self.scale_value
