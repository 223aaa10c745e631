"""Replay captures (the callback) and their replay (mpprof.replay): real CPU
training of tiny models whose float16 step overflows in a known place."""

import json
import pathlib
import shutil
import subprocess
import sys
import textwrap
import zipfile

import keras
import numpy as np
import pytest
from browser import load_page, require_chromium, serve_tensorboard

import mpprof
from mpprof import cli, report
from mpprof.backends import keras_capture
from mpprof.backends.tensorflow import replay_engine as engine
from mpprof.backends.tensorflow import replay_passes as passes
from mpprof.records import reader
from mpprof.replay import files, replay, verification

TESTS = __file__.rsplit("/", 1)[0]


def _constant(value):
    return keras.initializers.Constant(value)


def third_dense_model(third_kernel: float = 5000.0) -> keras.Model:
    """Ones through Dense(0.1) twice reach the third Dense at 1.28: with a
    kernel of 5000 its float16 MatMul gives 1.28 * 16 * 5000 > 65504. The
    last layer's tiny kernel keeps the float32 loss and gradients small."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    model = keras.Sequential([
        keras.layers.Input((8,)),
        keras.layers.Dense(16, kernel_initializer=_constant(0.1), name="d1"),
        keras.layers.Dense(16, kernel_initializer=_constant(0.1), name="d2"),
        keras.layers.Dense(16, kernel_initializer=_constant(third_kernel), name="d3"),
        keras.layers.Dense(1, kernel_initializer=_constant(1e-6), dtype="float32",
                           name="out"),
    ], name="third_dense")
    model.compile(optimizer=_trial_optimizer(), loss="mse")
    return model


def _trial_optimizer(rate: float = 1e-9):
    """Adam at a tiny rate. The overflowing steps are skipped, so the weights
    stay as initialised whatever the rate; verifying a fix then trains 30
    steps from them (`mpprof.replay.verification`), and float32 must learn in
    those for any fix to be verified. Adam's steps are about its rate whatever
    the gradient's scale, so these constant-initialised models, whose
    activations reach 1e5, learn without diverging."""
    return keras.optimizers.Adam(rate)


def _fit(model, logdir, x=None, y=None, **profiler_kwargs):
    x = np.ones((32, 8), "float32") if x is None else x
    y = np.ones((len(x), 1), "float32") if y is None else y
    profiler_kwargs.setdefault("numerics_every", 2)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False,
              callbacks=[mpprof.MixedPrecisionProfiler(str(logdir), **profiler_kwargs)])
    return reader.read_run(str(logdir), "train").context["collectors"]["replay_capture"]


def test_third_dense_overflow_is_captured_and_replay_names_the_op_and_a_verified_fix(tmp_path):
    model = third_dense_model()
    state = _fit(model, tmp_path)
    # Every step overflows (skipped, so the weights never change); the budget
    # of 2 allows two captures, of sampled steps only.
    assert state["state"] == "ok" and [c["step"] for c in state["captures"]] == [1, 2]
    capture = files.select_capture(str(tmp_path), "train", None)
    manifest = capture.manifest
    assert manifest["step"] == 1 and manifest["weights_are_the_steps"] is True
    assert "overflow: the loss scale skipped the step" in manifest["reasons"]
    assert manifest["batch_shapes"] == [[8, 8], [8, 1]] and manifest["batch_size"] == 8
    assert manifest["layer_policies"]["d3"] == "mixed_float16"
    assert manifest["layer_policies"]["out"] == "float32"
    # The skipped step ran with the weights the model still has.
    for path, value in capture.weights().items():
        trained = next(v for v in model.weights if v.path == path)
        np.testing.assert_array_equal(value, trained.numpy())
    x, y = capture.batch()
    np.testing.assert_array_equal(x, np.ones((8, 8), "float32"))

    result = replay(str(tmp_path))  # rebuilt from the config, in float16 as trained
    assert result["run"] == "train" and result["step"] == 1
    first = result["first_op"]
    assert first["layer"] == "d3" and first["op"] in ("MatMul", "BiasAdd", "AddV2")
    assert first["phase"] == "forward" and first["dtype"] == "float16"
    assert first["input_abs_max"] == [pytest.approx(1.28, rel=1e-2), 5000.0]
    assert "inf" in first["output"]
    ranked = [row["layer"] for row in result["divergence"]]
    assert set(ranked) == {"d1", "d2", "d3"} and ranked[0] == "d3"
    d3 = result["divergence"][0]
    assert d3["forward_rel_error"] == "inf"
    d1 = next(r for r in result["divergence"] if r["layer"] == "d1")
    assert 0 < d1["forward_rel_error"] < 1e-2  # float16 rounding, no more
    assert result["float32_layers"] == ["d3"]
    assert result["policy_map"] == {"third_dense/d3": "float32"}
    assert result["dtype_lines"] == ['d3: Dense(..., name="d3", dtype="float32")']
    # Verified now means within the stated tolerances of float32 on the step
    # and a 30-step trial that learns like float32 (no longer "finite").
    assert result["verified"] is True, result["verified_detail"]
    assert result["verified_detail"].startswith("verified: on the captured step no overflow")
    assert result["lead_fix"] == "float32_layers"
    assert result["tolerances"] == {"dtype": "float16", **verification.TOLERANCES["float16"],
                                    "headroom": verification.HEADROOM_FACTOR}
    trial = result["trial"]
    assert trial["passed"] is True and len(trial["candidate_losses"]) == 30
    assert trial["progress"] >= verification.TRIAL_MIN_PROGRESS
    step_check = result["verification"]["step"][0]
    assert step_check["loss_rel_error"] <= 1e-2 and step_check["failed"] is None
    # Saved beside the capture, as strict JSON.
    saved = files.select_capture(str(tmp_path), "train", 1).result()
    assert saved["first_op"] == first and saved["verified"] is True

    # The fix works in the model itself: d3 in float32, the same step is finite.
    fixed = third_dense_model()
    fixed.layers[2].dtype_policy = "float32"
    fixed.set_weights(model.get_weights())
    assert np.all(np.isfinite(fixed(x, training=True).numpy()))
    assert not np.all(np.isfinite(model(x, training=True).numpy()))


def test_the_healthy_twin_captures_nothing(tmp_path):
    state = _fit(third_dense_model(third_kernel=0.1), tmp_path)
    assert state == {"state": "ok", "budget": 2, "captures": []}
    assert files.find_captures(str(tmp_path), "train") == []
    with pytest.raises(files.NoCaptureError, match="holds no replay capture"):
        replay(str(tmp_path))


def _spiky_model(initial_scale: float) -> keras.Model:
    """A healthy float16 Dense whose loss stays finite; its scaled gradients
    overflow while the loss scale is too high or a batch spikes."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    model = keras.Sequential([
        keras.layers.Input((8,)),
        keras.layers.Dense(16, kernel_initializer=_constant(0.1), name="hidden"),
        keras.layers.Dense(1, kernel_initializer=_constant(0.1), dtype="float32", name="out"),
    ], name="spiky")
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(1e-9), initial_scale=initial_scale)
    model.compile(optimizer=optimizer, loss="mse")
    return model


