"""What the step states of JAX (`mpprof.backends.jax.step_state`, counters
inside the jitted step) and PyTorch (`mpprof.backends.torch.step_state`,
counters on the host) hold alike: which optimizers they follow (every
candidate built before the fit) and why not the others, and where the fit's
counts start. Both answer the same host reads, which
`step_state_loss_scales`, `step_state_series` and `step_state_health` make.
Imports no framework.
"""

from __future__ import annotations

from typing import Any

from mpprof.backends.optimizer_usage import OptimizerUsage

# Why an optimizer whose variables do not exist yet is not followed.
NOT_BUILT = "not built before the fit"


class StepStateBase:
    """The counters of one fit's steps: a subclass keeps a block per
    followed optimizer in `_blocks` (by optimizer id) and notes the others
    in `unfollowed`.

    Args:
        usage: the fit's `OptimizerUsage` (every candidate optimizer that is
            built is followed; the primary one dates the loss check).
        capacity: events each ring holds between two reads.
    """

    def __init__(self, usage: OptimizerUsage, capacity: int):
        self.capacity = int(capacity)
        self._usage = usage
        self._blocks: dict[int, Any] = {}
        # Why an optimizer is not followed, by optimizer id.
        self.unfollowed: dict[int, str] = {}
        # Where the counts start (the collectors of earlier fits set them).
        self.start_skipped: dict[int, int] = {}
        self.start_nonfinite = 0
        self.start_first_nonfinite = -1
        # Whether the step had a loss to check (None: not known yet).
        self.loss_watched: bool | None = None

    def follows(self, optimizer) -> bool:
        return id(optimizer) in self._blocks

    def _block(self, optimizer) -> Any:
        return self._blocks[id(optimizer)]
