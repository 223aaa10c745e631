"""Who writes what when one fit runs in several worker processes.

Under `tf.distribute.MultiWorkerMirroredStrategy` every worker process runs
the same `fit` and the same callbacks. Model-level records (inventory, loss
scale, overflows, numerics: identical on every worker, because gradients and
statistics are all-reduced) are written once, by the chief, into the run
`train`. What belongs to one host (its GPU samples, its XProf window, its own
view of the run) goes into that worker's own run, `train/worker_<i>`; the
chief has one too. No two processes ever write into the same directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
import sys

KERAS_3_MULTI_WORKER_UNSUPPORTED = (
    "Keras 3's model.fit does not run under tf.distribute."
    "MultiWorkerMirroredStrategy (it fails with 'Attempt to convert a value "
    "(PerReplica...) with an unsupported type', with or without mpprof: upstream "
    "issue keras-team/keras#20585). What works instead: MirroredStrategy for "
    "several GPUs of one host with Keras 3, or tf-keras (TF_USE_LEGACY_KERAS=1, "
    "pip install tf-keras) for several workers; mpprof profiles both."
)


@dataclasses.dataclass(frozen=True)
class WorkerRole:
    """This process's place in a (possibly multi-worker) fit.

    Attributes:
        multi_worker: whether the strategy spans several worker processes.
        is_chief: whether this process writes the model-level records.
        task_type: "worker" or "chief" (None outside a cluster).
        task_index: this worker's index among its task type.
        num_workers: worker processes in the cluster (1 outside one).
        worker_index: a number unique to this process ("chief" counts first).
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


def worker_role(strategy) -> WorkerRole:
    """The role of this process under `strategy`."""
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


def tf_config_workers() -> int:
    """Worker processes (chief included) that TF_CONFIG describes; 0 without one."""
    try:
        cluster = json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster", {})
        return len(cluster.get("chief", [])) + len(cluster.get("worker", []))
    except (ValueError, AttributeError, TypeError):
        return 0


_warned_keras_3_multi_worker = False


def warn_if_keras_3_multi_worker() -> str | None:
    """Says, once per process, that Keras 3's fit cannot run this cluster.

    Called when the profiler is made: Keras 3's fit fails under a multi-worker
    MultiWorkerMirroredStrategy while building the model, before any callback
    hook runs, so this is the one moment mpprof can say it. A tf-keras model
    needs tf_keras imported (or `tf.keras` made tf-keras by
    TF_USE_LEGACY_KERAS); without either the model is Keras 3's. Returns the
    message when it applies.
    """
    legacy_keras = os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true", "yes")
    if tf_config_workers() < 2 or legacy_keras or "tf_keras" in sys.modules:
        return None
    return announce_keras_3_multi_worker()


def announce_keras_3_multi_worker() -> str:
    """Prints the Keras 3 multi-worker message, once per process; returns it."""
    global _warned_keras_3_multi_worker
    if not _warned_keras_3_multi_worker:
        _warned_keras_3_multi_worker = True
        print(f"mpprof: {KERAS_3_MULTI_WORKER_UNSUPPORTED}")
    return KERAS_3_MULTI_WORKER_UNSUPPORTED


class DiscardingWriter:
    """Takes model-level records on a non-chief worker and writes nothing.

    The chief writes them; every worker still computes them, because the
    statistics are all-reduced inside the train step, which every worker runs.
    """

    run_dir = None

    def write_json(self, record: str, value, step: int) -> None:
        pass

    def write_array(self, record: str, value, step: int, series: str | None = None) -> None:
        pass

    def write_file(self, relative_path: str, data: bytes) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
