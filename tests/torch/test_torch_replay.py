"""Forensic replay on PyTorch: a sampled step that overflowed is captured,
and `mpprof replay` (the PyTorch engine: the step run eagerly, every aten op
seen by a `TorchDispatchMode`) names the first op and its layer, ranks the
layers float16 vs float32 and verifies the same DTypePolicyMap fix as on
TensorFlow and JAX (tests/test_replay.py, tests/jax/test_jax_replay.py).

The op differs by framework: on CPU Keras' PyTorch `matmul` computes a
float16 product in float32 and casts it back (PyTorch has no float16 matmul
on CPU), so the first op past float16's range is that cast (`_to_copy`), its
input the float32 product 1.28 * 16 * 5000; on a GPU it is the float16 `mm`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import keras
import numpy as np
import pytest
import torch
from test_jax_replay import FIX, _fit, third_dense_model

import mpprof
import mpprof.replay
from mpprof.backends.replay_candidates import layer_tree
from mpprof.backends.torch import replay_engine, replay_passes
from mpprof.records import reader
from mpprof.replay import bundle, files
from mpprof.replay.verification import Candidate


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("torch_replay")
    context = _fit(third_dense_model(), logdir)
    return logdir, context


def _check(result):
    """The verdict every backend gives (tests/test_backend_contract.py), with
    PyTorch's own op: the float16 `mm` on a GPU; on a CPU the cast of Keras'
    float32 product back to float16, its input that product."""
    first = result["first_op"]
    assert (first["layer"], first["phase"], first["dtype"]) == ("d3", "forward", "float16")
    if torch.cuda.is_available():
        assert first["op"] in ("mm", "addmm")
    else:
        assert first["op"] == "_to_copy"
        assert max(first["input_abs_max"]) == pytest.approx(1.28 * 16 * 5000, rel=1e-2)
    assert result["policy_map"] == FIX and result["verified"] is True
    assert result["backend"] == "torch"


def test_the_capture_says_torch_and_holds_the_step(captured):
    logdir, context = captured
    assert context["state"] == "ok" and context["captures"], context
    capture = files.select_capture(str(logdir), "train", None)
    manifest = capture.manifest
    assert manifest["backend"] == "torch" and "torch" in manifest["versions"]
    assert "non-finite loss" in manifest["reasons"]
    assert "overflow: the loss scale skipped the step" in manifest["reasons"]
    assert manifest["batch_shapes"] == [[8, 8], [8, 1]]
    assert manifest["layer_paths"]["d3"] == "third_dense/d3"
    assert manifest["loss_scale"] > 1
    kernel = next(v for k, v in capture.weights().items() if k.endswith("d3/kernel"))
    assert np.all(kernel == 5000.0)


def test_in_process_replay_names_the_op_and_verifies_the_fix(captured):
    logdir, _ = captured
    _check(mpprof.replay.replay(str(logdir), save=False))


def test_cli_diagnose_replay_without_tensorflow(captured):
    """`mpprof diagnose --replay` in a process where TensorFlow cannot be
    imported: the capture's manifest picks the PyTorch engine."""
    logdir, _ = captured
    code = ("import sys; sys.modules['tensorflow'] = None\n"
            "from mpprof import cli\n"
            f"sys.exit(cli.main(['diagnose', {str(logdir)!r}, '--replay', '--format', "
            "'json']))\n")
    env = {**os.environ, "KERAS_BACKEND": "torch"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout)
    shown = [row["replay"] for row in rows if "replay" in row]
    assert shown, rows
    capture = files.select_capture(str(logdir), "train", None)
    _check(capture.result())  # saved beside the capture


def test_the_bundle_says_pytorch_replays_it(captured, tmp_path):
    logdir, _ = captured
    bundle.write_bundle(str(logdir), tmp_path / "bug.zip")
    with zipfile.ZipFile(tmp_path / "bug.zip") as archive:
        readme = archive.read("README.txt").decode()
    assert "(needs mpprof; PyTorch to replay)" in readme and "TensorFlow" not in readme


def test_a_healthy_look_alike_is_neither_captured_nor_offending(tmp_path):
    """Kernel 1.0 instead of 5000: no step overflows, nothing is captured,
    and a pass of its step through the engine finds no offending op."""
    model = third_dense_model(third_kernel=1.0)
    context = _fit(model, tmp_path)
    assert context["state"] == "ok" and context["captures"] == []
    assert files.find_captures(str(tmp_path), "train") == []
    x, y = np.ones((8, 8), "float32"), np.ones((8, 1), "float32")
    engine = replay_engine.engine_for(model, [(x, y)], 2.0**15)
    before = [np.array(v.numpy()) for v in model.weights]
    result = engine.run_pass(Candidate(label="the run's policies"), 0, 2.0**15)
    assert result.offender is None and result.forward_clean and result.gradients_finite
    assert set(result.forward) == {(name, 0) for name in layer_tree(model)}
    assert set(result.backward) == set(result.forward)
    # The pass left the model as it was.
    assert all(np.array_equal(b, v.numpy()) for b, v in zip(before, model.weights,
                                                            strict=True))


