"""A repro bundle of a captured step, to attach to a bug report.

`mpprof bundle LOGDIR -o bug.zip` writes one zip file:

    README.txt             what the bundle holds and how to replay it
    replay_bug.py          replays it: `python replay_bug.py` (with mpprof)
    versions.json          mpprof, the framework, Keras, Python, CUDA, driver, GPUs
    findings.json          `mpprof diagnose --format json` of the run
    batch_statistics.json  per batch tensor and per weight: shape, dtype,
                           min, max, mean, abs max, non-finite count
    logdir/RUN/...         the run's mpprof event files and the capture's
                           manifest, model config (the layer configs) and
                           replay result

The batch and the weights can be private: they leave only with
`include_batch=True` (`--include-batch`), as `batch.npz` and `weights.npz`
in the capture's folder; without them the bundle holds statistics and
shapes, and replay_bug.py prints the saved replay result instead of
replaying. Needs no TensorFlow.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Callable

import numpy as np

from mpprof import diagnosis
from mpprof.fix_syntax import FixSyntax
from mpprof.jsonsafe import json_safe
from mpprof.records import filesystem, reader
from mpprof.replay import files

SCRIPT = "replay_bug.py"

_SCRIPT_TEXT = '''\
"""Replays the step captured in this bundle with `mpprof replay`.

Unzip the bundle, then run it where mpprof and the framework that trained the
run (TensorFlow, JAX or PyTorch: README.txt says which) are installed:
    python {script}
"""

import pathlib
import subprocess
import sys

bundle = pathlib.Path(__file__).resolve().parent / "logdir"
if not {include_batch!r}:
    print("This bundle was made without --include-batch: it holds the step's "
          "statistics and shapes, not its batch or weights. The replay result "
          "saved with it:")
    args = ["replay", str(bundle), "--run", {run!r}, "--step", "{step}"]
else:
    args = ["replay", str(bundle), "--run", {run!r}, "--step", "{step}", "--again"]
sys.exit(subprocess.call([sys.executable, "-m", "mpprof.cli", *args]))
'''


def write_bundle(logdir: str | os.PathLike, output: str | os.PathLike, *,
                 run: str | None = None, step: int | None = None,
                 include_batch: bool = False,
                 on_skipped: Callable[[str], None] | None = None) -> dict:
    """Writes the bundle of one capture (see the module docstring).

    Args:
        logdir: the profiler's log_dir.
        output: the zip file to write.
        run: the run (default: the first run with a capture).
        step: the captured step (default: the run's first).
        include_batch: put the batch and the weights in.
        on_skipped: told of each capture folder that is not a readable capture.

    Returns:
        What was written: {"path", "run", "step", "bytes", "files"}.

    Raises:
        mpprof.replay.files.NoCaptureError: no such capture.
        reader.NoMpprofDataError, reader.LogdirNotFoundError: as the reader.
    """
    logdir = os.fspath(logdir)
    names = reader.select_runs(logdir, run)
    with_captures = [name for name in names
                     if files.find_captures(logdir, name, on_skipped=on_skipped)
                     or files.has_capture_folder(logdir, name, step)]
    if not with_captures:
        raise files.NoCaptureError(
            f"no replay capture in {logdir}: nothing to bundle (mpprof captures a step "
            "when a sampled step overflowed or had a non-finite loss)"
        )
    run = with_captures[0]
    capture = files.select_capture(logdir, run, step)
    read = reader.read_run(logdir, run)
    findings = [f.to_dict() for f in diagnosis.evaluate(read).findings] if read.readable else []
    context = read.context
    hardware = context.hardware or {}
    versions = {
        **capture.manifest.get("versions", {}),
        "keras_flavor": context.keras_flavor,
        "cuda_driver_version": hardware.get("cuda_driver_version"),
        "driver_version": hardware.get("driver_version"),
        "gpus": [
            {key: gpu.get(key) for key in ("name", "architecture", "compute_capability")}
            for gpu in hardware.get("gpus", [])
        ],
        "devices": context.get("devices"),  # None (not []) when not recorded
    }
    statistics = {
        "batch": [_statistics(a) for a in _leaves(capture)],
        "weights": {path: _statistics(w) for path, w in capture.weights().items()},
    }
    capture_folder = f"logdir/{run}/{files.step_folder(capture.step)}"
    contents = {
        "README.txt": _readme(run, capture.step, include_batch, FixSyntax(
            context.keras_flavor, capture.manifest.get("backend")).framework).encode(),
        SCRIPT: _SCRIPT_TEXT.format(script=SCRIPT, include_batch=include_batch, run=run,
                                    step=capture.step).encode(),
        "versions.json": files.json_bytes(json_safe(versions)),
        "findings.json": files.json_bytes(json_safe(findings)),
        "batch_statistics.json": files.json_bytes(json_safe(statistics)),
    }
    for path in reader.event_files(logdir, run):
        contents[f"logdir/{run}/{os.path.basename(path)}"] = _read(path)
    wanted = [files.MANIFEST, files.MODEL_CONFIG, files.RESULT]
    if include_batch:
        wanted += [files.BATCH, files.WEIGHTS]
    for name in wanted:
        path = filesystem.join(capture.path, name)
        try:
            contents[f"{capture_folder}/{name}"] = _read(path)
        except OSError:
            continue  # no model config, or not replayed yet
    with zipfile.ZipFile(output, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in contents.items():
            archive.writestr(name, data)
    return {"path": os.fspath(output), "run": run, "step": capture.step,
            "bytes": os.path.getsize(output), "files": sorted(contents)}


def _leaves(capture: files.Capture) -> list[np.ndarray]:
    leaves: list = []
    files.encode_structure(capture.batch(), leaves)
    return leaves


def _statistics(array: np.ndarray) -> dict:
    values = np.asarray(array)
    stats = {"shape": list(values.shape), "dtype": str(values.dtype)}
    if values.size and np.issubdtype(values.dtype, np.number):
        as_float = values.astype(np.float64)
        finite = as_float[np.isfinite(as_float)]
        stats.update(
            nonfinite=int(values.size - finite.size),
            min=float(finite.min()) if finite.size else None,
            max=float(finite.max()) if finite.size else None,
            mean=float(finite.mean()) if finite.size else None,
            abs_max=float(np.abs(finite).max()) if finite.size else None,
        )
    return stats


def _readme(run: str, step: int, include_batch: bool, framework: str) -> str:
    held = ("the batch and the weights of the step (batch.npz, weights.npz)"
            if include_batch else
            "no batch and no weights: only their statistics and shapes "
            "(batch_statistics.json); made without --include-batch")
    return (
        f"mpprof repro bundle: run {run}, step {step}.\n\n"
        f"It holds {held}, the model's layer configs (model.json), every layer's "
        "dtype policy (manifest.json), the versions (versions.json), the findings "
        "(findings.json), the run's mpprof records and the replay result "
        f"(replay.json, when the step was replayed).\n\nReplay it: unzip, then "
        f"`python {SCRIPT}` (needs mpprof; {framework} to replay).\n"
    )


def _read(path: str) -> bytes:
    with filesystem.open_file(path) as f:
        return f.read()
