"""The files of a replay capture, and of the replay result beside it.

A capture is one folder per captured step, `RUN/replay/step_<N>@<writer>/`
(`step_<N>/` before captures were named by their writer):

    manifest.json   what was captured: step, run, why, shapes, bytes,
                    versions, the dtype policy of each layer, and whether
                    the weights are the ones the step ran with
    batch.npz       the step's batch, every tensor of (x, y, sample_weight)
                    as `leaf_<i>`; the manifest's "batch_structure" puts them
                    back into their nested lists, tuples and dicts
    weights.npz     every model variable (`model.weights`), as `weight_<i>`;
                    the manifest lists their paths in the same order
    model.json      the model's Keras serialization, when it has one
    replay.json     the replay result, once `mpprof replay` ran

The manifest is written last: a folder without one (a disk that filled up
midway) is not a capture. Reading needs neither TensorFlow nor Keras.

`<writer>` is the id of the writer of the fit's records
(`run_files.writer_id`): where two fits write into one run directory at
once, each one's records are a run of their own (`train@<host>-<pid>`), and
each capture is found under the run of the fit that took it, never mixed
into the other's or overwritten by it.
"""

from __future__ import annotations

import io
import json
import os
import re
import zipfile
from collections.abc import Callable

import numpy as np

from mpprof.records import filesystem, run_files

# What a damaged .npz raises while it is opened or read: a truncated or
# overwritten zip (BadZipFile), a member cut short (EOFError, ValueError), a
# missing member (KeyError).
_DAMAGED_NPZ = (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile)

# Bump when a file's layout changes; readers refuse newer captures.
CAPTURE_VERSION = 1

REPLAY_FOLDER = "replay"
# Batches kept for the precision advisor (`advise_batches=N`): the same files,
# in their own folder, so that `mpprof replay` never takes one for a step
# that went wrong.
ADVISE_FOLDER = "advise"
STEP_FOLDER_PREFIX = "step_"
MANIFEST = "manifest.json"
BATCH = "batch.npz"
WEIGHTS = "weights.npz"
MODEL_CONFIG = "model.json"
RESULT = "replay.json"

_STEP_FOLDER = re.compile(r"^step_(\d+)(?:@(.+))?$")


class NoCaptureError(LookupError):
    """No replay capture where one was asked for (the message says what to do)."""


class ReplayError(ValueError):
    """A capture cannot be replayed (the message says what to do)."""


def step_folder(step: int, writer: str | None = None, folder: str = REPLAY_FOLDER) -> str:
    """The capture's folder for `step`, relative to its run directory, named
    by the `writer` of the fit that took it (None: a writer that writes
    nothing, or the folder of captures older than writer names); `folder`:
    REPLAY_FOLDER, or ADVISE_FOLDER for the advisor's batches."""
    name = f"{STEP_FOLDER_PREFIX}{int(step)}"
    return f"{folder}/{name}@{writer}" if writer else f"{folder}/{name}"


def encode_structure(structure, leaves: list) -> object:
    """A JSON-able description of a nested batch; its array leaves are
    appended to `leaves` (None stays None)."""
    if structure is None:
        return None
    if isinstance(structure, dict):
        return {"dict": {str(k): encode_structure(v, leaves) for k, v in structure.items()}}
    if isinstance(structure, (list, tuple)):
        kind = "tuple" if isinstance(structure, tuple) else "list"
        return {kind: [encode_structure(v, leaves) for v in structure]}
    leaves.append(structure)
    return {"leaf": len(leaves) - 1}


def decode_structure(encoded, leaves: list):
    """The nested batch `encode_structure` described, with its leaves."""
    if encoded is None:
        return None
    if "leaf" in encoded:
        return leaves[encoded["leaf"]]
    if "dict" in encoded:
        return {k: decode_structure(v, leaves) for k, v in encoded["dict"].items()}
    if "tuple" in encoded:
        return tuple(decode_structure(v, leaves) for v in encoded["tuple"])
    return [decode_structure(v, leaves) for v in encoded["list"]]


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def json_bytes(value) -> bytes:
    return json.dumps(value, indent=1, sort_keys=True).encode("utf-8")


