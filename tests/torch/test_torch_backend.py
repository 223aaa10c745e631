"""The PyTorch backend: real training on CPU with KERAS_BACKEND=torch.

Each recorded fact is checked against the truth of an unprofiled twin (read
by a callback after every batch: on PyTorch the variables hold the state at
all times), and each finding against a healthy look-alike that must not fire.
"""

from __future__ import annotations

import jax_runs
import keras
import numpy as np
import pytest

import mpprof
from mpprof import diagnosis
from mpprof.backends import backend_for, check_backend
from mpprof.records import reader


def codes(run) -> set[str]:
    return {f.code for f in diagnosis.diagnose(run)}


def status(run, code: str) -> str:
    return next(c.status for c in diagnosis.evaluate(run).checks if c.code == code)


def weights(model) -> list[np.ndarray]:
    return [keras.ops.convert_to_numpy(w.value) for w in model.weights]


class ScaleProbe(keras.callbacks.Callback):
    """The loss scale and the apply count after every batch."""

    def __init__(self):
        super().__init__()
        self.scales, self.iterations = [], []

    def on_train_batch_end(self, batch, logs=None):
        optimizer = self.model.optimizer
        self.scales.append(float(keras.ops.convert_to_numpy(optimizer.dynamic_scale.value)))
        self.iterations.append(int(keras.ops.convert_to_numpy(optimizer.iterations.value)))


def test_torch_is_a_supported_backend():
    check_backend()  # raised UnsupportedBackendError before
    model = jax_runs.classifier("float32")
    backend = backend_for(model)
    assert backend.name == "torch" and type(backend).__module__.startswith(
        "mpprof.backends.torch")


# --- The loss scale, exact to the step.


@pytest.fixture(scope="module")
def reference():
    """Per-step truth from an unprofiled fit of the overflow storm."""
    model = jax_runs.overflow_model()
    probe = ScaleProbe()
    x, y = jax_runs.ones(128, 1000.0)
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False, callbacks=[probe])
    iterations = np.array(probe.iterations)
    skipped = np.flatnonzero(np.diff(np.concatenate([[0], iterations])) == 0)
    return np.array(probe.scales), skipped, weights(model)


def test_overflow_and_growth_events_match_the_optimizer(tmp_path, reference):
    true_scales, true_skipped, true_weights = reference
    model = jax_runs.overflow_model()
    x, y = jax_runs.ones(128, 1000.0)
    recorded = jax_runs.fit(tmp_path, model, x, y, epochs=3, numerics_every=1).loss_scale
    steps = np.arange(len(true_scales))
    assert len(true_skipped) > 5 and recorded.steps_run == len(true_scales) == 48
    np.testing.assert_array_equal(recorded.overflow_steps, true_skipped)
    np.testing.assert_array_equal(recorded.scale_after(steps), true_scales)
    assert recorded.skipped_steps == len(true_skipped)
    assert len(recorded.growths) > 0
    np.testing.assert_array_equal(recorded.growths[:, 2], recorded.growths[:, 1] * 2)
    np.testing.assert_array_equal(recorded.overflows[:, 2], recorded.overflows[:, 1] / 2)
    assert recorded.final_scale == float(keras.ops.convert_to_numpy(
        model.optimizer.dynamic_scale.value))
    assert recorded.steps_run - len(true_skipped) == int(keras.ops.convert_to_numpy(
        model.optimizer.iterations.value))
    # Sampled on every step, training is the unprofiled twin's to the bit.
    for a, b in zip(true_weights, weights(model), strict=True):
        np.testing.assert_array_equal(a, b)


def test_second_fit_continues_the_step_axis(tmp_path, reference):
    true_scales, true_skipped, _ = reference
    model = jax_runs.overflow_model()
    x, y = jax_runs.ones(128, 1000.0)
    profiler = mpprof.MixedPrecisionProfiler(str(tmp_path), numerics_every=None,
                                             gpu_interval=None)
    for _ in range(3):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[profiler])
    run = reader.read_run(str(tmp_path), "train")
    np.testing.assert_array_equal(run.loss_scale.overflow_steps, true_skipped)
    assert run.loss_scale.steps_run == len(true_scales)
    assert run.context["fit_count"] == 3 and run.context["start_step"] == 32