def test_the_loss_scales_initial_descent_is_not_captured(tmp_path):
    # 2**40 overflows the first steps' float16 gradients; each skip halves
    # it: the descent every run with a high initial scale goes through.
    state = _fit(_spiky_model(2.0**40), tmp_path, numerics_every=1)
    run = reader.read_run(str(tmp_path), "train")
    assert run.loss_scale.skipped_steps >= 2  # the descent happened, sampled
    assert state["captures"] == [] and files.find_captures(str(tmp_path), "train") == []
    assert state["initial_descent_not_captured"] == run.loss_scale.skipped_steps - 1


def test_an_overflow_after_finite_steps_is_captured_even_with_a_finite_loss(tmp_path):
    # Its look-alike: two finite steps, then a batch 1000x larger whose
    # scaled gradients overflow float16 while the float32 loss stays finite.
    x = np.ones((32, 8), "float32")
    x[16:24] *= 1000.0
    state = _fit(_spiky_model(2.0**15), tmp_path, x=x, numerics_every=1)
    assert [c["step"] for c in state["captures"]] == [2]
    capture = files.select_capture(str(tmp_path), "train", None)
    assert capture.manifest["reasons"] == ["overflow: the loss scale skipped the step"]
    assert "initial_descent_not_captured" not in state


def test_replay_budget_0_captures_nothing(tmp_path):
    state = _fit(third_dense_model(), tmp_path, replay_budget=0)
    assert state["state"] == "off" and state["reason"] == "replay_budget=0"
    assert files.find_captures(str(tmp_path), "train") == []


def test_without_numerics_samples_nothing_is_captured_and_the_context_says_why(tmp_path):
    state = _fit(third_dense_model(), tmp_path, numerics_every=None)
    assert state["state"] == "off" and "numerics_every=None" in state["reason"]
    assert files.find_captures(str(tmp_path), "train") == []


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_replay_budget_is_validated(bad):
    with pytest.raises(ValueError, match="replay_budget must be a non-negative integer"):
        mpprof.MixedPrecisionProfiler("logs", replay_budget=bad)


