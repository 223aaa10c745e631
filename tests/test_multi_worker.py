"""MultiWorkerMirroredStrategy: two real worker processes on 127.0.0.1.

tf-keras (Keras 2) trains across workers; the chief writes the model-level
records into `train`, every worker its own run `train/worker_<i>`. Keras 3's
fit cannot run across workers (keras-team/keras#20585): mpprof says so and
changes nothing else about the failure.
"""

import json
import os
import re
import sys

import pytest
from multi_worker_fit import TESTS, run_workers
from tf_keras_env import require_tf_keras

from mpprof import diagnosis
from mpprof.records import reader, schema

WORKERS = 2
TIMEOUT_S = 240

needs_tf_keras = pytest.mark.usefixtures("tf_keras_required")


@pytest.fixture(scope="module")
def tf_keras_required():
    require_tf_keras()


def _worker_outputs(command: list[str], env: dict | None = None) -> list[tuple[dict, str]]:
    """Each worker's JSON line and its stdout, in task order; fails on any failure."""
    found = []
    results = run_workers(command, WORKERS, TIMEOUT_S, env=env)
    for index, (returncode, out, err) in enumerate(results):
        assert returncode == 0, f"worker {index} failed ({returncode}):\n{err[-3000:]}"
        found.append((json.loads(out.strip().splitlines()[-1]), out))
    return found


@pytest.fixture(scope="module")
def tf_keras_cluster(tf_keras_required, tmp_path_factory):
    logdir = tmp_path_factory.mktemp("multi_worker")
    command = [sys.executable, os.path.join(TESTS, "tf_keras_fit.py"), "worker", str(logdir)]
    # Each worker's host gets one fake NVML GPU: its samples must land in its own run.
    # (GPU 0 made visible to the sampler; memory growth in case a real one is there.)
    outputs = _worker_outputs(command, env={
        "MPPROF_TEST_FAKE_GPU": "1", "CUDA_VISIBLE_DEVICES": "0",
        "TF_FORCE_GPU_ALLOW_GROWTH": "true"})
    return logdir, [found["worker"] for found, _ in outputs]


@needs_tf_keras
def test_chief_records_match_the_optimizer(tf_keras_cluster):
    logdir, (chief, worker) = tf_keras_cluster
    run = reader.read_run(logdir, schema.TRAIN_RUN)
    recorded = run.loss_scale
    # Both workers' optimizers went through the same steps (all-reduced gradients).
    assert chief["probe_scales"] == worker["probe_scales"]
    assert chief["probe_skipped"] == worker["probe_skipped"]
    assert len(chief["probe_skipped"]) > 5
    assert recorded.overflow_steps.tolist() == chief["probe_skipped"]
    steps = list(range(len(chief["probe_scales"])))
    assert recorded.scale_after(steps).tolist() == chief["probe_scales"]
    assert recorded.steps_run == chief["iterations"] == worker["iterations"]
    assert chief["patched_after_fit"] == worker["patched_after_fit"] == []
    distributed = run.context["distributed"]
    assert distributed["multi_worker"] and distributed["role"] == "chief"
    assert distributed["num_workers"] == WORKERS
    assert distributed["worker_runs"] == ["train/worker_0", "train/worker_1"]
    assert run.context["num_replicas"] == WORKERS
    assert not run.warnings


@needs_tf_keras
def test_chief_numerics_are_reduced_across_workers(tf_keras_cluster):
    logdir, (chief, _) = tf_keras_cluster
    numerics = reader.read_run(logdir, schema.TRAIN_RUN).numerics
    assert numerics.layers == ["dense", "dense_1"]
    # Sum of counts: the global batch (8 examples per worker) times 8 units.
    assert set(numerics.forward["count"][:, 0]) == {chief["global_batch"] * 8.0}
    # Max of abs-maxima: the largest input only ever reached worker 1.
    assert numerics.forward["abs_max"][-1, 0] == pytest.approx(chief["expected_abs_max"], rel=1e-3)
    assert chief["first_replica_abs_max"] < 0.9 * chief["expected_abs_max"]


@needs_tf_keras
def test_every_worker_writes_its_own_run_and_no_file_is_shared(tf_keras_cluster):
    logdir, (chief, worker) = tf_keras_cluster
    assert reader.list_runs(logdir) == ["train", "train/worker_0", "train/worker_1"]
    writers = {}  # run directory -> pids that wrote mpprof event files into it
    for directory, _, files in os.walk(logdir):
        for name in files:
            # An event file, or the fit-end file its writer keeps beside it.
            pid = re.search(r"(?:tfevents|fit_end)\.\d+\.[^/]+\.(\d+)\.\d+" + re.escape(
                schema.EVENT_FILE_SUFFIX) + "(?:\\.json)?$", name)
            assert pid, name
            run = os.path.relpath(directory, logdir)
            writers.setdefault(run, set()).add(int(pid.group(1)))
    assert writers == {
        "train": {chief["pid"]},
        "train/worker_0": {chief["pid"]},
        "train/worker_1": {worker["pid"]},
    }


