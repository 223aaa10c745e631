"""The JAX backend: real training on CPU with KERAS_BACKEND=jax.

Each recorded fact is checked against the truth of an unprofiled run (read
by a callback that syncs Keras' JAX state every batch), and each finding
against a healthy look-alike that must not fire.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap

import jax_runs
import keras
import numpy as np
import pytest

import mpprof
from mpprof import diagnosis
from mpprof.records import reader


def codes(run) -> set[str]:
    return {f.code for f in diagnosis.diagnose(run)}


def status(run, code: str) -> str:
    return next(c.status for c in diagnosis.evaluate(run).checks if c.code == code)


# --- The loss scale, exact to the step.


@pytest.fixture(scope="module")
def reference():
    """Per-step truth from an unprofiled fit (steps_per_execution=1)."""
    model = jax_runs.overflow_model()
    probe = jax_runs.ScaleProbe()
    x, y = jax_runs.ones(128, 1000.0)
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False, callbacks=[probe])
    iterations = np.array(probe.iterations)
    skipped = np.flatnonzero(np.diff(np.concatenate([[0], iterations])) == 0)
    return np.array(probe.scales), skipped


@pytest.mark.parametrize("compile_kwargs", [{}, {"steps_per_execution": 4}],
                         ids=["plain", "steps_per_execution=4"])
def test_overflow_and_growth_events_match_the_optimizer(tmp_path, reference, compile_kwargs):
    true_scales, true_skipped = reference
    model = jax_runs.overflow_model(**compile_kwargs)
    x, y = jax_runs.ones(128, 1000.0)
    recorded = jax_runs.fit(tmp_path, model, x, y, epochs=3, numerics_every=None).loss_scale
    steps = np.arange(len(true_scales))
    assert len(true_skipped) > 5 and recorded.steps_run == len(true_scales) == 48
    np.testing.assert_array_equal(recorded.overflow_steps, true_skipped)
    np.testing.assert_array_equal(recorded.scale_after(steps), true_scales)
    assert recorded.skipped_steps == len(true_skipped)
    np.testing.assert_array_equal(recorded.overflows[:, 2], recorded.overflows[:, 1] / 2)
    assert len(recorded.growths) > 0
    np.testing.assert_array_equal(recorded.growths[:, 2], recorded.growths[:, 1] * 2)
    assert recorded.final_scale == float(np.asarray(model.optimizer.dynamic_scale.value))
    assert recorded.initial_scale == 2.0**30
    assert recorded.steps_run - len(true_skipped) == int(
        np.asarray(model.optimizer.iterations.value))


def test_second_fit_continues_the_step_axis(tmp_path, reference):
    true_scales, true_skipped = reference
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


# --- Training is unchanged.


def _weights(model) -> list[np.ndarray]:
    return [np.asarray(w.value) for w in model.weights]


@pytest.mark.parametrize("make", ["classifier", "overflow"])
def test_weights_are_bit_identical_to_a_plain_jax_fit(tmp_path, make):
    def build():
        if make == "overflow":
            return jax_runs.overflow_model(), jax_runs.ones(64, 1000.0)
        keras.mixed_precision.set_dtype_policy("mixed_float16")
        keras.utils.set_random_seed(3)
        model = keras.Sequential([
            keras.layers.Input((32,)), keras.layers.Dense(64, activation="relu"),
            keras.layers.Dropout(0.3), keras.layers.Dense(8, dtype="float32")])
        model.compile(optimizer="adam",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model, jax_runs.classes()

    plain, (x, y) = build()
    plain.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    profiled, (x, y) = build()
    jax_runs.fit(tmp_path, profiled, x, y, epochs=2, numerics_every=1)
    for a, b in zip(_weights(plain), _weights(profiled), strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_model_is_left_as_found(tmp_path):
    model = jax_runs.classifier("mixed_float16")
    x, y = jax_runs.classes()
    jax_runs.fit(tmp_path, model, x, y)
    # Keras' own jitted step is back (the profiler's dispatcher is a method).
    assert "_run_train_function" not in model.train_function.__qualname__
    assert "_update_metrics_variables" not in vars(model)
    assert all("call" not in vars(layer) for layer in model.layers)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # plain fit works after
    model.save(tmp_path / "m.keras")


# --- Findings, each with a healthy look-alike.


def test_healthy_mixed_float16_run_has_only_the_cpu_finding(tmp_path):
    x, y = jax_runs.classes()
    run = jax_runs.fit(tmp_path, jax_runs.classifier("mixed_float16"), x, y, epochs=2)
    assert codes(run) == {"MP011"}
    assert run.context["keras_backend"] == "jax"
    for code in ("MP001", "MP002", "MP008", "MP012"):
        assert status(run, code) == "checked", code
    assert run.health["loss_watched"] and run.health["nonfinite_loss_steps"] == 0


def test_mp001_collapse_and_mp002_storm(tmp_path):
    x, y = jax_runs.ones(8 * 32, 1e8)  # overflows float16 gradients even at scale 1
    run = jax_runs.fit(tmp_path / "collapse", jax_runs.regression(), x, y, numerics_every=None)
    assert {"MP001", "MP002"} <= codes(run)
    x, y = jax_runs.ones(8 * 24, 1000.0)
    run = jax_runs.fit(tmp_path / "storm", jax_runs.regression(initial_scale=2.0**30), x, y,
                       numerics_every=None)
    assert "MP002" in codes(run) and "MP001" not in codes(run)


def test_growth_probes_are_no_finding(tmp_path):
    """Healthy look-alike of MP002: each growth overflows once, by design."""
    x, y = jax_runs.ones(8 * 40, 1000.0)
    run = jax_runs.fit(tmp_path, jax_runs.regression(initial_scale=2.0**9, growth_steps=3),
                       x, y, numerics_every=None)
    assert len(run.loss_scale.growths) >= 5 and run.loss_scale.skipped_steps >= 5
    assert not {"MP001", "MP002"} & codes(run)


def test_mp006_float16_head_and_its_float32_look_alike(tmp_path):
    x, y = jax_runs.classes()
    run = jax_runs.fit(tmp_path / "half", jax_runs.classifier("mixed_float16", last_dtype=None),
                       x, y)
    assert "MP006" in codes(run)
    run = jax_runs.fit(tmp_path / "float32", jax_runs.classifier("mixed_float16"), x, y)
    assert "MP006" not in codes(run) and status(run, "MP006") == "checked"


def test_mp008_no_loss_scaling_and_its_look_alike(tmp_path):
    x, y = jax_runs.classes()
    run = jax_runs.fit(tmp_path / "off",
                       jax_runs.classifier("mixed_float16", auto_scale_loss=False), x, y)
    assert "MP008" in codes(run)
    assert run.context["collectors"]["loss_scale"]["state"] == "absent"
    run = jax_runs.fit(tmp_path / "on", jax_runs.classifier("mixed_float16"), x, y)
    assert "MP008" not in codes(run)
    assert run.context["collectors"]["loss_scale"]["state"] == "ok"


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_mp012_nan_loss_dated_to_the_step(tmp_path, steps_per_execution):
    x, y = jax_runs.classes()
    x[5 * 8 + 3, 0] = np.nan  # in batch 5
    model = jax_runs.classifier("float32", optimizer=keras.optimizers.SGD(0.1),
                                steps_per_execution=steps_per_execution)
    run = jax_runs.fit(tmp_path, model, x, y)
    assert run.health["first_nonfinite_loss_step"] == run.health[
        "first_nonfinite_loss_step_last"] == 5
    assert run.health["nonfinite_loss_steps"] == 3  # steps 5, 6, 7: NaN weights after 5
    assert run.health["nonfinite_weights"]
    found = [f for f in diagnosis.diagnose(run) if f.code == "MP012"]
    assert found and min(f.step for f in found if f.step is not None) == 5


def test_finite_float32_run_has_no_findings(tmp_path):
    """Look-alike of MP012: the same data without the NaN."""
    x, y = jax_runs.classes()
    run = jax_runs.fit(tmp_path, jax_runs.classifier(
        "float32", optimizer=keras.optimizers.SGD(0.1)), x, y)
    assert diagnosis.diagnose(run) == []
    assert status(run, "MP012") == "checked"
    assert run.health["first_nonfinite_loss_step"] is None


# --- The inventory, from the traced step.


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


def test_mp003_first_forward_overflow_and_its_float32_island_look_alike(tmp_path):
    x, y = jax_runs.ones(8 * 4, 0.0)
    # Kernels of 300: "first" outputs 2,400, "second" 11.5M > 65504.
    model = jax_runs.regression(keras.initializers.Constant(300.0))
    run = jax_runs.fit(tmp_path / "overflow", model, x, y, numerics_every=1)
    finding = next(f for f in diagnosis.diagnose(run) if f.code == "MP003")
    # Step 0 (the first call, which traces, runs plain) overflowed: the next
    # call's forensic sample is of step 0's kept batch.
    assert finding.layer == "second" and finding.step == 0
    assert run.numerics.layers == ["first", "second", "head"]
    # Look-alike: float16 fits (8,192); the float32 head goes past 65504.
    model = jax_runs.regression(keras.initializers.Constant(8.0),
                                head=keras.initializers.Constant(100.0))
    run = jax_runs.fit(tmp_path / "island", model, x, y, numerics_every=1)
    assert "MP003" not in codes(run) and status(run, "MP003") == "checked"


def _tiny_mse(y_true, y_pred):
    return 1e-6 * keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)


def test_mp005_gradient_underflow_and_its_look_alike(tmp_path):
    x, y = jax_runs.ones(8 * 4, 1.0)
    # The loss times 1e-6 at scale 1: gradients ~1e-7, subnormal in float16.
    model = jax_runs.regression(head=keras.initializers.Constant(0.5), initial_scale=1.0,
                                loss=_tiny_mse, growth_steps=10_000)
    run = jax_runs.fit(tmp_path / "underflow", model, x, y, numerics_every=1)
    assert "MP005" in codes(run)
    # Look-alike: the same loss at the default scale 2**15 lifts them back.
    model = jax_runs.regression(head=keras.initializers.Constant(0.5), loss=_tiny_mse)
    run = jax_runs.fit(tmp_path / "scaled", model, x, y, numerics_every=1)
    assert "MP005" not in codes(run) and status(run, "MP005") == "checked"


def test_samples_come_every_n_steps_and_plain_steps_stay_plain(tmp_path):
    x, y = jax_runs.classes()
    run = jax_runs.fit(tmp_path, jax_runs.classifier("mixed_float16"), x, y, epochs=2,
                       numerics_every=4)
    np.testing.assert_array_equal(run.numerics.steps, [4, 8, 12])
    assert run.context["collectors"]["numerics"]["state"] == "ok"
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


def test_an_overflow_arms_a_forensic_sample(tmp_path):
    """The alarm is read once its step is done (the host never waits for it):
    the first overflow (step 0) arms a sample a few calls later, long before
    numerics_every=100, of the overflowed steps' kept batches (the first of
    the newest run of them: step 0 where every step so far overflowed); the
    spacing (50) allows no second one in 40 steps."""
    x, y = jax_runs.ones(8 * 40, 1000.0)
    run = jax_runs.fit(tmp_path, jax_runs.overflow_model(), x, y, numerics_every=100)
    assert run.loss_scale.overflow_steps[0] == 0
    assert len(run.numerics.steps) == 1
    assert run.numerics.steps[0] in run.loss_scale.overflow_steps
    assert run.numerics.forensic.all()
    # The sampled step overflowed too: its gradients are beyond float16.
    assert (run.numerics.variable_grads["nonfinite_frac"] > 0).any()


def test_a_lone_overflow_in_the_first_call_arms_a_forensic_sample(tmp_path):
    """Only step 0 overflows (its batch's targets are a million; the scale
    halves once and the other batches fit): the alarm is compared with the
    count the fit started from, so that first call still rings and arms a
    sample. Before, the first alarm read set the baseline and the sample
    never came."""
    x, y = jax_runs.ones(8 * 40, 1.0)
    y[:8] = 1e6
    # (At 2**12 the other batches' scaled gradients fit float16.)
    model = jax_runs.regression(learning_rate=0.0, initial_scale=2.0**12)
    run = jax_runs.fit(tmp_path, model, x, y, numerics_every=100)
    assert list(run.loss_scale.overflow_steps) == [0]
    # Of step 0's kept batch, with the state of the call that sampled it
    # (step 0's weights only if that call came right after it).
    assert run.numerics.steps.tolist() == [0] and run.numerics.forensic.all()
    (note,) = run.context["collectors"]["numerics"]["forensic_of_earlier_steps"]["samples"]
    assert note["step"] == 0 and note["state_of_step"] >= 1
    assert note["weights_of_step"] == (0 if note["state_of_step"] == 1 else note["state_of_step"])


# --- The collectors that once said "unavailable" on JAX record.


def test_replay_capture_and_float8_collectors_record(tmp_path):
    x, y = jax_runs.classes()
    run = jax_runs.fit(tmp_path, jax_runs.classifier("mixed_float16"), x, y)
    collectors = run.context["collectors"]
    # (A healthy run captures nothing; XProf windows:
    # tests/jax/test_kernels_jax.py.)
    assert collectors["replay_capture"]["state"] == "ok"
    assert collectors["replay_capture"]["captures"] == []
    # Float8 scales and amax histories, and the shares on sampled steps (what
    # they hold: tests/jax/test_float8_jax.py, test_float8_shares_jax.py).
    keras.mixed_precision.set_dtype_policy("float32")
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(8)])
    model.quantize("float8")
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    collectors = jax_runs.fit(tmp_path / "float8", model, x, y,
                              numerics_every=4).context["collectors"]
    assert collectors["float8"] == {"state": "ok"}
    assert collectors["float8_shares"] == {"state": "ok", "samples": 1}


# --- Without TensorFlow.

WITHOUT_TENSORFLOW = textwrap.dedent("""
    import json, os, sys
    os.environ["KERAS_BACKEND"] = "jax"
    for name in ("tensorflow", "tf_keras", "torch"):
        sys.modules[name] = None  # `import name` now raises ImportError
    import keras, numpy as np
    import mpprof
    from mpprof import cli, reader
    from tensorboard.plugins import base_plugin
    from tensorboard_plugin_mpprof import routes
    from werkzeug import test

    logdir, report = sys.argv[1:3]
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                              keras.layers.Dense(1, dtype="float32")])
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(1e-6), initial_scale=2.0**30), loss="mse")
    model.fit(np.ones((64, 8), "float32"), np.full((64, 1), 1000.0, "float32"),
              batch_size=8, verbose=0,
              callbacks=[mpprof.MixedPrecisionProfiler(logdir, gpu_interval=None)])
    run = reader.read_run(logdir, "train")
    codes = [cli.main(["diagnose", logdir, "--format", "json"]),
             cli.main(["report", logdir, "-o", report, "-q"])]
    apps = routes.MpprofPlugin(base_plugin.TBContext(logdir=logdir)).get_plugin_apps()
    statuses = [test.Client(apps[route]).get(route, query_string=query).status_code
                for route, query in (("/runs", {}), ("/findings", {"run": "train"}),
                                     ("/loss_scale", {"run": "train"}))]
    print(json.dumps({"context": {k: run.context.get(k) for k in (
        "keras_backend", "framework", "tensorflow_version")},
        "skipped": run.loss_scale.skipped_steps, "codes": codes, "statuses": statuses,
        "tensorflow_loaded": sys.modules.get("tensorflow") is not None}))