class Block(keras.layers.Layer):
    """Two Dense layers; the second's float16 output overflows."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(16, kernel_initializer=_constant(0.1), name="inner")
        self.blowup = keras.layers.Dense(16, kernel_initializer=_constant(5000.0),
                                         name="blowup")

    def call(self, x):
        return self.blowup(self.inner(x))


class Net(keras.Model):
    def __init__(self):
        super().__init__()
        self.block = Block(name="block")
        self.head = keras.layers.Dense(1, kernel_initializer=_constant(1e-6),
                                       dtype="float32", name="head")

    def call(self, x):
        return self.head(self.block(x))


def test_subclassed_nested_block_trained_under_xla_replays_eagerly_in_process(tmp_path):
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    model = Net()
    model.compile(optimizer=_trial_optimizer(), loss="mse", jit_compile=True)
    x = np.full((32, 8), 2.0, "float32")  # 1.6 * 16 * 5000 > 65504
    state = _fit(model, tmp_path, x=x)
    assert len(state["captures"]) == 2
    manifest = files.select_capture(str(tmp_path), "train", None).manifest
    assert manifest["jit_compile"] is True
    assert manifest["layer_policies"]["block/blowup"] == "mixed_float16"
    # Net's class lives here: a model rebuilt elsewhere cannot be, so say how.
    with pytest.raises(engine.ReplayError, match="replay in-process"):
        replay(str(tmp_path), save=False)
    before = [w.numpy().copy() for w in model.weights]
    result = replay(model, logdir=str(tmp_path))
    assert result["replayed_eagerly"] is True
    assert result["first_op"]["layer"] == "block/blowup"
    assert result["first_op"]["op"] in ("MatMul", "BiasAdd", "AddV2")
    assert "block/blowup" in result["float32_layers"] and result["verified"] is True
    assert "net/block/blowup" in result["policy_map"]
    # The user's model is left as found: weights and policies.
    for expected, got in zip(before, model.weights, strict=True):
        np.testing.assert_array_equal(expected, got.numpy())
    assert model.block.blowup.dtype_policy.name == "mixed_float16"
    assert "call" not in vars(model.block.blowup)


def test_float16_attention_overflow_is_attributed_to_the_attention_layer(tmp_path):
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    inputs = keras.Input((4, 8))
    hidden = keras.layers.Dense(8, kernel_initializer=_constant(1.0), name="proj")(inputs)
    # Query and key reach 2560: their float16 scores (1280 * 2560 * 4) overflow
    # and the softmax turns them into NaN.
    attended = keras.layers.MultiHeadAttention(
        2, 4, kernel_initializer=_constant(40.0), name="attention")(hidden, hidden)
    outputs = keras.layers.Dense(1, dtype="float32", kernel_initializer=_constant(1e-6),
                                 name="out")(keras.layers.Flatten()(attended))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=_trial_optimizer(), loss="mse")
    x = np.ones((16, 4, 8), "float32")
    _fit(model, tmp_path, x=x)
    result = replay(str(tmp_path))
    assert result["first_op"]["layer"] == "attention"
    assert result["first_op"]["op"] == "Einsum"
    assert result["first_op"]["input_abs_max"] == [2560.0, 2560.0]
    assert result["float32_clean"] is True and result["verified"] is True
    assert any(layer.startswith("attention") for layer in result["float32_layers"])


def test_a_dict_batch_with_sample_weights_round_trips(tmp_path):
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    inputs = {"a": keras.Input((4,), name="a"), "b": keras.Input((4,), name="b")}
    joined = keras.layers.Concatenate()([inputs["a"], inputs["b"]])
    # (4 * 3 + 4) * 5000 > 65504
    hidden = keras.layers.Dense(16, kernel_initializer=_constant(5000.0), name="big")(joined)
    model = keras.Model(inputs, keras.layers.Dense(1, dtype="float32", name="out")(hidden))
    # Its float32 head (glorot) gives a loss of 1e9: a larger rate to learn.
    model.compile(optimizer=_trial_optimizer(1e-3), loss="mse")
    x = {"a": np.full((16, 4), 3.0, "float32"), "b": np.ones((16, 4), "float32")}
    y = np.ones((16, 1), "float32")
    model.fit(x, y, sample_weight=np.full(16, 0.5, "float32"), batch_size=8, epochs=1,
              verbose=0, callbacks=[mpprof.MixedPrecisionProfiler(str(tmp_path),
                                                                  numerics_every=1)])
    capture = files.select_capture(str(tmp_path), "train", None)
    batch_x, batch_y, weights = capture.batch()
    np.testing.assert_array_equal(batch_x["a"], np.full((8, 4), 3.0, "float32"))
    np.testing.assert_array_equal(batch_x["b"], np.ones((8, 4), "float32"))
    np.testing.assert_array_equal(weights, np.full(8, 0.5, "float32"))
    result = replay(str(tmp_path))
    assert result["first_op"]["layer"] == "big"
    assert result["verified"] is True, result["verified_detail"]


def test_a_full_disk_during_a_capture_does_not_break_fit(tmp_path):
    """The batch (64 x 512 float32, 131 kB) is beyond what the process may
    write (the kernel answers EFBIG as it answers ENOSPC on a full disk)."""
    script = textwrap.dedent(f"""
        import resource, signal, sys, warnings
        sys.path.insert(0, {TESTS!r})
        import keras, numpy as np, mpprof
        from test_replay import _constant
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        keras.mixed_precision.set_dtype_policy("mixed_float16")
        model = keras.Sequential([
            keras.layers.Input((512,)),
            keras.layers.Dense(4, kernel_initializer=_constant(500.0), name="big"),
            keras.layers.Dense(1, dtype="float32", name="out")])
        model.compile(optimizer=keras.optimizers.SGD(1e-6), loss="mse")
        x = np.ones((256, 512), "float32")
        y = np.ones((256, 1), "float32")
        resource.setrlimit(resource.RLIMIT_FSIZE, (60_000, 60_000))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[
                mpprof.MixedPrecisionProfiler({str(tmp_path)!r}, numerics_every=1)])
        print([str(w.message) for w in caught if "mpprof" in str(w.message)])
        print("FIT COMPLETED", int(model.optimizer.iterations.numpy()))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300, cwd=TESTS)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "FIT COMPLETED" in result.stdout
    assert "mpprof: stopped writing its records" in result.stdout
    assert "File too large" in result.stdout or "No space" in result.stdout
    # The capture never got its manifest: it is not offered for replay.
    assert files.find_captures(str(tmp_path), "train") == []
    context = reader.read_run(str(tmp_path), "train").context
    assert context is not None