# --- Training is unchanged, and the model left as found.


def test_weights_are_bit_identical_to_a_plain_torch_fit(tmp_path):
    def build():
        keras.mixed_precision.set_dtype_policy("mixed_float16")
        keras.utils.set_random_seed(3)
        model = keras.Sequential([
            keras.layers.Input((32,)), keras.layers.Dense(64, activation="relu"),
            keras.layers.Dropout(0.3), keras.layers.Dense(8, dtype="float32")])
        model.compile(optimizer="adam",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    x, y = jax_runs.classes()
    plain = build()
    plain.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    profiled = build()
    jax_runs.fit(tmp_path, profiled, x, y, epochs=2, numerics_every=1)
    for a, b in zip(weights(plain), weights(profiled), strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_model_is_left_as_found(tmp_path):
    model = jax_runs.classifier("mixed_float16")
    x, y = jax_runs.classes()
    jax_runs.fit(tmp_path, model, x, y, numerics_every=2)
    assert "_run_train_function" not in model.train_function.__qualname__
    assert all("call" not in vars(layer) for layer in model.layers)
    assert not {"apply", "_stateful_handle_finite_grads",
                "_stateful_handle_non_finite_grads", "scale_loss"} & set(vars(model.optimizer))
    assert "update_state" not in vars(model._loss_tracker)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # plain fit works after
    model.save(tmp_path / "m.keras")


# --- Findings, each with a healthy look-alike.


def test_healthy_mixed_float16_run_has_only_the_cpu_finding(tmp_path):
    x, y = jax_runs.classes()
    run = jax_runs.fit(tmp_path, jax_runs.classifier("mixed_float16"), x, y, epochs=2)
    assert codes(run) == {"MP011"}
    assert run.context["keras_backend"] == "torch"
    assert run.context.gpus_visible == 0
    for code in ("MP001", "MP002", "MP008", "MP012"):
        assert status(run, code) == "checked", code
    assert run.health["loss_watched"] and run.health["nonfinite_loss_steps"] == 0
    assert run.loss_scale.skipped_steps == 0 and run.loss_scale.steps_run == 16


def test_mp012_nan_loss_dated_to_the_step(tmp_path):
    x, y = jax_runs.classes()
    x[5 * 8 + 3, 0] = np.nan  # in batch 5
    model = jax_runs.classifier("float32", optimizer=keras.optimizers.SGD(0.1))
    run = jax_runs.fit(tmp_path, model, x, y)
    assert run.health["first_nonfinite_loss_step"] == 5
    assert run.health["nonfinite_loss_steps"] == 3  # steps 5, 6, 7: NaN weights after 5
    assert run.health["nonfinite_weights"]
    found = [f for f in diagnosis.diagnose(run) if f.code == "MP012"]
    assert found and min(f.step for f in found if f.step is not None) == 5
    # Look-alike: the same data without the NaN.
    x[5 * 8 + 3, 0] = 0.5
    run = jax_runs.fit(tmp_path / "finite", jax_runs.classifier(
        "float32", optimizer=keras.optimizers.SGD(0.1)), x, y)
    assert diagnosis.diagnose(run) == [] and status(run, "MP012") == "checked"
    assert run.health["first_nonfinite_loss_step"] is None


def test_inventory_records_output_dtypes_and_the_cast_into_the_float32_head(tmp_path):
    x, y = jax_runs.classes()
    run = jax_runs.fit(tmp_path, jax_runs.classifier("mixed_float16"), x, y)
    layers = {layer["name"]: layer for layer in run.inventory["layers"]}
    assert layers["hidden"]["output_dtypes"] == ["float16"]
    assert layers["logits"]["output_dtypes"] == ["float32"]
    assert layers["logits"]["inputs_from"] == ["hidden"]
    assert [layers["hidden"]["call_index"], layers["logits"]["call_index"]] == [0, 1]
    assert layers["logits"]["float32_island"]
    assert {"layer": "logits", "from_layer": "hidden", "from_dtype": "float16",
            "to_dtype": "float32"} in run.inventory["casts"]
    assert run.inventory["model"]["output_dtypes"] == ["float32"]
    assert run.inventory["model"]["outputs"][0]["producer"] == "logits"


# --- Per-layer numerics on sampled steps.


def test_samples_come_every_n_steps_with_forward_and_backward_rows(tmp_path):
    x, y = jax_runs.classes()
    run = jax_runs.fit(tmp_path, jax_runs.classifier("mixed_float16"), x, y, epochs=2,
                       numerics_every=4)
    np.testing.assert_array_equal(run.numerics.steps, [4, 8, 12])
    numerics = run.numerics
    assert numerics.layers == ["hidden", "logits"]
    # Batches of 8: the hidden layer outputs 8 x 64 values, the logits 8 x 8;
    # the gradient flowing into each has its output's shape.
    for table in (numerics.forward, numerics.backward):
        np.testing.assert_array_equal(table["count"], [[512, 64]] * 3)
        assert (table["abs_max"] > 0).all() and (table["nonfinite_frac"] == 0).all()
    assert np.isfinite(numerics.loss).all() and (numerics.loss_scale == 2.0**15).all()
    assert (numerics.variable_grads["abs_max"] > 0).all()
    np.testing.assert_allclose(numerics.unscaled_variable_grads["abs_max"],
                               numerics.variable_grads["abs_max"] / 2.0**15, rtol=1e-3)


def test_an_overflow_arms_a_forensic_sample_of_the_next_step(tmp_path):
    """Step 0 overflows: the host knows as the call returns (the step runs
    eagerly), so the next call is sampled, long before numerics_every=100."""
    x, y = jax_runs.ones(8 * 40, 1000.0)
    run = jax_runs.fit(tmp_path, jax_runs.overflow_model(), x, y, numerics_every=100)
    assert run.loss_scale.overflow_steps[0] == 0
    assert run.numerics.steps[0] == 1 and run.numerics.forensic[0]
    assert (run.numerics.variable_grads["nonfinite_frac"] > 0).any()
    # Look-alike: a loss-scaled run that never overflows arms none.
    x, y = jax_runs.classes()
    run = jax_runs.fit(tmp_path / "calm", jax_runs.classifier("mixed_float16"), x, y,
                       numerics_every=100)
    assert run.loss_scale.skipped_steps == 0 and run.numerics is None


def test_the_replay_capture_collector_is_on(tmp_path):
    x, y = jax_runs.classes()
    run = jax_runs.fit(tmp_path, jax_runs.classifier("mixed_float16"), x, y)
    collectors = run.context["collectors"]
    # Replay captures are taken (tests/torch/test_torch_replay.py): none here.
    assert collectors["replay_capture"] == {"state": "ok", "budget": 2, "captures": []}


def json_text(value) -> str:
    import json

    return json.dumps(value, default=str)


def test_a_failing_gradient_tap_leaves_training_and_the_records(tmp_path, monkeypatch):
    """The gradient rows are taken inside the user's `loss.backward()` and
    `optimizer.apply`: what fails there switches the numerics off (the run
    context says why), never the step; the weights stay the twin's."""
    from mpprof.backends.torch import numerics_taps

    measure = numerics_taps.raw_statistics

    def failing(tensor):
        if not tensor.requires_grad:  # a gradient, not a layer's output
            raise RuntimeError("tap failed")
        return measure(tensor)

    monkeypatch.setattr(numerics_taps, "raw_statistics", failing)
    x, y = jax_runs.classes()
    plain = jax_runs.classifier("mixed_float16")
    plain.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    profiled = jax_runs.classifier("mixed_float16")
    with pytest.warns(RuntimeWarning, match="tap failed"):
        run = jax_runs.fit(tmp_path, profiled, x, y, numerics_every=2)
    assert run.context["collectors"]["numerics"]["state"] != "ok"
    assert "tap failed" in json_text(run.context["collectors"]["numerics"])
    assert run.loss_scale.steps_run == 8 and run.health["loss_watched"]
    for a, b in zip(weights(plain), weights(profiled), strict=True):
        np.testing.assert_array_equal(a, b)