""")


def test_fit_write_read_diagnose_report_and_tab_without_tensorflow(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_TENSORFLOW, str(tmp_path / "logs"),
         str(tmp_path / "report.html")],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    found = json.loads(result.stdout.splitlines()[-1])
    context = found["context"]
    assert context["keras_backend"] == "jax" and context["tensorflow_version"] is None
    assert context["framework"]["name"] == "JAX" and context["framework"]["version"]
    assert context["framework"]["libraries"]["jaxlib"]
    assert found["skipped"] == 8  # every step of the descent from 2**30
    assert found["codes"] == [0, 0] and found["statuses"] == [200, 200, 200]
    assert not found["tensorflow_loaded"]
    assert (tmp_path / "report.html").stat().st_size > 1000


# --- With TensorFlow installed (Colab, most machines): a JAX fit never imports it.

TENSORFLOW_INSTALLED = textwrap.dedent("""
    import importlib.util, json, os, sys
    os.environ["KERAS_BACKEND"] = "jax"
    assert importlib.util.find_spec("tensorflow") is not None  # installed, importable
    import keras, numpy as np
    import mpprof
    from mpprof import reader

    logdir = sys.argv[1]
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    # (No keras.utils.set_random_seed: Keras' own seeds TensorFlow's generator
    # too, importing it.) Kernels of 300: the second layer's output overflows float16 on the
    # first sampled step, so a replay capture (with the model's config) is written.
    big = keras.initializers.Constant(300.0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, kernel_initializer=big),
                              keras.layers.Dense(16, kernel_initializer=big),
                              keras.layers.Dense(1, dtype="float32", kernel_initializer="ones")])
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.0)),
                  loss="mse")
    model.fit(np.ones((32, 8), "float32"), np.zeros((32, 1), "float32"), batch_size=8,
              verbose=0, callbacks=[mpprof.MixedPrecisionProfiler(
                  logdir, gpu_interval=None, numerics_every=1)])
    run = reader.read_run(logdir, "train")
    print(json.dumps({
        "captures": [c["step"] for c in run.context["collectors"]["replay_capture"]["captures"]],
        "model_config": run.context["collectors"]["replay_capture"].get("state"),
        "tensorflow_loaded": sorted(m for m in sys.modules
                                    if m == "tensorflow" or m.startswith("tensorflow."))[:3]}))
