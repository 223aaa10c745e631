"""What the collectors of one profiled fit share: where to write, and where
training stands."""

from __future__ import annotations

from dataclasses import dataclass, field

from mpprof.backends.optimizer_usage import OptimizerUsage
from mpprof.recording.guard import Guard, GuardedWriter
from mpprof.recording.sampling import SampleSchedule


@dataclass
class FitState:
    """One fit's shared state, handed to every collector hook.

    Attributes:
        model: the model being trained.
        guard: the profiler's `Guard`.
        writer: where model-level records go.
        host_writer: where this host's records go (a worker's own run
            under MultiWorkerMirroredStrategy, else `writer`).
        usage: the optimizers the step uses.
        schedule: the numerics sampling schedule.
        step: train steps run so far (counted on the host after each call,
            measured from the optimizer at samples and flushes).
        calls: train-function calls so far in this fit.
        sample_step: for the call just made, the step its numerics sample
            starts at (None: the call was not sampled).
        forensic: whether that sample was taken because of an overflow.
        replayed_sample: for a forensic sample evaluated on an earlier,
            overflowed step's batch, beside the call (`sample_step` is that
            step): which step's state it ran with
            (`mpprof.backends.jax.train_functions.ReplayedSample.note`); else None.
        replay_outputs: what an instrumented call returned for a replay
            capture (`mpprof.backends.tensorflow.replay_capture`), if anything.
    """

    model: object
    guard: Guard
    writer: GuardedWriter
    host_writer: GuardedWriter
    usage: OptimizerUsage
    schedule: SampleSchedule
    step: int = 0
    calls: int = 0
    sample_step: int | None = None
    forensic: bool = False
    replayed_sample: dict | None = None
    replay_outputs: object = field(default=None, repr=False)
