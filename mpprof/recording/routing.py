"""Where this process's records go (see `mpprof.recording.distributed` for the roles).

One process: everything into the model run, `LOG_DIR/train`. Under a
multi-worker strategy the chief writes the model-level records there, each
worker (the chief too) its host's own records into `train/worker_<i>`, and
a non-chief worker's model-level records are dropped (the chief's are the
same: statistics are all-reduced). Every writer is guarded: a failed write
stops the recording, never the fit.

The rule for a log_dir that cannot be written: one the user must fix (no
permission, not a directory, a bad path) fails at the start of fit with a
message; a full disk (no space, quota, a file-size limit), found at the start
or midway, stops the recording with one warning and never the fit, since
freeing space is not a change to the training script.
"""

from __future__ import annotations

import errno
import posixpath

from mpprof.backends.worker_role import WorkerRole
from mpprof.recording.distributed import DiscardingWriter
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
        model_writer = _open_writer(run_dir, guard) if role.is_chief else DiscardingWriter()
        worker_writer = None
        if role.worker_run is not None:
            try:
                worker_writer = _open_writer(posixpath.join(run_dir, role.worker_run), guard)
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

    def close(self, fit_state: str | None = None, step: int = 0) -> None:
        """Closes the writers; with `fit_state`, says in each how the fit
        ended, then writes the model run's digest (one process only: a
        worker's run is read with the chief's)."""
        for writer in (self.model, self.worker):
            if writer is None:
                continue
            writer.close()
            if fit_state is not None:
                writer.mark_fit_end(fit_state, step)
        if fit_state is not None and self.worker is None:
            self.model.write_digest()


# What a full disk answers: no space, no quota, a file-size limit (RLIMIT_FSIZE).
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def _open_writer(run_dir: str, guard: Guard) -> RecordWriter | DiscardingWriter:
    try:
        return RecordWriter(run_dir)
    except OSError as e:
        if e.errno in _DISK_FULL:  # see the module docstring: not the fit's end
            guard.fail(GuardedWriter.COLLECTOR, e)
            return DiscardingWriter()
        raise OSError(
            f"mpprof cannot write its records to {filesystem.shown(run_dir)!r}: "
            f"{filesystem.error_text(e)}. Pass "
            "MixedPrecisionProfiler(log_dir=...) a directory you can write to."
        ) from e
