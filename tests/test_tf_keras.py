"""tf-keras (Keras 2) models: the same records as Keras 3, checked against the
optimizer's own state.

Every fit runs in a subprocess (tests/tf_keras_fit.py) with
TF_USE_LEGACY_KERAS=1: tf-keras must be chosen before TensorFlow starts. The
last test contrasts how Keras 3 decides a skip under MirroredStrategy.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from tf_keras_env import require_tf_keras

from mpprof import diagnosis
from mpprof.backends.tensorflow import loss_scale_series as loss_scale
from mpprof.records import reader, schema

TESTS = os.path.dirname(__file__)

needs_tf_keras = pytest.mark.usefixtures("tf_keras_required")


@pytest.fixture(scope="module")
def tf_keras_required():
    require_tf_keras()


def run_fits(modes: str, logdir) -> dict:
    result = subprocess.run(
        [sys.executable, os.path.join(TESTS, "tf_keras_fit.py"), modes, str(logdir)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def single_process(tf_keras_required, tmp_path_factory):
    logdir = tmp_path_factory.mktemp("tf_keras")
    modes = "single,floor,floor_host,spe4,jit,float32,functional,nan_loss"
    return logdir, run_fits(modes, logdir)


@pytest.fixture(scope="module")
def mirrored(tf_keras_required, tmp_path_factory):
    logdir = tmp_path_factory.mktemp("tf_keras_mirrored")
    return logdir, run_fits("mirrored,mirrored_split", logdir)


def _assert_matches_the_optimizer(found: dict) -> None:
    """The records against the probe's per-step view of the optimizer."""
    assert found["steps_run"] == len(found["probe_scales"]) == found["iterations"]
    assert found["overflow_steps"] == found["probe_skipped"]
    assert found["scale_after"] == found["probe_scales"]
    assert found["recorded_final_scale"] == found["final_scale"]
    assert found["patched_after_fit"] == [] and found["warnings"] == []


@needs_tf_keras
def test_overflow_storm_matches_the_optimizer(single_process):
    found = single_process[1]["single"]
    _assert_matches_the_optimizer(found)
    overflows, growths = np.array(found["overflows"]), np.array(found["growths"])
    assert len(overflows) > 5 and len(growths) > 0
    # Above the floor every overflow halves the scale and every growth doubles it.
    np.testing.assert_array_equal(overflows[:, 2], overflows[:, 1] / 2)
    np.testing.assert_array_equal(growths[:, 2], growths[:, 1] * 2)
    settings = found["context"]["collectors"]["loss_scale"]
    assert settings["mode"] == loss_scale.MODE_GRAPH
    assert settings["initial_scale"] == 2.0**30 and settings["dynamic_growth_steps"] == 4
    assert "all-reduce" in settings["skip_decided_by"]


@needs_tf_keras
@pytest.mark.parametrize("mode", ["spe4", "jit"])
def test_counted_in_the_graph_with_several_steps_per_execution_and_xla(single_process, mode):
    """Batch hooks see every 4th step (spe4): only the in-graph counters know
    each step; the same storm as `single` must come out step for step."""
    found, truth = single_process[1][mode], single_process[1]["single"]
    assert found["overflow_steps"] == truth["probe_skipped"]
    assert found["scale_after"] == truth["probe_scales"]
    assert found["steps_run"] == found["iterations"] == truth["iterations"]
    assert found["patched_after_fit"] == [] and found["warnings"] == []
    context = found["context"]
    assert (context["steps_per_execution"], context["jit_compile"]) == (
        (4, False) if mode == "spe4" else (1, True))
    assert found["numerics_layers"] == ["dense", "dense_1"]


@needs_tf_keras
def test_float32_tf_keras_run_records_no_loss_scale(single_process):
    found = single_process[1]["float32"]
    assert "overflow_steps" not in found  # no loss-scale records at all
    loss_scale_state = found["context"]["collectors"]["loss_scale"]
    assert loss_scale_state["state"] == "absent" and "SGD" in loss_scale_state["reason"]
    assert found["context"]["model_policy"] == "float32"
    assert found["numerics_layers"] == ["dense", "dense_1"]
    assert found["patched_after_fit"] == [] and found["warnings"] == []
    logdir, _ = single_process
    numerics = reader.read_run(logdir, "float32/train").numerics
    assert (numerics.loss > 0).all() and (numerics.loss_scale == 1.0).all()


