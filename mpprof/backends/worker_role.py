"""This process's place in a fit that spans several processes.

Under `tf.distribute.MultiWorkerMirroredStrategy` (tf-keras) and under
`keras.distribution` on `jax.distributed`, every process runs the same `fit`
and the same callbacks, and the step's statistics are the whole job's
(all-reduced by the strategy, or computed on global arrays by XLA). The
recording core (`mpprof.recording.routing`) writes the model-level records
once, from the chief, and each process's own facts into its own run; each
backend says which process this is (`Backend.worker_role`).
"""

from __future__ import annotations

import dataclasses
import posixpath


@dataclasses.dataclass(frozen=True)
class WorkerRole:
    """This process's place in a (possibly multi-process) fit.

    Attributes:
        multi_worker: whether the fit spans several processes.
        is_chief: whether this process writes the model-level records.
        task_type: "worker" or "chief" under tf.distribute, "process" under
            jax.distributed (None in a single process).
        task_index: this process's index among its task type.
        num_workers: processes in the job (1 in a single process).
        worker_index: a number unique to this process (the chief counts first).
    """

    multi_worker: bool = False
    is_chief: bool = True
    task_type: str | None = None
    task_index: int = 0
    num_workers: int = 1
    worker_index: int = 0

    @property
    def worker_run(self) -> str | None:
        """This process's own run, relative to the model run; None if single."""
        return f"worker_{self.worker_index}" if self.multi_worker else None

    def describe(self, model_run: str) -> dict:
        """The run context's "distributed" entry."""
        described = {
            "multi_worker": self.multi_worker,
            "role": "chief" if self.is_chief else "worker",
            "task_type": self.task_type,
            "task_index": self.task_index,
            "worker_index": self.worker_index,
            "num_workers": self.num_workers,
            "model_run": model_run,
            "worker_runs": (
                [posixpath.join(model_run, f"worker_{i}") for i in range(self.num_workers)]
                if self.multi_worker else []
            ),
        }
        if self.multi_worker:
            described["worker_run"] = posixpath.join(model_run, self.worker_run)
        return described


class SingleProcess:
    """What the core asks of a distribution strategy, for a backend whose fit
    has none (JAX: `keras.distribution` shards by the device mesh; PyTorch:
    one process, one device)."""

    num_replicas_in_sync = 1
    extended = None


def of_strategy(strategy) -> WorkerRole:
    """The role of this process under a `tf.distribute` strategy (any other
    strategy, or none: a single process)."""
    extended = getattr(strategy, "extended", None)
    in_multi_worker = getattr(extended, "_in_multi_worker_mode", None)
    if not callable(in_multi_worker) or not in_multi_worker():
        return WorkerRole()
    resolver = getattr(strategy, "cluster_resolver", None)
    task_type = getattr(resolver, "task_type", None)
    task_index = int(getattr(resolver, "task_id", 0) or 0)
    spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
    chiefs = len(spec.get("chief", []))
    workers = len(spec.get("worker", []))
    # A "chief" task, when the cluster has one, is worker 0 of the run names.
    worker_index = task_index if task_type == "chief" else chiefs + task_index
    return WorkerRole(
        multi_worker=True,
        is_chief=bool(extended.should_checkpoint),
        task_type=task_type,
        task_index=task_index,
        num_workers=max(1, chiefs + workers),
        worker_index=worker_index,
    )
