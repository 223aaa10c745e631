"""Keras on JAX across processes: `keras.distribution.DataParallel` over
`jax.distributed`, two real processes on 127.0.0.1 (CPU collectives over
gloo). One job, one model run: process 0 writes the model-level records
(the step's statistics are of the global batch), each process its own run
`train/worker_<i>` with its devices and its captures, which hold its own
rows of the batch."""

import json
import os
import re
import subprocess
import sys

import pytest
from multi_worker_fit import run_workers

from mpprof import diagnosis
from mpprof.records import reader, schema

HERE = os.path.dirname(os.path.abspath(__file__))
PROCESSES = 2


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("jax_processes")
    results = run_workers([sys.executable, os.path.join(HERE, "jax_multi_process_fit.py"),
                           str(logdir)], PROCESSES, timeout_s=300)
    seen = []
    for index, (returncode, out, err) in enumerate(results):
        assert returncode == 0, f"process {index} failed ({returncode}):\n{err[-3000:]}"
        seen.append(json.loads(out.strip().splitlines()[-1]))
    return logdir, seen


def test_one_model_run_written_by_process_0_and_a_run_per_process(job):
    logdir, (first, second) = job
    assert reader.list_runs(logdir) == ["train", "train/worker_0", "train/worker_1"]
    writers = {}  # run directory -> pids whose event or fit-end files are in it
    for directory, _, names in os.walk(logdir):
        for name in names:
            pid = re.search(r"(?:tfevents|fit_end)\.\d+\.[^/]+\.(\d+)\.\d+", name)
            if pid:
                writers.setdefault(os.path.relpath(directory, logdir), set()).add(
                    int(pid.group(1)))
    assert writers == {"train": {first["pid"]}, "train/worker_0": {first["pid"]},
                       "train/worker_1": {second["pid"]}}
    distributed = reader.read_run(logdir, schema.TRAIN_RUN).context.distributed
    assert distributed["multi_worker"] and distributed["role"] == "chief"
    assert distributed["task_type"] == "process" and distributed["num_workers"] == PROCESSES


def test_model_records_are_the_jobs_once_each(job):
    logdir, (first, second) = job
    run = reader.read_run(logdir, schema.TRAIN_RUN)
    # Both processes' optimizers went through the same steps: the job's.
    assert first["probe_scales"] == second["probe_scales"]
    steps = list(range(len(first["probe_scales"])))
    assert run.loss_scale.scale_after(steps).tolist() == first["probe_scales"]
    assert run.loss_scale.steps_run == len(steps)
    assert run.loss_scale.skipped_steps == len(steps) - first["iterations"] > 0
    numerics = run.numerics
    # One row per sampled step (no process wrote its own copy), and each
    # statistic is of the global batch: 16 rows x 32 units.
    assert len(set(numerics.steps.tolist())) == len(numerics.steps)
    assert set(numerics.forward["count"][:, 0]) == {16 * 32.0}
    # The large input only process 1 fed (step 2) is in the job's abs max.
    abs_max = dict(zip(numerics.steps.tolist(), numerics.forward["abs_max"][:, 0], strict=True))
    assert abs_max[2] > 10 * max(abs_max[step] for step in (1, 3))
    assert not run.warnings


def test_each_process_keeps_its_own_devices(job):
    logdir, seen = job
    for index, process in enumerate(seen):
        run = reader.read_run(logdir, f"train/worker_{index}")
        assert run.worker["index"] == index and run.worker["model_run"] == "train"
        assert [d["name"] for d in run.context.devices] == process["local_devices"]
        # Model-level records are process 0's alone, in the model run.
        assert run.loss_scale is None and run.numerics is None
    model_devices = reader.read_run(logdir, schema.TRAIN_RUN).context.devices
    assert len(model_devices) == PROCESSES


def test_captures_hold_their_process_rows_and_replay_under_the_model_run(job):
    logdir, _ = job
    from mpprof.replay import files

    for index in range(PROCESSES):
        captures = files.find_captures(str(logdir), f"train/worker_{index}")
        assert [c.step for c in captures] == [2, 4]  # the two skipped steps
        shard = captures[0].manifest["batch_shard"]
        assert shard == {"process": index, "processes": PROCESSES, "rows": 8,
                         "global_rows": 16}
    assert files.find_captures(str(logdir), schema.TRAIN_RUN) == []
    done = subprocess.run(
        [sys.executable, "-m", "mpprof.cli", "diagnose", str(logdir), "--replay",
         "--format", "json", "--run", "train"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "KERAS_BACKEND": "jax"})
    assert done.returncode in (0, 1), done.stderr[-2000:]
    rows = json.loads(done.stdout)
    mp003 = next(row for row in rows if row["code"] == "MP003")
    # Process 1's rows overflowed; process 0's did not: its capture's replay
    # finds nothing and is shown after.
    replay = mp003["replay"]
    assert replay["run"] == "train/worker_1" and replay["first_op"] is not None
    assert "process 1's 8 of the global batch's 16 rows" in " ".join(replay["notes"])


def test_worker_runs_are_judged_on_their_host(job):
    logdir, _ = job
    runs = reader.read_logdir(logdir)
    assert "MP003" in {f.code for f in diagnosis.diagnose(runs["train"])}
    for index in range(PROCESSES):
        codes = {f.code for f in diagnosis.diagnose(runs[f"train/worker_{index}"])}
        assert codes <= {"MP010", "MP011"}
