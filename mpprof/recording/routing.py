"""Where this process's records go (see `mpprof.recording.distributed` for the roles).

One process: everything into the model run, `LOG_DIR/train`. Under a
multi-worker strategy the chief writes the model-level records there, each
worker (the chief too) its host's own records into `train/worker_<i>`, and
a non-chief worker's model-level records are dropped (the chief's are the
same: statistics are all-reduced). Every writer is guarded: a failed write
stops the recording, never the fit.
"""

from __future__ import annotations

import posixpath

from mpprof.recording.distributed import DiscardingWriter, WorkerRole
from mpprof.recording.guard import Guard, GuardedWriter
from mpprof.records import filesystem, schema
from mpprof.records.writer import RecordWriter


class RecordRouting:
    """The writers of one fit.

    Args:
        run_dir: the model run, `LOG_DIR/train`.
        role: this process's `WorkerRole`.
        guard: the profiler's `Guard`.

    Raises:
        OSError: a run directory cannot be written (the user's to fix).
    """

    def __init__(self, run_dir: str, role: WorkerRole, guard: Guard):
        model_writer = _open_writer(run_dir) if role.is_chief else DiscardingWriter()
        worker_writer = None
        if role.worker_run is not None:
            try:
                worker_writer = _open_writer(posixpath.join(run_dir, role.worker_run))
            except BaseException:
                model_writer.close()
                raise
        self.model = GuardedWriter(model_writer, guard)
        self.worker = GuardedWriter(worker_writer, guard) if worker_writer else None

    @property
    def host(self) -> GuardedWriter:
        """Where this host's own records (GPU samples, kernel share) go."""
        return self.worker or self.model

    def write_context(self, context: dict, step: int, worker_evidence: dict | None) -> None:
        """The run context into the model run and, under several workers, this
        worker's own run (with `worker_evidence`: its own view of the fit)."""
        if self.worker is None:
            self.model.write_json(schema.RUN_CONTEXT, context, step)
            return
        # GPU samples belong to hosts: point the model run at every worker's.
        gpu = context["collectors"].setdefault("gpu", {})
        gpu["samples_in_runs"] = context["distributed"]["worker_runs"]
        self.model.write_json(schema.RUN_CONTEXT, context, step)
        gpu["samples_in_runs"] = [context["distributed"]["worker_run"]]
        context["run_role"] = "worker"
        if worker_evidence is not None:
            context["worker_evidence"] = worker_evidence
        self.worker.write_json(schema.RUN_CONTEXT, context, step)

    def flush(self) -> None:
        self.model.flush()
        if self.worker is not None:
            self.worker.flush()

    def close(self) -> None:
        self.model.close()
        if self.worker is not None:
            self.worker.close()


def _open_writer(run_dir: str) -> RecordWriter:
    try:
        return RecordWriter(run_dir)
    except OSError as e:
        raise OSError(
            f"mpprof cannot write its records to {run_dir!r}: {filesystem.error_text(e)}. Pass "
            "MixedPrecisionProfiler(log_dir=...) a directory you can write to."
        ) from e
