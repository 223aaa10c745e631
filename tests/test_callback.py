"""The callback's contract: arguments, logdir, leaving the model as found."""

import _thread
import json
import os
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import mnist_like, overflow_data, overflow_model, seed_model

import mpprof
from mpprof.backends.layer_call_patch import is_patched
from mpprof.diagnosis import diagnose
from mpprof.recording.profiled_fit import ProfiledFit
from mpprof.records import reader, schema

TESTS = os.path.dirname(__file__)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"log_dir": None}, "log_dir"),
        ({"log_dir": "  "}, "log_dir"),
        ({"numerics_every": 0}, "numerics_every"),
        ({"numerics_every": 2.5}, "numerics_every"),
        ({"forensic_budget": -1}, "forensic_budget"),
        ({"flush_every_steps": True}, "flush_every_steps"),
    ],
)
def test_invalid_arguments_name_the_argument(kwargs, argument):
    kwargs = {"log_dir": "logs", **kwargs}
    with pytest.raises(ValueError, match=argument):
        mpprof.MixedPrecisionProfiler(**kwargs)


def _assert_model_left_as_found(model):
    layers = [model] + [layer for layer in model._flatten_layers(include_self=False)]
    assert not any(is_patched(layer) for layer in layers)
    optimizer_patches = {"apply", "scale_loss", "_stateful_handle_finite_grads",
                         "_stateful_handle_non_finite_grads"} & set(vars(model.optimizer))
    assert not optimizer_patches
    assert "train_step" not in vars(model)
    assert not isinstance(getattr(model.train_function, "__self__", None), ProfiledFit)