@needs_tf_keras
@pytest.mark.parametrize("mode", ["floor", "floor_host"])
def test_skips_at_the_scale_floor_are_counted(single_process, mode):
    """At tf-keras's floor of 1 the scale stays put: skips come from the
    optimizer's verdict (graph) or the counter reset (host polling)."""
    found = single_process[1][mode]
    _assert_matches_the_optimizer(found)
    assert found["overflow_steps"] == list(range(found["steps_run"]))
    at_floor = [row for row in found["overflows"] if row[1] == 1.0]
    assert len(at_floor) > 20 and all(row[2] == 1.0 for row in at_floor)
    expected_mode = loss_scale.MODE_HOST if mode.endswith("_host") else loss_scale.MODE_GRAPH
    assert found["context"]["collectors"]["loss_scale"]["mode"] == expected_mode


@needs_tf_keras
def test_floor_run_is_diagnosed_as_collapsed(single_process):
    logdir, _ = single_process
    run = reader.read_run(logdir, "floor/train")
    codes = [finding.code for finding in diagnosis.diagnose(run)]
    assert "MP001" in codes and "MP002" in codes


@needs_tf_keras
def test_inventory_of_a_tf_keras_model(single_process):
    found = single_process[1]["single"]
    inventory = found["inventory"]
    assert inventory["model"]["policy"] == "mixed_float16"
    assert inventory["model"]["output_dtypes"] == ["float32"]
    layers = {layer["name"]: layer for layer in inventory["layers"]}
    assert list(layers) == ["dense", "dense_1"]
    assert layers["dense"]["output_dtypes"] == ["float16"]
    assert layers["dense"]["gemm_dims"] == [8, 8] and layers["dense"]["is_leaf"]
    assert layers["dense_1"]["float32_island"] and layers["dense_1"]["gemm_dims"] == [8, 1]
    assert layers["dense_1"]["misaligned_dims"] == []  # float32: no Tensor Core lint
    assert {"layer": "dense_1", "from_layer": "dense", "from_dtype": "float16",
            "to_dtype": "float32"} in inventory["casts"]


@needs_tf_keras
def test_nested_functional_model_with_autograph_layer_and_legacy_optimizer(single_process):
    found = single_process[1]["functional"]
    _assert_matches_the_optimizer(found)
    assert len(found["overflow_steps"]) > 5
    assert found["context"]["optimizer"] == "LossScaleOptimizer"  # wraps OptimizerV2
    assert found["context"]["collectors"]["loss_scale"]["mode"] == loss_scale.MODE_GRAPH
    layers = {layer["name"]: layer for layer in found["inventory"]["layers"]}
    assert [name for name, layer in layers.items() if layer["is_leaf"]] == [
        "dense", "gate", "block/inner", "dense_1"]
    assert not layers["block"]["is_leaf"] and layers["block"]["parent"] is None
    assert layers["gate"]["output_dtypes"] == ["float16"]
    assert found["numerics_layers"] == ["dense", "gate", "block/inner", "dense_1"]


@needs_tf_keras
def test_nonfinite_loss_is_caught_at_its_step(single_process):
    """tf-keras's loss is watched in the graph through `optimizer.minimize`,
    once a step: not again where minimize calls `get_scaled_loss`."""
    found = single_process[1]["nan_loss"]
    steps_per_epoch = len(found["probe_scales"]) // 2
    assert found["health"]["first_nonfinite_loss_step"] == 5
    assert found["health"]["nonfinite_loss_steps"] == 2  # step 5 of both epochs
    assert {5, steps_per_epoch + 5} <= set(found["overflow_steps"])  # NaN gradients too
    assert found["patched_after_fit"] == []
    healthy = single_process[1]["single"]["health"]
    assert healthy["first_nonfinite_loss_step"] is None
    assert healthy["nonfinite_loss_steps"] == 0


@needs_tf_keras
def test_run_context_names_tf_keras(single_process):
    context = single_process[1]["single"]["context"]
    assert context["keras_flavor"] == "tf_keras"
    assert context["keras_version"].startswith("2.")
    assert context["global_policy"] == context["model_policy"] == "mixed_float16"
    assert context["optimizer"] == "LossScaleOptimizerV3"
    assert context["distributed"]["multi_worker"] is False
    assert context["distributed"]["role"] == "chief"