class Capture:
    """One captured step, read from its folder.

    Args:
        path: the capture's folder (local or remote).
        run: the run it belongs to.

    Raises:
        NoCaptureError: the folder holds no readable manifest.
    """

    def __init__(self, path: str, run: str):
        self.path = path
        self.run = run
        manifest = filesystem.join(path, MANIFEST)
        try:
            self.manifest = json.loads(_read(manifest))
            if not isinstance(self.manifest, dict) or not isinstance(
                    self.manifest.get("step"), int):
                raise ValueError("not a capture manifest (no integer \"step\")")
        except FileNotFoundError as e:
            raise NoCaptureError(
                f"{path} is not a complete replay capture (no {MANIFEST}): the fit "
                "stopped writing it (a full disk, or killed); nothing to replay there"
            ) from e
        except (OSError, ValueError) as e:
            raise NoCaptureError(
                f"{manifest} cannot be read ({_reason(e)}): the capture is damaged; "
                "replay another step (--step) or record the fit again"
            ) from e
        version = self.manifest.get("capture_version")
        if not isinstance(version, int) or version > CAPTURE_VERSION:
            raise NoCaptureError(
                f"{path} was captured by a newer mpprof (capture version {version!r}); "
                "upgrade mpprof to replay it"
            )

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    def batch(self):
        """The step's batch, as the train step received it (numpy arrays).

        Raises:
            ReplayError: the capture holds no batch (a bundle made without
                `--include-batch`), or it cannot be read.
        """
        path = filesystem.join(self.path, BATCH)
        try:
            return self._batch()
        except FileNotFoundError as e:
            raise ReplayError(
                f"the capture of step {self.step} in {self.path} has no batch ({e}); a "
                "bundle made without --include-batch holds only statistics: its replay "
                "result is printed by `mpprof replay` without --again"
            ) from e
        except _DAMAGED_NPZ as e:
            raise ReplayError(_damaged(path, e)) from e

    def _batch(self):
        with np.load(io.BytesIO(_read(filesystem.join(self.path, BATCH)))) as arrays:
            leaves = [arrays[f"leaf_{i}"] for i in range(len(arrays.files))]
        return decode_structure(self.manifest["batch_structure"], leaves)

    def weights(self) -> dict[str, np.ndarray]:
        """Every model variable's value, by its path.

        Raises:
            ReplayError: the capture holds no weights, or they cannot be read.
        """
        path = filesystem.join(self.path, WEIGHTS)
        try:
            return self._weights()
        except FileNotFoundError as e:
            raise ReplayError(
                f"the capture of step {self.step} in {self.path} has no weights ({e}); a "
                "bundle made without --include-batch holds only statistics"
            ) from e
        except _DAMAGED_NPZ as e:
            raise ReplayError(_damaged(path, e)) from e

    def _weights(self) -> dict[str, np.ndarray]:
        with np.load(io.BytesIO(_read(filesystem.join(self.path, WEIGHTS)))) as arrays:
            values = [arrays[f"weight_{i}"] for i in range(len(arrays.files))]
        return dict(zip(self.manifest["weight_paths"], values, strict=True))

    def model_config(self) -> dict | None:
        """The model's Keras serialization, or None when it had none."""
        if not self.manifest.get("model_config", {}).get("saved"):
            return None
        path = filesystem.join(self.path, MODEL_CONFIG)
        try:
            return json.loads(_read(path))
        except (OSError, ValueError) as e:
            raise ReplayError(_damaged(path, e)) from e

    def result(self) -> dict | None:
        """The saved replay result, or None before the first replay."""
        try:
            return json.loads(_read(filesystem.join(self.path, RESULT)))
        except (OSError, ValueError):
            return None