def test_an_overflowing_input_cast_is_the_receiving_layers():
    """A float32 layer's output beyond 65504 overflows where the next,
    float16 layer casts its input: that layer's, not "between layers" (as
    on TensorFlow, tests/test_replay.py)."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    constant = keras.initializers.Constant
    model = keras.Sequential([
        keras.layers.Input((8,)),
        keras.layers.Dense(4, kernel_initializer=constant(10_000.0), dtype="float32",
                           name="wide"),
        keras.layers.Dense(1, name="half"),
    ], name="casts")
    model.compile(optimizer="sgd", loss="mse")
    batch = (np.ones((2, 8), "float32"), np.ones((2, 1), "float32"), None)
    result = replay_passes.run_pass(model, batch, 1.0, None)
    assert result.offender.layer == "half" and result.offender.op == "_to_copy"
    assert result.offender.input_abs_max == [80_000.0]
    assert replay_passes.run_pass(model, batch, 1.0, ["half"]).forward_clean


def _normalised_third_dense_model() -> keras.Model:
    """`third_dense_model` with a BatchNormalization after the overflowing
    layer: an overflowed step's NaN batch statistics reach its moving ones."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    constant = keras.initializers.Constant
    model = keras.Sequential([
        keras.layers.Input((8,)),
        keras.layers.Dense(16, kernel_initializer=constant(0.1), name="d1"),
        keras.layers.Dense(16, kernel_initializer=constant(0.1), name="d2"),
        keras.layers.Dense(16, kernel_initializer=constant(0.5), name="d3"),
        keras.layers.BatchNormalization(name="bn"),
        keras.layers.Dense(1, kernel_initializer=constant(1e-6), dtype="float32",
                           name="out"),
    ], name="normalised")
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    return model


def test_the_capture_holds_the_moving_statistics_the_step_found(tmp_path):
    """The overflow comes at step 3, after finite steps: the sampled step's
    capture holds the moving statistics from before it (cloned before the
    step ran: finite), not the NaN it left, and the replay puts d3 in
    float32."""
    x = np.ones((32, 8), "float32")
    x[24:] *= 1e4  # step 3's batch overflows float16 in d3
    model = _normalised_third_dense_model()
    model.fit(x, np.ones((32, 1), "float32"), batch_size=8, epochs=1, verbose=0,
              shuffle=False, callbacks=[mpprof.MixedPrecisionProfiler(
                  str(tmp_path), gpu_interval=None, numerics_every=1)])
    context = reader.read_run(str(tmp_path), "train").context["collectors"]["replay_capture"]
    assert [c["step"] for c in context["captures"]] == [3], context
    capture = files.select_capture(str(tmp_path), "train", None)
    moving = [a for p, a in capture.weights().items() if "moving" in p]
    assert moving and all(np.isfinite(a).all() for a in moving)
    assert not np.isfinite(model.get_layer("bn").moving_mean.numpy()).all()
    result = mpprof.replay.replay(str(tmp_path), save=False)
    assert result["first_op"]["layer"] == "d3"
    assert "d3" in result["float32_layers"]
    # Replayed from the finite statistics, the fix's step is clean and it
    # trains; the 1e4x batch still holds d2 (float16) at 1.28e4, 5x under
    # 65504, so the fix is not verified by the headroom it must leave (as on
    # TensorFlow, tests/test_replay.py).
    check = result["verification"]["step"][0]
    assert check["overflow"] is None and result["trial"]["passed"] is True
    assert check["failed"] == "headroom" and check["headroom"]["layer"] == "d2"
    assert result["verified"] is False