@needs_tf_keras
def test_numerics_of_a_tf_keras_model(single_process):
    found = single_process[1]["single"]
    assert found["numerics_layers"] == ["dense", "dense_1"]
    assert found["numerics_variables"] == [
        "dense/kernel", "dense/bias", "dense_1/kernel", "dense_1/bias"]
    # A global batch of 16 examples times 8 units, each sampled step.
    assert set(found["forward_count"]) == {16.0 * 8}
    assert found["forward_abs_max"][-1] == pytest.approx(found["expected_abs_max"], rel=1e-3)
    logdir, _ = single_process
    run = reader.read_run(logdir, "single/train")
    numerics = run.numerics
    # Gradients reach tf-keras's apply_gradients unscaled: scaled = unscaled
    # times the scale the step ran with (the scale after the step before).
    finite = numerics.unscaled_variable_grads["nonfinite_frac"][:, 0] == 0
    scale_used = run.loss_scale.scale_after(numerics.steps[finite] - 1)
    scaled = numerics.variable_grads["abs_max"][finite, 0]
    unscaled = numerics.unscaled_variable_grads["abs_max"][finite, 0]
    assert len(scaled) >= 3
    np.testing.assert_allclose(scaled, unscaled * scale_used, rtol=1e-5)


@needs_tf_keras
def test_mirrored_strategy_with_tf_keras(mirrored):
    found = mirrored[1]["mirrored"]
    _assert_matches_the_optimizer(found)
    context = found["context"]
    assert (context["distribution_strategy"], context["num_replicas"]) == ("MirroredStrategy", 2)
    # Statistics cover both replicas: the sum of counts, the max of the abs-maxima;
    # the largest input reaches only the second replica.
    assert set(found["forward_count"]) == {16.0 * 8}
    assert found["forward_abs_max"][-1] == pytest.approx(found["expected_abs_max"], rel=1e-3)
    assert found["first_replica_abs_max"] < 0.9 * found["expected_abs_max"]


@needs_tf_keras
def test_records_are_in_the_model_run_only(single_process):
    logdir, _ = single_process
    modes = ["float32", "floor", "floor_host", "functional", "jit", "nan_loss", "single",
             "spe4"]
    assert reader.list_runs(logdir) == [f"{mode}/train" for mode in modes]
    for run in reader.read_logdir(logdir).values():
        assert run.records.keys() >= {schema.RUN_CONTEXT, schema.INVENTORY, schema.HEALTH}
        assert run.context["distributed"]["worker_runs"] == []


@needs_tf_keras
def test_mirrored_skip_is_decided_on_all_reduced_gradients(mirrored):
    """Only the second replica's gradients overflow: tf-keras all-reduces
    first, so the step is skipped; mpprof records the skip."""
    found = mirrored[1]["mirrored_split"]
    _assert_matches_the_optimizer(found)
    assert found["overflow_steps"][:5] == [0, 1, 2, 3, 4] and found["weights_finite"]
    assert "after the all-reduce" in found["context"]["collectors"]["loss_scale"][
        "skip_decided_by"]