def test_result_json_is_what_the_issue_names(tmp_path):
    _fit(third_dense_model(), tmp_path, replay_budget=1)
    result = replay(str(tmp_path))
    text = json.dumps(result)
    decoded = json.loads(text)
    for key in ("run", "step", "first_op", "divergence", "policy_map", "verified",
                "verified_detail"):
        assert key in decoded
    assert set(decoded["first_op"]) >= {"layer", "op", "input_abs_max", "output"}
    assert set(decoded["divergence"][0]) >= {"layer", "forward_rel_error",
                                             "backward_rel_error"}


@pytest.fixture(scope="module")
def faulty_logdir(tmp_path_factory):
    """A run whose third Dense overflows, with one capture, not yet replayed."""
    root = tmp_path_factory.mktemp("faulty")
    keras.mixed_precision.set_dtype_policy("float32")
    _fit(third_dense_model(), root, replay_budget=1)
    keras.mixed_precision.set_dtype_policy("float32")
    return root


def _copy(logdir, tmp_path, run="train"):
    target = tmp_path / "logs"
    shutil.copytree(logdir / "train", target / run)
    return target


def _cli(capsys, *args) -> tuple[int, str, str]:
    code = cli.main([*map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_replay_prints_the_op_and_the_fix_then_reuses_the_saved_result(
        faulty_logdir, tmp_path, capsys):
    logdir = _copy(faulty_logdir, tmp_path)
    code, out, err = _cli(capsys, "replay", logdir)
    assert code == cli.EXIT_OK
    assert "replaying run train, step 1" in err
    assert "first op: MatMul in layer d3 (forward, float16)" in out
    assert 'd3: Dense(..., name="d3", dtype="float32")' in out
    assert "verified: on the captured step no overflow" in out
    # Saved beside the capture: printing it again needs no TensorFlow.
    script = (
        "import sys; sys.modules['tensorflow'] = None; sys.modules['keras'] = None\n"
        "from mpprof import cli\n"
        f"sys.exit(cli.main(['replay', {str(logdir)!r}, '--format', 'json']))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["first_op"]["layer"] == "d3" and result["verified"] is True
    assert result["policy_map"] == {"third_dense/d3": "float32"}


def test_cli_replay_errors_say_what_to_do(faulty_logdir, tmp_path, capsys):
    logdir = _copy(faulty_logdir, tmp_path)
    code, _, err = _cli(capsys, "replay", logdir, "--step", 7)
    assert code == cli.EXIT_USAGE and "has no capture of step 7; captured steps: 1" in err
    healthy = tmp_path / "healthy"
    _fit(third_dense_model(third_kernel=0.1), healthy)
    code, _, err = _cli(capsys, "replay", healthy)
    assert code == cli.EXIT_USAGE and "no replay capture in" in err
    assert "replay_budget" in err
    code, _, err = _cli(capsys, "replay", tmp_path / "missing")
    assert code == cli.EXIT_USAGE


def _one_line_error(code: int, out: str, err: str, *names: str) -> None:
    """An unreadable capture: exit 2, one line naming the file, no traceback."""
    assert code == cli.EXIT_USAGE, (out, err)
    lines = [line for line in err.splitlines()
             if "warning" not in line and "mpprof: replaying" not in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert all(name in lines[0] for name in names), lines[0]


def test_a_truncated_weights_file_exits_2_with_one_line_naming_it(
        faulty_logdir, tmp_path, capsys):
    logdir = _copy(faulty_logdir, tmp_path)
    weights = pathlib.Path(files.select_capture(logdir, "train", 1).path) / files.WEIGHTS
    weights.write_bytes(weights.read_bytes()[:100])
    for command in (["replay", logdir], ["bundle", logdir, "-o", tmp_path / "b.zip"],
                    ["bundle", logdir, "-o", tmp_path / "b.zip", "--include-batch"],
                    ["diagnose", logdir, "--replay"]):
        code, out, err = _cli(capsys, *command)
        _one_line_error(code, out, err, str(weights), "damaged")


def test_a_capture_with_a_garbage_manifest_is_named_not_skipped_silently(
        faulty_logdir, tmp_path, capsys):
    logdir = _copy(faulty_logdir, tmp_path)
    manifest = pathlib.Path(files.select_capture(logdir, "train", 1).path) / files.MANIFEST
    manifest.write_bytes(b"\x00garbage{")
    code, out, err = _cli(capsys, "replay", logdir, "--step", 1)
    _one_line_error(code, out, err, str(manifest), "damaged")
    code, _, err = _cli(capsys, "replay", logdir)
    assert code == cli.EXIT_USAGE
    assert f"capture of step 1 skipped: {manifest} cannot be read" in err
    code, _, err = _cli(capsys, "bundle", logdir, "-o", tmp_path / "b.zip")
    assert code == cli.EXIT_USAGE and f"{manifest} cannot be read" in err


def test_hostile_run_names_are_escaped_where_a_replay_is_printed(
        faulty_logdir, tmp_path, capsys):
    hostile = "evil\x1b]0;pwned\x07"
    logdir = _copy(faulty_logdir, tmp_path, run=f"{hostile}/train")
    code, out, _ = _cli(capsys, "replay", logdir)
    assert code == cli.EXIT_OK
    assert "\x1b" not in out and "\x07" not in out and "evil\\x1b]0;pwned\\x07" in out
    code, out, _ = _cli(capsys, "replay", logdir, "--format", "json")
    assert "\x1b" not in out and json.loads(out)["run"] == f"{hostile}/train"


def test_diagnose_shows_the_replay_under_the_overflow_finding(faulty_logdir, tmp_path, capsys):
    logdir = _copy(faulty_logdir, tmp_path)
    code, out, _ = _cli(capsys, "diagnose", logdir)
    assert "replay of run" not in out  # none yet, and diagnose alone does not run one
    code, out, err = _cli(capsys, "diagnose", logdir, "--replay")
    assert "replaying run train, step 1" in err
    lines = out.splitlines()
    mp003 = next(i for i, line in enumerate(lines) if "MP003" in line)
    below = lines[mp003:]
    replay_line = next(i for i, line in enumerate(below) if "replay of run train" in line)
    assert below[replay_line + 1].strip().startswith("first op: MatMul in layer d3")
    assert not any("MP0" in line for line in below[1:replay_line])  # under MP003 itself
    code, out, _ = _cli(capsys, "diagnose", logdir, "--format", "json")
    rows = json.loads(out)
    mp003 = next(row for row in rows if row["code"] == "MP003")
    assert mp003["replay"]["first_op"]["layer"] == "d3"
    assert all("replay" not in row for row in rows if row["code"] == "MP011")


def test_the_html_report_includes_the_replay(faulty_logdir, tmp_path):
    hostile = "<script>alert(1)</script>"
    logdir = _copy(faulty_logdir, tmp_path, run=f"{hostile}/train")
    replay(str(logdir), f"{hostile}/train")
    html = report.build_report(logdir)
    assert "Replays of captured steps (1)" in html
    assert "first op: MatMul in layer d3" in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;/train, step 1" in html
    assert "<script>alert(1)" not in html


def test_bundle_without_the_batch_holds_statistics_and_the_saved_replay(
        faulty_logdir, tmp_path, capsys):
    logdir = _copy(faulty_logdir, tmp_path)
    replay(str(logdir))
    output = tmp_path / "bug.zip"
    code, _, err = _cli(capsys, "bundle", logdir, "-o", output)
    assert code == cli.EXIT_OK and "statistics and shapes only" in err
    with zipfile.ZipFile(output) as archive:
        names = set(archive.namelist())
        statistics = json.loads(archive.read("batch_statistics.json"))
        findings = json.loads(archive.read("findings.json"))
        versions = json.loads(archive.read("versions.json"))
        readme = archive.read("README.txt").decode()
        archive.extractall(tmp_path / "unzipped")
    assert "(needs mpprof; TensorFlow to replay)" in readme
    capture = "logdir/train/replay/step_1"
    assert {f"{capture}/manifest.json", f"{capture}/model.json", f"{capture}/replay.json",
            "replay_bug.py", "README.txt"} <= names
    assert not any(n.endswith(("batch.npz", "weights.npz")) for n in names)
    assert statistics["batch"][0] == {"shape": [8, 8], "dtype": "float32", "nonfinite": 0,
                                      "min": 1.0, "max": 1.0, "mean": 1.0, "abs_max": 1.0}
    assert statistics["weights"]["third_dense/d3/kernel"]["abs_max"] == 5000.0
    assert any(f["code"] == "MP003" and f["layer"] == "d3" for f in findings)
    assert versions["tensorflow"] and versions["keras"] and "gpus" in versions
    # The script prints the saved result; without the batch it cannot replay.
    done = subprocess.run([sys.executable, "replay_bug.py"], cwd=tmp_path / "unzipped",
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "without --include-batch" in done.stdout
    assert "first op: MatMul in layer d3" in done.stdout
    code, _, err = _cli(capsys, "replay", tmp_path / "unzipped" / "logdir", "--again")
    assert code == cli.EXIT_USAGE and "holds only statistics" in err


def test_bundle_with_the_batch_replays_anew(faulty_logdir, tmp_path, capsys):
    logdir = _copy(faulty_logdir, tmp_path)
    output = tmp_path / "bug.zip"
    assert _cli(capsys, "bundle", logdir, "-o", output, "--include-batch")[0] == cli.EXIT_OK
    with zipfile.ZipFile(output) as archive:
        archive.extractall(tmp_path / "unzipped")
    done = subprocess.run([sys.executable, "replay_bug.py"], cwd=tmp_path / "unzipped",
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "first op: MatMul in layer d3" in done.stdout
    assert "verified: on the captured step no overflow" in done.stdout


def test_an_overflowing_input_cast_is_the_receiving_layers():
    """A float32 layer's output beyond 65504 overflows where the next,
    float16 layer casts its input: that layer's, not "between layers"."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    model = keras.Sequential([
        keras.layers.Input((8,)),
        keras.layers.Dense(4, kernel_initializer=_constant(10_000.0), dtype="float32",
                           name="wide"),
        keras.layers.Dense(1, name="half"),
    ], name="casts")
    model.compile(optimizer="sgd", loss="mse")
    batch = (np.ones((2, 8), "float32"), np.ones((2, 1), "float32"), None)
    result = passes.run_pass(model, batch, 1.0, None)
    assert result.offender.layer == "half" and result.offender.op == "Cast"
    assert result.offender.input_abs_max == [80_000.0]
    assert passes.run_pass(model, batch, 1.0, ["half"]).forward_clean


def test_the_dashboard_shows_the_replay_under_the_overflow_finding(faulty_logdir, tmp_path):
    from test_plugin_routes import get_json, tensorboard_client

    logdir = _copy(faulty_logdir, tmp_path)
    client = tensorboard_client(logdir)
    before = get_json(client, "findings", run="train")["findings"]
    assert all("replay" not in f for f in before)
    replay(str(logdir))
    after = get_json(tensorboard_client(logdir), "findings", run="train")["findings"]
    mp003 = next(f for f in after if f["code"] == "MP003")
    assert mp003["replay"]["headline"].startswith("replay of step 1: MatMul in d3 (forward)")
    assert any("verified: on the captured step no overflow" in line
               for line in mp003["replay"]["lines"])
    assert all("replay" not in f for f in after if f["code"] != "MP003")


@pytest.mark.browser
def test_the_dashboard_overview_draws_the_replay_in_chromium(faulty_logdir, tmp_path):
    require_chromium()
    hostile = "<img src=x onerror=alert(1)>"
    logdir = _copy(faulty_logdir, tmp_path, run=f"{hostile}/train")
    replay(str(logdir), f"{hostile}/train")
    with serve_tensorboard(logdir) as url:
        page = load_page(
            url + "data/plugin_entry.html?name=mpprof",
            wait_for="document.querySelector('main.view[data-state=ready] details.replay')",
            evaluate={
                "summary": "document.querySelector('details.replay summary').textContent",
                "lines": "document.querySelector('details.replay pre').textContent",
                "images": "document.querySelectorAll('img').length",
            },
            screenshot="dashboard_replay.png",
        )
    assert [e for e in page.errors if not e.endswith("/favicon.ico")] == []
    assert page.values["summary"].startswith("replay of step 1: MatMul in d3 (forward)")
    assert f"replay of run {hostile}/train, step 1" in page.values["lines"]
    assert "verified: on the captured step no overflow" in page.values["lines"]
    assert page.values["images"] == 0


def test_a_non_finite_loss_without_loss_scaling_is_captured_and_its_nan_weights_refused(
        tmp_path):
    """NaN data, no loss scaling: the step's update wrote NaN into the
    weights the capture holds, so the replay refuses, and says the batch
    itself is non-finite."""
    keras.mixed_precision.set_dtype_policy("float32")
    model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(2, name="dense"),
                              keras.layers.Dense(1, name="head")], name="nan_input")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    x = np.ones((16, 4), "float32")
    x[:, 0] = np.nan  # the data itself
    state = _fit(model, tmp_path, x=x, numerics_every=1)
    assert [c["step"] for c in state["captures"]] == [1]  # the first call is never sampled
    manifest = files.select_capture(str(tmp_path), "train", None).manifest
    assert manifest["reasons"] == ["non-finite loss"]
    assert manifest["weights_are_the_steps"] is False
    assert "its update was applied" in manifest["weights_note"]
    with pytest.raises(files.ReplayError, match="already non-finite") as refused:
        replay(str(tmp_path))
    message = str(refused.value)
    assert "dense/kernel" in message and "the weights after the step" in message
    assert "its batch holds 8 non-finite values: the data itself may be the cause" in message


@pytest.mark.parametrize("loss_scaling", [False, True])
def test_weights_an_unskipped_overflow_made_nan_are_refused_and_the_skipped_twin_replays(
        tmp_path, capsys, loss_scaling):
    """The same float16 overflow in d3, with and without loss scaling.
    Without, every step's update applies NaN gradients: the capture's
    weights are NaN, and a replay would blame d1, the first layer reading
    them (in float32 too), so it is refused with what to do. With, the step
    is skipped and captured with the weights it ran with: a normal replay."""
    model = third_dense_model()
    model.compile(optimizer=_trial_optimizer(), loss="mse",
                  auto_scale_loss=loss_scaling)
    _fit(model, tmp_path)
    if loss_scaling:
        result = replay(str(tmp_path), save=False)
        assert result["first_op"]["layer"] == "d3" and result["verified"] is True
        return
    with pytest.raises(files.ReplayError, match="already non-finite") as refused:
        replay(str(tmp_path), save=False)
    message = str(refused.value)
    assert "d1/kernel" in message and "train with a LossScaleOptimizer" in message
    assert "batch holds" not in message  # the data is finite
    code, _, err = _cli(capsys, "replay", tmp_path)
    assert code == cli.EXIT_USAGE and "already non-finite" in err and "Traceback" not in err


def test_with_steps_per_execution_a_call_s_last_step_is_captured(tmp_path):
    model = third_dense_model()
    model.compile(optimizer=keras.optimizers.SGD(1e-6), loss="mse", steps_per_execution=2)
    state = _fit(model, tmp_path, x=np.ones((64, 8), "float32"))
    # Calls run steps (0, 1) plain, then (2, 3) sampled, ...: the logs are the
    # last step's, and its number is read in the graph.
    assert [c["step"] for c in state["captures"]] == [3, 5]
    assert replay(str(tmp_path), step=5)["first_op"]["layer"] == "d3"


def test_a_quantized_model_is_refused_with_why(faulty_logdir):
    model = third_dense_model()
    keras.mixed_precision.set_dtype_policy("float32")
    model.quantize("float8")
    with pytest.raises(engine.ReplayError, match=r"quantized layers \(d1, d2, d3"):
        replay(model, logdir=str(faulty_logdir), save=False)


def _normalised_third_dense_model() -> keras.Model:
    """`third_dense_model` with a BatchNormalization after the overflowing
    layer: every step's NaN batch statistics reach its moving statistics."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    model = keras.Sequential([
        keras.layers.Input((8,)),
        keras.layers.Dense(16, kernel_initializer=_constant(0.1), name="d1"),
        keras.layers.Dense(16, kernel_initializer=_constant(0.1), name="d2"),
        keras.layers.Dense(16, kernel_initializer=_constant(5000.0), name="d3"),
        keras.layers.BatchNormalization(name="bn"),
        keras.layers.Dense(1, kernel_initializer=_constant(1e-6), dtype="float32",
                           name="out"),
    ], name="normalised")
    # d3's 16 equal outputs normalise to 0: the loss learns only through the
    # head's bias and bn's beta, at a rate that moves them in 30 steps.
    model.compile(optimizer=_trial_optimizer(1e-3), loss="mse")
    return model


def test_nan_moving_statistics_are_not_taken_for_an_overflow_in_float32(tmp_path):
    """Step 0 overflowed and its batch statistics made the moving ones NaN;
    the capture of step 1 holds them so (as the step found them), and the
    replay still finds and verifies the float32 fix."""
    _fit(_normalised_third_dense_model(), tmp_path)
    capture = files.select_capture(str(tmp_path), "train", None)
    moving = [a for p, a in capture.weights().items() if "moving" in p]
    assert moving and not all(np.isfinite(a).all() for a in moving)
    result = replay(str(tmp_path))
    assert result["verified"], result["verified_detail"]
    assert "d3" in result["float32_layers"]


def test_the_capture_holds_the_moving_statistics_the_step_found(tmp_path):
    """The overflow comes at step 3, after finite steps; the sampled step's
    capture holds the moving statistics from before it (finite), not the
    NaN it left."""
    x = np.ones((32, 8), "float32")
    x[24:] *= 1e4  # step 3's batch overflows float16 in d3
    model = _normalised_third_dense_model()
    model.get_layer("d3").kernel.assign(np.full((16, 16), 0.5, "float32"))
    _fit(model, tmp_path, x=x, numerics_every=1)
    capture = files.select_capture(str(tmp_path), "train", None)
    assert capture.step == 3
    moving = [a for p, a in capture.weights().items() if "moving" in p]
    assert moving and all(np.isfinite(a).all() for a in moving)
    assert not all(np.isfinite(model.get_layer("bn").moving_mean.numpy()))
    result = replay(str(tmp_path))
    # Replayed from the finite statistics, the fix's step is clean and it
    # trains; the 1e4x batch still holds d2 (float16) at 1.28e4, 5x under
    # 65504, so the fix is not verified by the headroom it must leave.
    check = result["verification"]["step"][0]
    assert check["overflow"] is None and result["trial"]["passed"] is True
    assert check["failed"] == "headroom" and check["headroom"]["layer"] == "d2"
    assert result["verified"] is False


def test_a_multi_output_model_s_loss_trackers_do_not_carry_nan_between_replays(tmp_path):
    """`compute_loss` updates a tracker per output; the float16 pass put NaN
    in them, which every later pass read as an overflow in the loss."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    inputs = keras.Input((8,))
    # Ones through Dense(0.2) reach d3 at 1.6: 1.6 * 16 * 5000 > 65504, and
    # the float16 loss is inf.
    hidden = keras.layers.Dense(16, kernel_initializer=_constant(0.2), name="d1")(inputs)
    hidden = keras.layers.Dense(16, kernel_initializer=_constant(5000.0), name="d3")(hidden)
    outputs = {name: keras.layers.Dense(1, kernel_initializer=_constant(1e-6), dtype="float32",
                                        name=name)(hidden) for name in ("a", "b")}
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=_trial_optimizer(), loss={"a": "mse", "b": "mse"})
    x = np.ones((32, 8), "float32")
    targets = {name: np.ones((32, 1), "float32") for name in ("a", "b")}
    model.fit(x, targets, batch_size=8, epochs=1, verbose=0,
              shuffle=False, callbacks=[mpprof.MixedPrecisionProfiler(str(tmp_path),
                                                                      numerics_every=2)])
    result = replay(str(tmp_path))
    assert result["verified"], result["verified_detail"]
    assert "d3" in result["float32_layers"]


class _Residual(keras.layers.Layer):
    """`x + inner(x)` with a plain `+`: `inner` alone in float32 would add a
    float32 tensor to a float16 one, which TensorFlow refuses."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(16, kernel_initializer=_constant(5000.0), name="inner")

    def call(self, inputs):
        return inputs + self.inner(inputs)


def test_a_layer_that_cannot_compute_in_float32_alone_is_fixed_by_its_parent(tmp_path):
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    model = keras.Sequential([
        keras.layers.Input((16,)),
        keras.layers.Dense(16, kernel_initializer=_constant(0.1), name="d1"),
        _Residual(name="block"),
        keras.layers.Dense(1, kernel_initializer=_constant(1e-6), dtype="float32", name="out"),
    ])
    model.compile(optimizer=_trial_optimizer(), loss="mse")
    _fit(model, tmp_path, x=np.ones((32, 16), "float32"))
    result = replay(model, logdir=str(tmp_path))
    assert result["first_op"]["layer"] == "block/inner"
    assert result["verified"], result["verified_detail"]
    assert result["float32_layers"] == ["block"]


def test_a_layer_built_with_a_dtype_policy_map_replays_to_a_verified_fix(tmp_path):
    """A layer whose dtype is a DTypePolicyMap (no entry for it: it computes
    in the map's default, float16) overflows: the replay finds and verifies
    the same fix as for a plain policy, and leaves the map as it found it
    (the passes that put the layer in float32 must take their entry out
    again, not put the map into itself)."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    policy_map = keras.dtype_policies.DTypePolicyMap(default_policy="mixed_float16")
    model = keras.Sequential([
        keras.layers.Input((8,)),
        keras.layers.Dense(16, kernel_initializer=_constant(0.1), name="d1"),
        keras.layers.Dense(16, kernel_initializer=_constant(0.1), name="d2"),
        keras.layers.Dense(16, kernel_initializer=_constant(5000.0), name="d3",
                           dtype=policy_map),
        keras.layers.Dense(1, kernel_initializer=_constant(1e-6), dtype="float32",
                           name="out"),
    ], name="mapped")
    model.compile(optimizer=_trial_optimizer(), loss="mse")
    _fit(model, tmp_path)
    capture = files.select_capture(str(tmp_path), "train", None)
    rebuilt = keras_capture.rebuild(capture)
    d3 = rebuilt.get_layer("d3")
    assert isinstance(d3.dtype_policy, keras.dtype_policies.DTypePolicyMap)
    assert d3.compute_dtype == "float16"

    result = replay(rebuilt, logdir=str(tmp_path), save=False)
    assert result["first_op"]["layer"] == "d3"
    assert result["float32_layers"] == ["d3"] and result["verified"] is True
    # As found: the map has no entry for d3, and d3 computes in float16 again.
    assert d3.compute_dtype == "float16" and d3.path not in d3.dtype_policy
    assert replay(str(tmp_path))["verified"] is True