""")


def test_a_jax_fit_never_imports_tensorflow_when_it_is_installed(tmp_path):
    result = subprocess.run([sys.executable, "-c", TENSORFLOW_INSTALLED, str(tmp_path / "logs")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    found = json.loads(result.stdout.splitlines()[-1])
    assert found["captures"], found  # the capture, and the config it holds, were written
    assert found["tensorflow_loaded"] == []
    manifest = json.loads(next((tmp_path / "logs" / "train" / "replay").glob(
        "step_*/manifest.json")).read_text())
    assert manifest["model_config"]["saved"] is True


# --- keras.distribution.DataParallel over two CPU devices.

DATA_PARALLEL = textwrap.dedent("""
    import json, os, sys
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax, keras
    sys.path.insert(0, sys.argv[2])
    import jax_runs
    from mpprof.records import reader

    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    x, y = jax_runs.ones(128, 1000.0)
    truth, profiled, run = jax_runs.fit_beside_a_twin(
        sys.argv[1], jax_runs.overflow_model, x, y, numerics_every=4)
    print(json.dumps({"devices": len(jax.devices()), "truth": truth["overflows"],
                      "recorded": run.loss_scale.overflow_steps.tolist(),
                      "scales": [truth["scale"], run.loss_scale.final_scale],
                      "samples": run.numerics.steps.tolist(),
                      "same_weights": jax_runs.same_weights(truth["weights"], profiled),
                      "replicas": run.context["num_replicas"],
                      "distribution": run.context["distribution"]}))