@needs_tf_keras
def test_worker_runs_hold_per_worker_evidence_only(tf_keras_cluster):
    logdir, (chief, _) = tf_keras_cluster
    model_run = reader.read_run(logdir, schema.TRAIN_RUN)
    assert model_run.worker is None
    for index in range(WORKERS):
        run = reader.read_run(logdir, f"train/worker_{index}")
        context = run.context
        assert context["run_role"] == "worker"
        assert context["distributed"]["task_index"] == index
        assert context["distributed"]["role"] == ("chief" if index == 0 else "worker")
        assert context["distributed"]["worker_run"] == f"train/worker_{index}"
        assert run.worker["index"] == index and run.worker["model_run"] == "train"
        assert run.worker["role"] == context["distributed"]["role"]
        evidence = run.worker["evidence"]
        assert evidence["steps_run"] == model_run.loss_scale.steps_run
        assert evidence["skipped_steps"] == model_run.loss_scale.skipped_steps
        assert evidence["nonfinite_weights"] == [] and evidence["nonfinite_loss_steps"] == 0
        # Model-level records are the chief's alone.
        assert run.inventory is None and run.loss_scale is None and run.numerics is None
        # This host's GPU samples are here, and only this host's.
        gpu = run.gpu
        assert [device["uuid"] for device in gpu.devices] == [f"GPU-fake-worker-{index}"]
        assert len(gpu.samples) >= 1 and set(gpu.samples[:, 2]) == {0.0}
        assert context["collectors"]["gpu"]["samples_in_runs"] == [f"train/worker_{index}"]
    # The model run holds no GPU samples (they belong to hosts) and says where they are.
    assert model_run.gpu is None or not len(model_run.gpu.samples)
    assert model_run.context["collectors"]["gpu"]["samples_in_runs"] == [
        "train/worker_0", "train/worker_1"]


@needs_tf_keras
def test_diagnosis_reads_every_run(tf_keras_cluster):
    logdir, _ = tf_keras_cluster
    runs = reader.read_logdir(logdir)
    assert sorted(runs) == ["train", "train/worker_0", "train/worker_1"]
    model_codes = {finding.code for finding in diagnosis.diagnose(runs["train"])}
    assert "MP002" in model_codes  # the overflow storm, seen once, by the chief
    for name in ("train/worker_0", "train/worker_1"):
        result = diagnosis.evaluate(runs[name])
        # A worker's own run is judged on its host only (MP010, MP011).
        assert {finding.code for finding in result.findings} <= {"MP010", "MP011"}
        skipped = {c.code for c in result.checks if c.status == "not applicable"}
        assert {"MP001", "MP002", "MP003", "MP012"} <= skipped
        assert name in diagnosis.format_text(runs[name], result)


def test_keras_3_across_workers_is_explained_and_not_made_worse(tmp_path):
    script = os.path.join(TESTS, "keras3_multi_worker_fit.py")
    with_mpprof = _worker_outputs([sys.executable, script, str(tmp_path / "logs")])
    without = _worker_outputs([sys.executable, script, str(tmp_path / "logs"),
                               "--without-mpprof"])
    for (found, out), (baseline, baseline_out) in zip(with_mpprof, without, strict=True):
        # The same upstream failure, with or without mpprof.
        assert baseline["error"] and "PerReplica" in baseline["error"]
        assert found["error"].split("\n")[0] == baseline["error"].split("\n")[0]
        assert found["patched_layers"] == baseline["patched_layers"] == []
        # Said once per worker process, naming the upstream issue and what works.
        assert out.count("keras-team/keras#20585") == 1
        assert "MirroredStrategy" in out and "tf-keras" in out
        assert "keras-team/keras#20585" not in baseline_out


_SLEEPER = """
import json, os, pathlib, sys, time
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
pathlib.Path(sys.argv[1], f"{index}.pid").write_text(str(os.getpid()))
if index == 0 and sys.argv[2] == "fail":
    while len(list(pathlib.Path(sys.argv[1]).glob("*.pid"))) < 2:  # the other is up
        time.sleep(0.05)
    sys.exit(3)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0): it is dead if its status says so.
    with open(f"/proc/{pid}/status") as status:
        return "zombie" not in status.read()


@pytest.mark.parametrize("how", ["fail", "hang"])
def test_launcher_kills_every_worker_when_one_fails_or_all_hang(tmp_path, how):
    command = [sys.executable, "-c", _SLEEPER, str(tmp_path), how]
    if how == "fail":
        results = run_workers(command, WORKERS, timeout_s=TIMEOUT_S)
        assert results[0][0] == 3 and results[1][0] != 0  # the sleeper was killed
    else:
        with pytest.raises(TimeoutError, match="did not finish"):
            run_workers(command, WORKERS, timeout_s=5)
    pids = [int((tmp_path / f"{index}.pid").read_text()) for index in range(WORKERS)]
    assert not any(_alive(pid) for pid in pids)