def test_unwritable_log_dir_fails_at_train_begin(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    model = seed_model()
    x, y = mnist_like(32)
    profiler = mpprof.MixedPrecisionProfiler(log_dir=str(blocker / "logs"))
    with pytest.raises(OSError, match="cannot write its records to .*a_file/logs/train"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[profiler])
    _assert_model_left_as_found(model)
    model.fit(x, y, epochs=1, verbose=0)


def test_a_call_the_user_set_on_a_layer_is_put_back(tmp_path):
    """mpprof wraps the user's own instance-level `call` while fit runs, and
    that very function is the layer's `call` again afterwards."""
    model = seed_model()
    layer = model.get_layer("dense")
    class_call = layer.call
    calls = []

    def counting_call(*args, **kwargs):
        calls.append(1)
        return class_call(*args, **kwargs)

    layer.call = counting_call
    x, y = mnist_like(32)
    model.fit(x, y, epochs=1, verbose=0,
              callbacks=[mpprof.MixedPrecisionProfiler(str(tmp_path))])
    assert vars(layer)["call"] is counting_call and calls
    _assert_model_left_as_found(model)
    inventory = reader.read_run(tmp_path, "train").inventory
    assert "dense" in {entry["name"] for entry in inventory["layers"]}


class InterruptInsideStep(keras.layers.Layer):
    """Presses Ctrl+C (interrupts the main thread) while step `at` runs."""

    def __init__(self, at, **kwargs):
        super().__init__(**kwargs)
        self.at = at
        self.calls = 0

    def _maybe_interrupt(self, x):
        self.calls += 1
        if self.calls == self.at:
            _thread.interrupt_main()
        return x

    def call(self, x):
        y = tf.py_function(self._maybe_interrupt, [x], Tout=x.dtype)
        y.set_shape(x.shape)
        return y

    def compute_output_shape(self, input_shape):
        return input_shape


@pytest.fixture
def ctrl_c_raises():
    """Ctrl+C raises KeyboardInterrupt, as in a terminal: a test runner started
    in the background inherits SIGINT ignored, and `_thread.interrupt_main()`
    then does nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_interrupted_fit_keeps_records_and_restores_the_model(tmp_path, ctrl_c_raises):
    keras.utils.set_random_seed(4)
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(8, name="dense")(inputs)
    hidden = InterruptInsideStep(at=30, name="interrupt")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(1, dtype="float32", name="out")(hidden))
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(1e-6), initial_scale=2.0**30), loss="mse")
    x, y = overflow_data()
    profiler = mpprof.MixedPrecisionProfiler(str(tmp_path), numerics_every=5)
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=8, epochs=5, verbose=0, callbacks=[profiler])
    _assert_model_left_as_found(model)
    run = reader.read_run(tmp_path, "train")
    assert run.inventory is not None and run.numerics is not None
    # Everything up to the interrupted step was read when fit raised.
    assert run.loss_scale.steps_run >= 29
    assert run.loss_scale.steps_run == int(model.optimizer.iterations.numpy()) + int(
        run.loss_scale.skipped_steps
    )
    model.save(tmp_path / "model.keras")
    restored = keras.models.load_model(
        tmp_path / "model.keras", custom_objects={"InterruptInsideStep": InterruptInsideStep}
    )
    np.testing.assert_array_equal(restored.get_layer("dense").kernel.numpy(),
                                  model.get_layer("dense").kernel.numpy())


class _FailingCallback(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 3:
            raise RuntimeError("a user's callback failed")


def test_error_in_another_callback_is_cleaned_up_by_the_next_fit(tmp_path):
    model = overflow_model()
    x, y = overflow_data()
    profiler = mpprof.MixedPrecisionProfiler(str(tmp_path))
    with pytest.raises(RuntimeError, match="a user's callback failed"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                  callbacks=[profiler, _FailingCallback()])
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    _assert_model_left_as_found(model)
    assert reader.read_run(tmp_path, "train").loss_scale.steps_run >= 4


def test_beside_keras_tensorboard_and_save_after_fit(tmp_path):
    model = seed_model()
    x, y = mnist_like(64)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[
        keras.callbacks.TensorBoard(log_dir=str(tmp_path)),
        mpprof.MixedPrecisionProfiler(log_dir=str(tmp_path)),
    ])
    train_files = os.listdir(tmp_path / schema.TRAIN_RUN)
    ours = [f for f in train_files if f.endswith(schema.EVENT_FILE_SUFFIX)]
    theirs = [f for f in train_files if "tfevents" in f and f not in ours]
    assert len(ours) == 1 and theirs
    assert reader.list_runs(tmp_path) == ["train"]
    run = reader.read_run(tmp_path, "train")
    assert run.loss_scale.steps_run == 8 and not run.warnings
    _assert_model_left_as_found(model)
    model.save(tmp_path / "seed.keras")
    restored = keras.models.load_model(tmp_path / "seed.keras")
    np.testing.assert_allclose(restored.predict(x[:4], verbose=0), model.predict(x[:4], verbose=0))


def test_run_context(seed_logdir):
    context = reader.read_run(seed_logdir, "train").context
    assert context["model_policy"] == context["global_policy"] == "mixed_float16"
    assert context["optimizer"] == "LossScaleOptimizer"
    assert context["collectors"]["loss_scale"]["initial_scale"] == 2.0**15
    assert context["collectors"]["loss_scale"]["mode"] == "graph_counters"
    assert context["framework"] == {"name": "TensorFlow", "version": tf.__version__,
                                    "libraries": {}}
    assert context["gpus_visible"] == 0
    assert context["keras_version"] == keras.__version__
    assert context["steps_per_execution"] == 1 and context["jit_compile"] in (True, False)
    assert any(device["type"] == "CPU" for device in context["devices"])


def test_mirrored_strategy_on_two_logical_cpus(tmp_path):
    result = subprocess.run(
        [sys.executable, os.path.join(TESTS, "mirrored_fit.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert (found["strategy"], found["replicas"]) == ("MirroredStrategy", 2)
    assert found["scale_after"] == found["probe_scales"]
    assert found["steps_run"] == len(found["probe_scales"])
    assert len(found["overflow_steps"]) == found["steps_run"] - found["iterations"]
    assert found["numerics_layers"] == ["dense", "dense_1"]
    # Statistics cover both replicas: 16 examples x 8 units, and the max of both.
    assert set(found["forward_count"]) == {128.0}
    assert found["forward_abs_max"][0] == pytest.approx(found["expected_abs_max"])


def test_first_nonfinite_loss_step_is_exact(tmp_path):
    model = seed_model("float32")
    x, y = mnist_like(96)
    x[3 * 16 + 5, 7] = np.nan  # in the batch of step 3
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False,
              callbacks=[mpprof.MixedPrecisionProfiler(str(tmp_path))])
    health = reader.read_run(tmp_path, "train").health
    assert health["first_nonfinite_loss_step"] == 3
    # Adam's update with a NaN gradient makes every later loss NaN too.
    assert health["nonfinite_loss_steps"] == 3
    assert health["nonfinite_weights"] and health["checked_step"] == 6


@pytest.mark.parametrize("numerics_every", [None, 100])
def test_the_first_nonfinite_loss_is_dated_to_its_step_without_an_in_graph_step(
        tmp_path, numerics_every):
    """The count alone is kept in-graph; the host dates the first non-finite
    loss from the call whose alarm rang, whether a forensic sample can be
    armed or not (numerics_every=None)."""
    model = seed_model("mixed_float16")
    x, y = mnist_like(96)
    x[2 * 16 + 1, 0] = np.inf  # in the batch of step 2
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False,
              callbacks=[mpprof.MixedPrecisionProfiler(str(tmp_path),
                                                       numerics_every=numerics_every)])
    health = reader.read_run(tmp_path, "train").health
    assert health["first_nonfinite_loss_step"] == health["first_nonfinite_loss_step_last"] == 2
    assert health["nonfinite_loss_steps"] >= 1


def _fit_four_steps_per_call_with_step_5_bad(logdir, policy: str, bad: float):
    """The seed model, 4 steps per call, with `bad` in step 5's batch (the
    second call runs steps 4 to 7); the run read back."""
    model = seed_model(policy)
    model.compile(optimizer="adam", steps_per_execution=4,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = mnist_like(128)
    x[5 * 16 + 3, 7] = bad
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False,
              callbacks=[mpprof.MixedPrecisionProfiler(str(logdir))])
    return reader.read_run(logdir, "train")


def test_under_steps_per_execution_the_first_nonfinite_loss_is_dated_to_its_call(tmp_path):
    run = _fit_four_steps_per_call_with_step_5_bad(tmp_path, "float32", np.nan)
    assert (run.health["first_nonfinite_loss_step"],
            run.health["first_nonfinite_loss_step_last"]) == (4, 7)
    titles = [f.title for f in diagnose(run) if f.code == "MP012"]
    assert "Non-finite loss between steps 4 and 7, not caught as a gradient overflow" in titles


def test_under_steps_per_execution_a_skipped_nonfinite_loss_is_caught(tmp_path):
    """The look-alike under loss scaling: the call's one non-finite loss
    overflowed and was skipped, so no MP012 (its other steps were fine)."""
    run = _fit_four_steps_per_call_with_step_5_bad(tmp_path, "mixed_float16", np.inf)
    assert (run.health["first_nonfinite_loss_step"], run.health["first_nonfinite_loss_step_last"],
            run.health["first_nonfinite_loss_count"]) == (4, 7, 1)
    assert run.loss_scale.overflow_steps.tolist() == [5]
    assert not [f for f in diagnose(run) if f.code == "MP012"]
