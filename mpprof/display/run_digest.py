"""A run's digest: what the run list and `mpprof diagnose` show of it,
written beside its records by the fit that recorded them, so that the first
read of a sweep is cheap.

The first `/runs` of TensorBoard on a sweep, and `mpprof diagnose` over it,
read and diagnose every run: about 4 s for 1,000 small runs on 2 cores
(most of it checksums, protobuf and the rules), before the tab shows
anything. At its end a fit reads its own run back once, diagnoses it and
writes `mpprof.digest.json` into the run directory (`write`): the row the
run list shows (`run_summary`) and the run's findings with how it stands
(`run_head`), with the name, size and mtime of each event file they were
computed from and a fingerprint of mpprof's code. A reader takes them from
it (`load_many`) only when all of these hold, and otherwise reads the run
as ever:

- the run's mpprof event files are now exactly those files, with the same
  sizes and mtimes: a record written after it, a later fit into the same
  directory, a file rewritten, truncated or copied without its mtime, and
  the run is read in full;
- mpprof's code is the same (a SHA-256 of the content of its source files
  and numpy's version): another version, or an edit, may diagnose
  differently;
- the digest is whole: under `MAX_BYTES`, its CRC-32C matches its body, its
  parts have the fields they are read with.

A digest can make a read cheaper, never different: what it holds is what
reading the files would give, and a digest that cannot be shown to be that
is ignored. A fit writes none where its records stopped (a full disk, a store
that did not answer: the store is not asked again), where its run reads
back damaged (what to say of that is the reader's), where its files are
larger than `MAX_READ_BYTES` (reading them back would hold up the fit's end
longer than it saves), or where another writer wrote into the directory
meanwhile. Nothing of the digest is written into TensorBoard's event files:
a logdir without digests (an older mpprof's) reads as before.

Example:
    run_digest.write("logs/train")  # at a fit's end (the callback does it)
    rows = run_digest.load_many({"train": run_file_states("logs", "train")})
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import pathlib
import secrets
import stat
from collections.abc import Iterable

import google_crc32c
import numpy as np

from mpprof import diagnosis
from mpprof.jsonsafe import json_safe
from mpprof.records import filesystem, reader

NAME = "mpprof.digest.json"
# Bumped when the digest's layout changes.
FORMAT = 1
# A digest is a few kB (a run's findings with their fixes); one larger than
# this is neither written nor read.
MAX_BYTES = 2**20
# A fit whose event files are larger than this writes no digest.
MAX_READ_BYTES = 32 * 2**20
# What each part's "findings" is: counts by severity, or the findings.
_FINDINGS = {"summary": dict, "diagnose": list}


def severity_counts(result: diagnosis.Diagnosis) -> dict[str, int]:
    """How many findings of each severity, most severe first."""
    return {severity: sum(f.severity == severity for f in result.findings)
            for severity in diagnosis.SEVERITIES}


def run_summary(run: reader.Run, result: diagnosis.Diagnosis) -> dict:
    """What the run selector and the comparison table show for one run.

    Args:
        run: the run read.
        result: its diagnosis (for the finding counts by severity).
    """
    context = run.context
    loss_scale = run.loss_scale
    inventory = run.inventory or {}
    leaves = [layer for layer in inventory.get("layers", []) if layer.get("is_leaf")]
    return {
        "run": run.name,
        "model_policy": context.model_policy,
        "optimizer": context.optimizer,
        "jit_compile": context.jit_compile,
        # What float32 matmuls run as (TF32 on Ampere+ by default), in words.
        "float32_matmuls": (context.float32_matmuls or {}).get("setting"),
        "leaf_layers": len(leaves),
        "float32_islands": sum(bool(layer.get("float32_island")) for layer in leaves),
        "casts": len(inventory.get("casts", [])),
        "model_output_dtypes": inventory.get("model", {}).get("output_dtypes"),
        "loss_scale": None
        if loss_scale is None
        else json_safe({
            "initial": loss_scale.initial_scale,
            "final": loss_scale.final_scale,
            "steps_run": loss_scale.steps_run,
            "overflows": loss_scale.skipped_steps,
            "growths": len(loss_scale.growths),
        }, nonfinite_as_null=True),
        "has_numerics": run.numerics is not None,
        "gpu_mode": getattr(run.gpu, "mode", None),
        "warnings": len(run.warnings),
        "findings": severity_counts(result),
        # How the fit stands, read as the CLI reads it (`Run.fit_outcome`):
        # "ended" | "failed" | "cut_short" | "unknown"; and for a run cut
        # short, where its records stop.
        "fit_state": run.fit_outcome,
        "cut_short": run.cut_short,
        "readable": run.readable,
    }


@functools.cache
def code_fingerprint() -> str | None:
    """SHA-256 of the content of mpprof's source files and of numpy's version
    (the rules' statistics): the same on every install of the same code,
    another for another version or an edit; None where they cannot be read
    (no digest is written or trusted then)."""
    root = pathlib.Path(__file__).resolve().parent.parent
    digest = hashlib.sha256(f"numpy {np.__version__}\n".encode())
    try:
        for path in sorted(root.rglob("*.py")):
            digest.update(f"{path.relative_to(root).as_posix()}\0".encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    except OSError:
        return None
    return digest.hexdigest()


def _file_names(states: Iterable[reader.FileState]) -> list[list]:
    """The states as the digest keeps them: the name (within the run's
    directory), size and mtime of each file, in the listing's order."""
    return [[path.rsplit("/", 1)[-1], size, mtime]
            for path, size, mtime in states]


def run_head(run: reader.Run) -> dict:
    """How a run stands, as `mpprof diagnose --format json-runs` lists it
    beside its findings."""
    return {
        "run": run.name,
        "readable": run.readable,
        "fit_state": run.fit_outcome,
        "cut_short": run.cut_short,
        "recording_stopped": run.recording_stopped,
        "warnings": run.warnings,
    }


def findings_of(part: dict) -> list[diagnosis.Finding]:
    """The findings of a digest's "diagnose" part (`load_many`), as
    `diagnosis.evaluate` gave them."""
    return [diagnosis.Finding(**row) for row in part["findings"]]


def write(run_dir: str) -> bool:
    """Reads the run in `run_dir` (its files from every writer so far),
    diagnoses it and writes its digest there; False where it writes none
    (see the module's docstring). Raises OSError where the directory cannot
    be read or written, and whatever reading or diagnosing raises: the
    caller (the fit's end) guards it."""
    states = reader.run_file_states(run_dir, ".")
    if sum(size for _, size, _ in states) > MAX_READ_BYTES or code_fingerprint() is None:
        return False
    run = reader.read_run(run_dir, ".")
    if not run.readable or run.losses:
        return False  # what a reader must say of a damaged run is the reader's
    if run.worker is not None or (run.context.distributed or {}).get("worker_runs"):
        return False  # a job across processes is read with its processes' runs
    result = diagnosis.evaluate(run)
    parts = {"summary": run_summary(run, result),
             "diagnose": {**run_head(run), "findings": [f.to_dict() for f in result.findings]}}
    if reader.run_file_states(run_dir, ".") != states:
        return False  # another writer wrote meanwhile: the row may not be the files'
    body = json.dumps({"format": FORMAT, "code": code_fingerprint(),
                       "files": _file_names(states), **parts},
                      allow_nan=False)  # key order kept: the evidence reads in it
    document = json.dumps({"crc32c": google_crc32c.value(body.encode()), "body": body})
    if len(document) > MAX_BYTES:
        return False
    path = filesystem.join(run_dir, NAME)
    if filesystem.is_remote(path):
        filesystem.write_bytes(path, document.encode())  # one object, whole
        return True
    # Written beside, then renamed over whatever is there (never opened: a
    # FIFO of that name would hold up the fit's end): a reader sees the old
    # digest or the new one, whole.
    # Created as the event files are (0o666 less the umask: readable by
    # whoever may read the records).
    temporary = os.path.join(run_dir, f"{NAME}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(descriptor, "wb") as out:
            out.write(document.encode())
        os.replace(temporary, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return True


def load_many(runs: dict[str, tuple[reader.FileState, ...]],
              part: str = "summary") -> dict[str, dict]:
    """{run: its digest's `part`} for each run of `runs` ({run: the state of
    each of its event files, as listed now}) whose digest holds (see the
    module's docstring); a run without one is left out. Remote digests are
    fetched a batch at a time.

    Args:
        part: "summary", the run list's row (`run_summary`), or "diagnose",
            the run's head (`run_head`) with "findings", each
            `Finding.to_dict()` (`findings_of`). Its "run" is the run's name
            in `runs`.
    """
    paths = {name: filesystem.join(filesystem.dirname(states[0][0]), NAME)
             for name, states in runs.items() if states}
    remote = dict(filesystem.fetch_all(list(paths.values())))
    rows = {}
    for name, path in paths.items():
        data = remote[path] if filesystem.is_remote(path) else _read_local(path)
        if isinstance(data, bytes):
            row = _trusted(data, runs[name], part)
            if row is not None:
                rows[name] = {**row, "run": name}
    return rows


def _read_local(path: str) -> bytes | OSError:
    """At most `MAX_BYTES` + 1 bytes of the regular file `path` (opened
    without blocking: a FIFO of that name is refused, not waited on)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        return e
    with os.fdopen(descriptor, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return OSError(f"{path}: not a regular file")
        try:
            return f.read(MAX_BYTES + 1)
        except OSError as e:
            return e


def _trusted(data: bytes, states: tuple[reader.FileState, ...], part: str) -> dict | None:
    """The `part` of the digest `data` if it holds for the files `states`,
    else None (a stale digest is ordinary, not a fault: nothing is said)."""
    if len(data) > MAX_BYTES:
        return None
    try:
        document = json.loads(data)
        body = document["body"]
        if not isinstance(body, str) or \
                document["crc32c"] != google_crc32c.value(body.encode()):
            return None
        content = json.loads(body)
        code = code_fingerprint()
        if content["format"] != FORMAT or code is None or content["code"] != code:
            return None
        if content["files"] != _file_names(states):
            return None  # written before the files last changed
        row = content[part]
        if not isinstance(row, dict) or not isinstance(row.get("findings"), _FINDINGS[part]):
            return None
        if part == "diagnose":
            findings_of(row)  # each a whole finding, or TypeError
        return row
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None


__all__ = ["FORMAT", "MAX_BYTES", "MAX_READ_BYTES", "NAME", "code_fingerprint", "findings_of",
           "load_many", "run_head", "run_summary", "severity_counts", "write"]