def find_captures(logdir: str | os.PathLike, run: str,
                  on_skipped: Callable[[str], None] | None = None,
                  folder: str = REPLAY_FOLDER) -> list[Capture]:
    """Every complete capture of `run`, by step.

    Args:
        on_skipped: called with one line for each capture folder that is not
            offered (no manifest, or a damaged one), so it is never skipped
            without a word where the caller shows warnings.
        folder: REPLAY_FOLDER (steps that went wrong) or ADVISE_FOLDER (the
            batches kept for the advisor).
    """
    return _scan_captures(logdir, run, on_skipped, folder)[0]


def has_capture_folder(logdir: str | os.PathLike, run: str, step: int | None) -> bool:
    """Whether `run` has a folder for the capture of `step`, readable or not
    (asking for a damaged one must name its damage, not say it is missing)."""
    if step is None:
        return False
    captures, skipped = _scan_captures(logdir, run)
    return step in skipped or any(capture.step == step for capture in captures)


def _scan_captures(logdir, run, on_skipped=None,
                   kind: str = REPLAY_FOLDER) -> tuple[list[Capture], dict[int, str]]:
    """(the complete captures, {step: why it is not one} for the others)."""
    logdir = os.fspath(logdir)
    try:
        directory, writers = run_files.writers_of_directory(logdir, run)
    except (OSError, LookupError):  # not a run of records: its own folder, if any
        directory, writers = run, {}
    suffix = run[len(directory):]
    folder = filesystem.join(logdir if directory == "." else filesystem.join(logdir, directory),
                             kind)
    try:
        entries = filesystem.scan(folder)
    except OSError:
        return [], {}
    # A capture named by a writer belongs to that writer's run; an older
    # one, or one whose writer left no records here, to the directory's run.
    found = sorted(
        (int(match.group(1)), entry.name) for entry in entries
        if entry.kind is filesystem.Kind.DIRECTORY
        and (match := _STEP_FOLDER.match(entry.name))
        and writers.get(match.group(2) or "", "") == suffix
    )
    captures, skipped = [], {}
    for step, name in found:
        try:
            captures.append(Capture(filesystem.join(folder, name), run))
        except NoCaptureError as e:
            skipped[step] = str(e)
            if on_skipped is not None:
                on_skipped(f"run {run}: capture of step {step} skipped: {e}")
    return captures, skipped


def select_capture(logdir: str | os.PathLike, run: str, step: int | None,
                   on_skipped: Callable[[str], None] | None = None) -> Capture:
    """The capture of `run` at `step` (None: the first one).

    Raises:
        NoCaptureError: none there; the message lists what there is.
        ReplayError: the capture of `step` is damaged (the message names the file).
    """
    captures, skipped = _scan_captures(logdir, run, None if step is not None else on_skipped)
    if step is not None and step in skipped:
        raise ReplayError(skipped[step])
    if not captures:
        raise NoCaptureError(
            f"run {run!r} of {os.fspath(logdir)} holds no replay capture: mpprof "
            "captures a step only when an instrumented (sampled) step overflowed or "
            "had a non-finite loss, with replay_budget > 0"
        )
    if step is None:
        return captures[0]
    for capture in captures:
        if capture.step == step:
            return capture
    raise NoCaptureError(
        f"run {run!r} has no capture of step {step}; captured steps: "
        f"{', '.join(str(c.step) for c in captures)}"
    )


def saved_results(logdir: str | os.PathLike, run: str) -> list[dict]:
    """The saved replay result of every capture of `run` that has one."""
    return [result for capture in find_captures(logdir, run)
            if (result := capture.result()) is not None]


def write_result(capture: Capture, result: dict) -> None:
    """Saves a replay result beside its capture."""
    filesystem.write_bytes(filesystem.join(capture.path, RESULT), json_bytes(result))


def _read(path: str) -> bytes:
    with filesystem.open_file(path, large=True) as f:  # weights may be large
        return f.read()


def _reason(error: BaseException) -> str:
    if isinstance(error, OSError):
        return filesystem.error_text(error)
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _damaged(path: str, error: BaseException) -> str:
    """One line: which file of a capture is damaged, and what to do."""
    return (f"{path} cannot be read ({_reason(error)}): the capture is damaged (cut "
            "short or overwritten); replay another step (--step) or record the fit again")