def test_a_backward_overflow_is_seen_by_the_dispatch_mode():
    """A forward pass in range (outputs of 128) whose loss-scaled gradient
    (mse over 4 samples: 2 * 128 / 4 * 2**15 = 2.1e6) passes float16's max where it is cast back to
    float16 on its way into the float16 layer: the autograd engine's ops go
    through the dispatch mode too, and the offender is a backward one; at
    loss scale 1 the same pass is clean."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    constant = keras.initializers.Constant
    model = keras.Sequential([
        keras.layers.Input((8,)),
        keras.layers.Dense(16, kernel_initializer=constant(1.0), name="a"),
        keras.layers.Dense(1, kernel_initializer=constant(1.0), dtype="float32", name="out"),
    ], name="backward")
    model.compile(optimizer="sgd", loss="mse")
    batch = (np.ones((4, 8), "float32"), np.zeros((4, 1), "float32"), None)
    result = replay_passes.run_pass(model, batch, 2.0**15, None)
    assert result.forward_clean and not result.gradients_finite
    offender = result.offender
    assert offender.phase == "backward" and offender.dtype == "float16"
    assert offender.layer == "out" and "inf" in offender.output
    assert offender.input_abs_max == [2 * 128 / 4 * 2.0**15]
    assert set(result.backward) == {("a", 0), ("out", 0)}
    calm = replay_passes.run_pass(model, batch, 1.0, None)
    assert calm.offender is None and calm.gradients_finite


def test_an_unseeded_dropout_replays_to_the_same_verdict_twice(tmp_path):
    """Keras' PyTorch dropout without a seed draws from torch's global
    generator into `empty_like` memory: the uninitialised memory is never
    taken for an overflow (it held NaN garbage), every pass draws the same
    masks (the generator seeded for the replay, the user's put back), and
    two replays of one capture agree to the digit."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    constant = keras.initializers.Constant
    model = keras.Sequential([
        keras.layers.Input((8,)),
        keras.layers.Dense(16, kernel_initializer=constant(0.1), name="d1"),
        keras.layers.Dropout(0.2, name="drop"),
        keras.layers.Dense(16, kernel_initializer=constant(0.1), name="d2"),
        keras.layers.Dense(16, kernel_initializer=constant(5000.0), name="d3"),
        keras.layers.Dense(1, kernel_initializer=constant(1e-6), dtype="float32",
                           name="out"),
    ], name="dropped")
    model.compile(optimizer=keras.optimizers.Adam(1e-9), loss="mse")
    assert _fit(model, tmp_path)["captures"]
    user_state = torch.random.get_rng_state()
    first = mpprof.replay.replay(str(tmp_path), save=False)
    second = mpprof.replay.replay(str(tmp_path), save=False)
    assert torch.equal(torch.random.get_rng_state(), user_state)
    assert first["first_op"]["layer"] == "d3"
    assert first["policy_map"] == {"dropped/d3": "float32"}
    assert first["verified"] is True, first["verified_detail"]
    assert (first["loss"], first["verified_detail"]) == (second["loss"],
                                                         second["verified_detail"])


def test_advise_verify_runs_on_the_torch_engine(tmp_path, capsys):
    """`advise_batches=2` keeps two of the fit's own sampled batches on
    PyTorch (spread across it), and `mpprof advise --verify` replays the plan
    on them with the PyTorch engine; a run without kept batches (the
    look-alike) is labelled unverified."""
    from mpprof import cli

    keras.mixed_precision.set_dtype_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x, y = rng.random((128, 16), dtype=np.float32), rng.integers(0, 4, 128)
    for name, kept in (("kept", 2), ("none", 0)):
        model = keras.Sequential([
            keras.layers.Input((16,)), keras.layers.Dense(32, activation="relu", name="h"),
            keras.layers.Dense(4, dtype="float32", name="o")])
        model.compile(optimizer="adam",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[
            mpprof.MixedPrecisionProfiler(str(tmp_path / name), numerics_every=2,
                                          gpu_interval=None, advise_batches=kept)])
    context = reader.read_run(str(tmp_path / "kept"), "train").context
    advise = context["collectors"]["replay_capture"]["advise_batches"]
    assert [entry["step"] for entry in advise["kept"]] == [4, 12]
    assert cli.main(["advise", str(tmp_path / "kept"), "--verify"]) == 0
    shown = capsys.readouterr().out
    assert "verification: verified: on 2 captured batches" in shown
    assert cli.main(["advise", str(tmp_path / "none"), "--verify"]) == 0
    shown = capsys.readouterr().out
    assert "verification: verified" not in shown and "advise_batches=4" in shown


def test_raw_16_bit_inputs_lead_to_bounding_them_in_pytorch_s_code(tmp_path):
    """Whole numbers up to 65535 (16-bit data, the `/ 65535` forgotten)
    overflow float16 in the first layer's input cast: the lead fix bounds
    the inputs, spelled for Keras on PyTorch (NumPy arrays given to fit, no
    `tf.data`), and the replay verifies it."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)),
                              keras.layers.Dense(16, activation="relu", name="d1"),
                              keras.layers.Dense(1, dtype="float32", name="d2")])
    model.compile(optimizer="adam", loss="mse")
    keras.mixed_precision.set_dtype_policy("float32")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 65536, (32, 16)).astype("float32")
    x[::4, 0] = 65535.0  # saturated pixels, past float16's 65504, in every batch
    model.fit(x, rng.random((32, 1), dtype=np.float32), batch_size=8, verbose=0,
              shuffle=False, callbacks=[mpprof.MixedPrecisionProfiler(
                  str(tmp_path), gpu_interval=None, numerics_every=1)])
    result = mpprof.replay.replay(str(tmp_path), save=False)
    lead = result["fixes"][0]
    assert result["lead_fix"] == "bound_inputs" and lead["verified"] is True, lead
    rescaling, outside = lead["code"]
    assert rescaling.startswith('keras.layers.Rescaling(1 / 65535, dtype="float32")')
    assert outside.startswith('x = x.astype("float32") * (1 / 65535)')
    assert not [word for word in ("tf.", "dataset.map", "jax") if word in " ".join(lead["code"])]