""")


def test_data_parallel_over_two_cpu_devices(tmp_path):
    found = jax_runs.run_script(DATA_PARALLEL, tmp_path)
    assert found["devices"] == 2 and found["replicas"] == 2
    assert len(found["truth"]) > 5 and found["recorded"] == found["truth"]
    assert found["scales"][0] == found["scales"][1]
    assert found["same_weights"] and 4 in found["samples"]
    # Named, with its mesh; it shards no variable (the look-alike of ModelParallel's).
    distribution = found["distribution"]
    assert (distribution["name"], distribution["mesh"]["shape"]) == ("DataParallel", [2])
    assert distribution["sharded_variables"] == {}


def test_gpu_check_script_runs_on_cpu_with_tiny_sizes(tmp_path):
    """CI's smoke test of benchmarks/gpu_check_jax.py (the device check)."""
    script = pathlib.Path(__file__).parents[2] / "benchmarks" / "gpu_check_jax.py"
    out = tmp_path / "figures.json"
    result = subprocess.run(
        [sys.executable, str(script), "--tiny", "--out", str(out), "--log-dir",
         str(tmp_path / "logs")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    figures = json.loads(out.read_text())
    ran = [run for run in figures["runs"] if "skipped" not in run]
    assert {(r["model"], r["policy"]) for r in ran} >= {
        ("seed", "mixed_float16"), ("seed", "mixed_bfloat16"), ("transformer", "mixed_bfloat16")}
    assert all(r["steps_run"] == figures["sizes"]["steps"] and r["numerics_samples"] >= 1
               for r in ran)
    # The XProf window of steps 1-2 on CPU: no GPU kernels, so no share (not 0%).
    assert all(r["xprof"]["window"]["reason"] == "traced steps 1-2"
               and r["xprof"]["no_gpu_kernels"] is True and r["xprof"]["tensor_core_share"] is None
               for r in ran)
    assert figures["diagnosis"]["exit"] == 0
    assert {f["code"] for f in figures["diagnosis"]["findings"]} >= {"MP011"}
    assert figures["paired_overhead"]["mpprof defaults"]["us_per_step"] > 0


def test_an_instrumented_step_that_fails_leaves_training_and_the_records(tmp_path, monkeypatch):
    from mpprof.backends.jax import numerics_taps

    def broken(self, state, data):
        raise RuntimeError("cannot instrument")

    monkeypatch.setattr(numerics_taps.NumericsTaps, "instrumented_train_step", broken)
    plain = jax_runs.overflow_model()
    x, y = jax_runs.ones(64, 1000.0)
    plain.fit(x, y, batch_size=8, verbose=0, shuffle=False)
    model = jax_runs.overflow_model()
    with pytest.warns(RuntimeWarning, match="cannot instrument"):
        run = jax_runs.fit(tmp_path, model, x, y, numerics_every=2)
    assert run.loss_scale.steps_run == 8 and run.fit_ends[-1]["fit_state"] == "ended"
    numerics = run.context["collectors"]["numerics"]
    assert numerics["state"] != "ok" and "cannot instrument" in numerics["reason"]
    for a, b in zip(_weights(plain), _weights(model), strict=True):
        np.testing.assert_array_equal(a, b)
