"""Who writes what when one fit runs in several worker processes.

Under `tf.distribute.MultiWorkerMirroredStrategy` (tf-keras) or
`keras.distribution` on `jax.distributed`, every process runs the same `fit`
and the same callbacks (`mpprof.backends.worker_role` says which process
this is). Model-level records (inventory, loss scale, overflows, numerics:
identical in every process, because gradients and statistics are the whole
job's) are written once, by the chief, into the run `train`. What belongs to
one host (its devices and GPU samples, its XProf window, its own view of the
run) goes into that process's own run, `train/worker_<i>`; the chief has one
too. No two processes ever write into the same directory.
"""

from __future__ import annotations

import json
import os
import sys

KERAS_3_MULTI_WORKER_UNSUPPORTED = (
    "Keras 3's model.fit does not run under tf.distribute."
    "MultiWorkerMirroredStrategy (it fails with 'Attempt to convert a value "
    "(PerReplica...) with an unsupported type', with or without mpprof: upstream "
    "issue keras-team/keras#20585). What works instead: MirroredStrategy for "
    "several GPUs of one host with Keras 3, or tf-keras (TF_USE_LEGACY_KERAS=1, "
    "pip install tf-keras) for several workers; mpprof profiles both."
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