def test_keras_3_mirrored_skip_is_decided_on_the_first_replica(tmp_path):
    """Keras 3 checks the gradients before the all-reduce and takes the first
    replica's verdict: an overflow on the second replica alone is applied.
    mpprof records what the optimizer did, says why in the run context, and
    the diagnosis reports the non-finite weights."""
    result = subprocess.run(
        [sys.executable, os.path.join(TESTS, "keras3_mirrored_split_fit.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["recorded_overflow_steps"] == found["skipped_by_optimizer"]
    assert 0 not in found["skipped_by_optimizer"], (
        "Keras 3 now skips a step that overflowed on another replica only: update "
        "mpprof.backends.loss_scale_records.keras_3_skip_decided_by")
    assert "FIRST replica" in found["skip_decided_by"]
    assert found["nonfinite_weights"] and "MP012" in found["codes"]


@pytest.fixture(scope="module")
def custom_steps(tf_keras_required, tmp_path_factory):
    """The fits of tests/tf_keras_custom_step_fit.py, by name."""
    logdir = tmp_path_factory.mktemp("tf_keras_custom_steps")
    result = subprocess.run(
        [sys.executable, os.path.join(TESTS, "tf_keras_custom_step_fit.py"), str(logdir)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _assert_series_match_the_probe(found: dict) -> None:
    """Each recorded series against its optimizer's state, read after every batch."""
    assert set(found["series"]) == set(found["probe"])
    for name, series in found["series"].items():
        probe = found["probe"][name]
        assert series["steps_run"] == found["steps"] == probe["iterations"][-1], name
        assert series["overflow_steps"] == probe["skipped"], name
        assert series["scale_after"] == probe["scales"], name
        assert series["final_scale"] == probe["scales"][-1], name
    assert found["patched_after_fit"] == [] and found["warnings"] == []


@needs_tf_keras
def test_gan_records_the_optimizers_its_step_applies(custom_steps):
    """Its own LossScaleOptimizers (one of each tf-keras family, one through
    get_scaled_loss + apply_gradients, one through minimize), not the unused
    optimizer `compile()` made."""
    found = custom_steps["gan"]
    used = {o["name"]: o for o in found["optimizers"]}
    assert set(used) == {"d_opt", "g_opt"}
    assert (used["d_opt"]["class"], used["g_opt"]["class"]) == (
        "LossScaleOptimizerV3", "LossScaleOptimizer")
    assert all(o["loss_scale"] and o["apply_called"] and o["scale_loss_called"]
               for o in used.values())
    _assert_series_match_the_probe(found)
    # Both scales moved: each overflowed and grew.
    for series in found["series"].values():
        assert series["overflow_steps"] and max(series["scale_after"]) > min(
            series["scale_after"])
    # The primary series is the first the step applied, on the plain tags.
    assert found["loss_scale"]["primary"] == "d_opt" and found["primary_is_plain"]
    assert found["loss_scale"]["initial_scale"] == 2.0**20
    # The step axis counts train steps: one per batch.
    assert found["health"]["checked_step"] == found["steps"]
    assert found["numerics_steps"] and max(found["numerics_steps"]) < found["steps"]
    assert found["health"]["loss_watched"] is True
    assert found["health"]["nonfinite_loss_steps"] == 0


@needs_tf_keras
def test_an_unused_optimizer_attribute_changes_nothing(custom_steps):
    """Look-alike: tf-keras's own train step (minimize) with the compiled
    optimizer, and another LossScaleOptimizer in a model attribute."""
    found = custom_steps["spare"]
    assert [(o["name"], o["apply_called"], o["scale_loss_called"])
            for o in found["optimizers"]] == [("optimizer", True, True)]
    assert "series" not in found["loss_scale"] and found["primary_is_plain"]
    _assert_series_match_the_probe(found)
    assert found["health"]["loss_watched"] is True


@needs_tf_keras
def test_loss_handed_to_get_scaled_loss_is_watched(custom_steps):
    """A custom step that scales its own loss: the NaN loss of step 5 (each
    epoch) is caught at its step, and counted once per step."""
    found = custom_steps["scaled_nan"]
    _assert_series_match_the_probe(found)
    health = found["health"]
    assert health["loss_watched"] is True
    assert health["first_nonfinite_loss_step"] == 5
    assert health["nonfinite_loss_steps"] == 2
    assert found["checks"] == {"MP012": "checked", "MP018": "checked"}
    assert not {f["code"] for f in found["findings"]} & {"MP012", "MP018"}


@needs_tf_keras
def test_loss_the_step_never_hands_to_the_optimizer_is_not_watched(custom_steps):
    """Gradients of the raw loss: no loss passed through the optimizer, so no
    value is recorded for it (MP012 is not measured), and MP018 says the
    gradients were never scaled."""
    found = custom_steps["raw_nan"]
    [optimizer] = found["optimizers"]
    assert optimizer["apply_called"] is True and optimizer["scale_loss_called"] is False
    health = found["health"]
    assert health["loss_watched"] is False
    assert health["nonfinite_loss_steps"] is None
    assert health["first_nonfinite_loss_step"] is None
    assert found["checks"]["MP012"] == "not measured"
    [mp018] = [f for f in found["findings"] if f["code"] == "MP018"]
    assert "get_scaled_loss" in mp018["title"] and "never multiplied" in mp018["title"]
    assert "self.optimizer.get_scaled_loss(loss)" in mp018["fix"]
    assert "scale_loss(loss)\n" not in mp018["fix"].replace("get_scaled_loss(loss)", "")
