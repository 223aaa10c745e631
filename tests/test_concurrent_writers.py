"""Two fits writing into one log_dir at once are kept apart when read, their
replay captures too; fits one after the other stay one run. Real fits in two
processes on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np

from mpprof import cli
from mpprof.records import reader, schema
from mpprof.records.writer import RecordWriter
from mpprof.replay import files

TESTS = os.path.dirname(__file__)

_FIT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[1])
    import keras, mpprof
    from conftest import mnist_like, overflow_data, overflow_model, seed_model
    overflowing = sys.argv[3] == "overflow"
    model = overflow_model(growth_steps=4) if overflowing else seed_model()
    x, y = overflow_data(256) if overflowing else mnist_like(256)
    captures = len(sys.argv) > 4  # a forward overflow at every step, captured
    if captures:
        big = keras.initializers.Constant(300.0)
        model = keras.Sequential([keras.layers.Input((8,)),
                                  keras.layers.Dense(16, kernel_initializer=big),
                                  keras.layers.Dense(16, kernel_initializer=big),
                                  keras.layers.Dense(1, dtype="float32")])
        model.compile(optimizer="sgd", loss="mse")
        x = x * float(sys.argv[4])  # tells the fits' batches apart
    class Slow(keras.callbacks.Callback):  # both fits overlap for sure
        def on_train_batch_end(self, batch, logs=None):
            time.sleep(0.05)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[
        Slow(), mpprof.MixedPrecisionProfiler(sys.argv[2], gpu_interval=None,
                                              flush_every_steps=4,
                                              numerics_every=4 if captures else 500)])
""")


def test_two_concurrent_fits_into_one_log_dir_are_two_runs_never_one_series(tmp_path):
    env = {**os.environ, "TF_ENABLE_ONEDNN_OPTS": "0", "TF_CPP_MIN_LOG_LEVEL": "2"}
    fits = [subprocess.Popen([sys.executable, "-c", _FIT, TESTS, str(tmp_path), kind],
                             env=env, stderr=subprocess.PIPE, text=True)
            for kind in ("healthy", "overflow")]
    for fit in fits:
        assert fit.wait(timeout=300) == 0, fit.stderr.read()[-2000:]
    runs = reader.read_logdir(tmp_path)
    assert len(runs) == 2 and "train" in runs, sorted(runs)
    (other,) = [name for name in runs if name != "train"]
    assert other.startswith("train@")
    series = sorted((run.loss_scale.skipped_steps, run.loss_scale.steps_run)
                    for run in runs.values())
    # One healthy series (no skipped step) and one that overflowed; each
    # counts only its own 32 steps.
    assert series[0][0] == 0 and series[1][0] > 0, series
    assert all(steps <= 32 for _, steps in series), series
    for run in runs.values():
        assert run.cut_short is None


def test_two_concurrent_overflowing_fits_keep_their_own_replay_captures(tmp_path, capsys):
    """Both fits overflow at the same steps and capture them: each capture is
    found under the run of the fit that took it (its batch is that fit's: ones
    times 1 or times 2), none is lost, and each replays under its own run."""
    env = {**os.environ, "TF_ENABLE_ONEDNN_OPTS": "0", "TF_CPP_MIN_LOG_LEVEL": "2"}
    fits = [subprocess.Popen([sys.executable, "-c", _FIT, TESTS, str(tmp_path), "overflow",
                              factor], env=env, stderr=subprocess.PIPE, text=True)
            for factor in ("1", "2")]
    for fit in fits:
        assert fit.wait(timeout=300) == 0, fit.stderr.read()[-2000:]
    names = reader.list_runs(tmp_path)
    assert len(names) == 2, names
    factors = {}
    for name in names:
        captures = files.find_captures(tmp_path, name)
        context = reader.read_run(tmp_path, name).context
        captured = context["collectors"]["replay_capture"]["captures"]
        assert [c.step for c in captures] == [c["step"] for c in captured], name
        factors[name] = {float(np.unique(c.batch()[0])[0]) for c in captures}
    assert sorted(map(sorted, factors.values())) == [[1.0], [2.0]], factors
    other = next(name for name in names if name != "train")
    step = files.find_captures(tmp_path, other)[0].step
    assert cli.main(["replay", str(tmp_path), "--run", other, "--step", str(step),
                     "--format", "json"]) == cli.EXIT_OK
    result = json.loads(capsys.readouterr().out)
    assert result["run"] == other and result["step"] == step


def test_writers_one_after_the_other_stay_one_run(tmp_path):
    for step in (0, 10):
        writer = RecordWriter(tmp_path / "train")
        writer.write_array(schema.LOSS_SCALE_PROGRESS, [step + 10, 2.0**15, 0.0], step + 10)
        writer.close()
        time.sleep(1.1)  # the next writer starts after this one's last write
    assert reader.list_runs(tmp_path) == ["train"]
    assert reader.read_run(tmp_path, "train").loss_scale.steps_run == 20


def test_two_writers_at_once_in_one_process_are_two_runs(tmp_path):
    first = RecordWriter(tmp_path / "train")
    second = RecordWriter(tmp_path / "train")
    for writer, scale in ((first, 2.0**15), (second, 4.0)):
        writer.write_array(schema.LOSS_SCALE_PROGRESS, [8, scale, 0.0], 8)
    time.sleep(1.1)
    first.write_array(schema.LOSS_SCALE_PROGRESS, [9, 2.0**15, 0.0], 9)
    for writer in (first, second):
        writer.close()
    names = reader.list_runs(tmp_path)
    assert len(names) == 2 and names[0] == "train" and names[1].startswith("train@")
    scales = {name: reader.read_run(tmp_path, name).loss_scale.final_scale for name in names}
    assert scales == {"train": 2.0**15, names[1]: 4.0}
