"""Float8 training health: Keras float8 layers' scales and amax histories
recorded, read back as `Run.float8`, and judged (MP015-MP017), on real CPU
training of tiny `model.quantize("float8")` models."""

import json
import os
import subprocess
import sys

import keras
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
from float8_runs import BATCH, STEPS, fit_float8, float8_data, float8_model

import mpprof
from mpprof import diagnosis, dtypes
from mpprof.backends.tensorflow import float8_shares
from mpprof.records import schema, validation
from mpprof.records.reader import read_run

FLOAT8_CODES = ("MP015", "MP016", "MP017")
TESTS = os.path.dirname(os.path.abspath(__file__))


def _fit(tmp_path, model, x, y, numerics_every=500):
    fit_float8(tmp_path, model, x, y, numerics_every)
    return read_run(tmp_path, "train")


def _findings(run, code):
    # MP007 judges Tensor Core shapes on a GPU: these CPU runs as a projection.
    return [f for f in diagnosis.diagnose(run, assume_gpu=True) if f.code == code]


def test_a_healthy_float8_run_is_recorded_as_keras_scales_it_and_not_flagged(tmp_path):
    x, y = float8_data()
    run = _fit(tmp_path, float8_model(), x, y)
    float8 = run.float8
    assert run.context["collectors"]["float8"] == {"state": "ok"}
    assert float8.layers == ["f8/hidden", "f8/head"]
    assert float8.policies == ["float8_from_float32"] * 2
    assert float8.tensors == ["inputs", "kernel", "outputs_grad"]
    assert float8.formats == {"inputs": "float8_e4m3fn", "kernel": "float8_e4m3fn",
                              "outputs_grad": "float8_e5m2"}
    assert float8.amax_history_lengths == [1024, 1024]
    assert list(float8.steps) == [2, 4, 6]
    state = float8.state
    assert state["scale"].shape == (3, 2, 3)
    # The first layer's input amax is the batch's own largest magnitude.
    last_batch = x[-BATCH:]
    assert state["amax_last"][-1, 0, 0] == pytest.approx(np.abs(last_batch).max(), rel=1e-6)
    assert state["amax_max"][-1, 0, 0] == pytest.approx(np.abs(x).max(), rel=1e-6)
    # The replay with Keras' scale rule reproduced every scale read (else NaN),
    # and Keras' first two steps quantize with the initial scale.
    assert np.all(state["steps"] == 2)
    assert np.all(state["warmup_steps"][0] == 2) and np.all(state["warmup_steps"][1:] == 0)
    # The scale Keras holds is the history's max over the e4m3 max, up to the
    # last step's amax (which enters the history after the scale is set).
    assert state["scale"][-1, 0, 0] * 448 <= state["amax_max"][-1, 0, 0] * (1 + 1e-6)
    assert not [f for f in diagnosis.diagnose(run) if f.code in FLOAT8_CODES]
    checked = diagnosis.evaluate(run)
    assert not [n for n in checked.notes if n.code in FLOAT8_CODES]


def test_growing_activations_saturate_the_delayed_scale_mp015(tmp_path):
    x, y = float8_data(growth=4.0)
    run = _fit(tmp_path, float8_model(), x, y)
    found = _findings(run, "MP015")
    # The head's inputs come normalised: only the first layer saturates.
    assert [f.layer for f in found] == ["f8/hidden"]
    evidence = found[0].evidence["tensors"]["inputs"]
    assert evidence["saturated_steps"] == evidence["judged_steps"] == STEPS - 2
    assert evidence["worst_peak_over_format_max"] > 4
    assert 'model.quantize("float8", filters=lambda layer: layer.name != \'hidden\')' \
        in found[0].fix
    assert not _findings(run, "MP016") and not _findings(run, "MP017")


def test_a_wrong_amax_makes_the_e5m2_gradient_underflow_mp016(tmp_path):
    model = float8_model()
    # An amax far beyond the gradients' (as from a reduction over the wrong
    # group) holds the gradient scale up for the whole history.
    hidden = model.get_layer("hidden")
    hidden.outputs_grad_amax_history.assign(np.full(1024, 1e12, np.float32))
    x, y = float8_data()
    run = _fit(tmp_path, model, x, y)
    found = _findings(run, "MP016")
    assert [f.layer for f in found] == ["f8/hidden"]
    assert list(found[0].evidence["tensors"]) == ["outputs_grad"]
    assert found[0].evidence["tensors"]["outputs_grad"]["amax_history_max"] == pytest.approx(
        1e12, rel=1e-6)
    assert "amax_history_length=16" in found[0].fix
    assert not _findings(run, "MP015") and not _findings(run, "MP017")


def test_a_frozen_float8_layer_never_updates_its_scale_mp017(tmp_path):
    model = float8_model()
    model.get_layer("hidden").trainable = False
    x, y = float8_data()
    run = _fit(tmp_path, model, x, y)
    found = _findings(run, "MP017")
    assert [f.layer for f in found] == ["f8/hidden"]
    assert found[0].evidence["tensors"]["inputs"]["problem"] == "amax history of zeros"
    assert found[0].evidence["tensors"]["inputs"]["scale"] == 1.0
    assert not _findings(run, "MP015") and not _findings(run, "MP016")


def test_float8_under_mixed_float16_is_recorded(tmp_path):
    x, y = float8_data()
    run = _fit(tmp_path, float8_model("mixed_float16"), x, y, numerics_every=1)
    float8 = run.float8
    assert float8.policies == ["float8_from_mixed_float16", "float8_from_float32"]
    assert list(float8.steps) == [2, 4, 6]
    # Steps the LossScaleOptimizer skipped (its first scales overflow) leave
    # the float8 state untouched: the replay covers the others and holds.
    skipped = run.loss_scale.skipped_steps
    assert skipped > 0
    assert np.all(float8.state["steps"].sum(axis=0) == STEPS - skipped)
    assert np.all(np.isfinite(float8.state["scale"])) and np.all(float8.state["scale"] > 0)
    assert float8.state["amax_max"][-1, 0, 0] == pytest.approx(np.abs(x).max(), rel=1e-3)
    # The shares are measured in float16 (the hidden layer's compute dtype)
    # on the scaled gradient, as Keras quantizes it.
    assert np.all(np.isfinite(float8.shares["saturated"]))
    assert not [f for f in diagnosis.diagnose(run) if f.code in FLOAT8_CODES]


def test_sampled_steps_measure_shares_with_the_scale_each_step_used(tmp_path):
    x, y = float8_data()
    run = _fit(tmp_path, float8_model(), x, y, numerics_every=1)
    float8 = run.float8
    assert run.context["collectors"]["float8_shares"] == {"state": "ok", "samples": STEPS - 1}
    assert list(float8.sample_steps) == list(range(1, STEPS))
    shares = float8.shares
    assert shares["saturated"].shape == (STEPS - 1, 2, 3)
    assert np.all(np.isfinite(shares["saturated"])) and np.all(np.isfinite(shares["underflowed"]))
    # Step 1 still quantizes with the initial scale; the scale step 4 used is
    # the one Keras held after 4 steps (the flush at step 4 read it).
    assert np.all(shares["scale"][0] == 1.0)
    flush = list(float8.steps).index(4)
    np.testing.assert_allclose(shares["scale"][3], float8.state["scale"][flush], rtol=1e-6)
    # The first layer's inputs are the batch itself.
    assert shares["abs_max"][3, 0, 0] == pytest.approx(np.abs(x[4 * BATCH:5 * BATCH]).max())
    # A healthy look-alike: delayed scaling clips a few values a little, no finding.
    assert np.nanmax(shares["peak_over_max"][1:]) < diagnosis.SATURATION_FACTOR
    assert not [f for f in diagnosis.diagnose(run) if f.code in FLOAT8_CODES]


def test_sampled_shares_show_the_saturating_layer_mp015(tmp_path):
    x, y = float8_data(growth=4.0)
    run = _fit(tmp_path, float8_model(), x, y, numerics_every=1)
    shares = run.float8.shares
    saturated, peaks = shares["saturated"][1:], shares["peak_over_max"][1:]  # after warm-up
    assert np.all(saturated[:, 0, 0] > 0.5)  # hidden's inputs: most values clip, far
    assert np.all(peaks[:, 0, 0] > diagnosis.SATURATION_FACTOR)
    # The head's inputs come normalised: where a few values of its small
    # tensors clip, they clip a little (delayed scaling lags by two steps).
    assert np.all(peaks[:, 1] < diagnosis.SATURATION_FACTOR)
    found = _findings(run, "MP015")
    assert [f.layer for f in found] == ["f8/hidden"]
    evidence = found[0].evidence["tensors"]["inputs"]
    assert evidence["saturated_share_worst"] > diagnosis.SATURATION_SHARE
    assert evidence["samples_over_share"] == evidence["judged_samples"] == STEPS - 2
    assert f"{evidence['saturated_share_worst']:.1%} of its values clipped" in found[0].title


def test_sampled_shares_show_the_underflowing_gradient_mp016(tmp_path):
    model = float8_model()
    model.get_layer("hidden").outputs_grad_amax_history.assign(np.full(1024, 1e12, np.float32))
    x, y = float8_data()
    run = _fit(tmp_path, model, x, y, numerics_every=1)
    underflowed = run.float8.shares["underflowed"]
    assert np.all(underflowed[:, 0, 2] == 1.0)  # every gradient value of hidden is lost
    assert np.all(underflowed[1:, 1, :] == 0.0)
    found = _findings(run, "MP016")
    assert [f.layer for f in found] == ["f8/hidden"]
    assert found[0].evidence["tensors"]["outputs_grad"]["underflowed_share_worst"] == 1.0
    assert "100.0% of its non-zero values quantized to zero" in found[0].title
    assert not _findings(run, "MP015") and not _findings(run, "MP017")


def test_a_run_without_float8_layers_has_no_float8_view(seed_logdir):
    run = read_run(seed_logdir, "train")
    assert run.float8 is None
    assert run.context["collectors"]["float8"]["state"] == "absent"
    notes = {n.code: n.status for n in diagnosis.evaluate(run).notes}
    assert {code: notes.get(code) for code in FLOAT8_CODES} == dict.fromkeys(
        FLOAT8_CODES, "not applicable"
    )


def test_a_float8_state_with_a_negative_scale_or_count_is_refused():
    rows = np.zeros((2, 3, len(schema.FLOAT8_STATE_COLUMNS)))
    assert validation.problem(schema.FLOAT8_STATE, rows) is None
    rows[..., schema.FLOAT8_STATE_COLUMNS.index("steps")] = np.nan  # replay failed: allowed
    assert validation.problem(schema.FLOAT8_STATE, rows) is None
    rows[0, 0, 0] = -1.0
    assert "scale" in validation.problem(schema.FLOAT8_STATE, rows)
    rows[0, 0, 0] = 1.0
    rows[1, 2, schema.FLOAT8_STATE_COLUMNS.index("saturated_steps")] = -2.0
    assert "count" in validation.problem(schema.FLOAT8_STATE, rows)


def test_float8_format_ranges_are_ml_dtypes():
    for name, found in dtypes.FLOAT8_RANGES.items():
        info = ml_dtypes.finfo(name)
        assert (found.max, found.smallest_normal, found.smallest_subnormal) == (
            float(info.max), float(info.smallest_normal), float(info.smallest_subnormal))
    assert set(schema.FLOAT8_FORMATS.values()) <= set(dtypes.FLOAT8_RANGES)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_quantization_counts_agree_with_keras_own_quantizer(dtype, fmt):
    """What `keras.quantizers.quantize_and_dequantize` clips and zeroes is
    what the in-graph counts say, ties at half the smallest subnormal and
    values at the max included."""
    scale = 0.375
    limits = dtypes.FLOAT8_RANGES[fmt]
    rng = np.random.default_rng(1)
    magnitudes = 2.0 ** rng.uniform(-30, 15, 4000)  # finite in float16 too
    edges = np.array([limits.smallest_subnormal / 2, limits.smallest_subnormal * 0.51,
                      limits.max, limits.max * 1.01, 0.0]) * scale
    values = np.concatenate([magnitudes * rng.choice([-1, 1], 4000), edges]).astype(dtype)
    quantized = keras.quantizers.quantize_and_dequantize(
        tf.constant(values), tf.constant(scale), fmt, dtype).numpy()
    counts = float8_shares.quantization_counts(tf.constant(values), tf.constant(scale),
                                               fmt).numpy()
    column = schema.FLOAT8_SHARE_COLUMN
    clipped = np.isclose(np.abs(quantized), limits.max * scale, rtol=1e-3) & (
        np.abs(values) > np.abs(quantized))
    assert counts[column.count] == len(values)
    assert counts[column.nonzero] == np.count_nonzero(values)
    assert counts[column.saturated] == clipped.sum() > 0
    assert counts[column.underflowed] == ((values != 0) & (quantized == 0)).sum() > 0
    assert counts[column.scale] == scale
    assert counts[column.abs_max] == pytest.approx(np.abs(values).max(), rel=1e-6)


def test_float8_shares_that_count_more_than_there_is_are_refused():
    rows = np.zeros((2, 3, len(schema.FLOAT8_SHARE_COLUMNS)))
    column = schema.FLOAT8_SHARE_COLUMN
    rows[..., column.count], rows[..., column.nonzero], rows[..., column.scale] = 10, 8, 1.0
    assert validation.problem(schema.FLOAT8_SHARES, rows) is None
    rows[1, 1, column.underflowed] = 9
    assert "more" in validation.problem(schema.FLOAT8_SHARES, rows)
    rows[1, 1, column.underflowed] = 0
    rows[0, 2, column.scale] = -1.0
    assert "scale" in validation.problem(schema.FLOAT8_SHARES, rows)


@pytest.mark.parametrize("where", ["quantization_counts", "gradient_tap"])
def test_a_failing_float8_tap_never_reaches_the_users_step(tmp_path, monkeypatch, where):
    def broken(*args, **kwargs):
        raise RuntimeError(f"injected into {where}")

    if where == "quantization_counts":
        monkeypatch.setattr(float8_shares, "quantization_counts", broken)
    else:
        monkeypatch.setattr(float8_shares.Float8Shares, "_gradient_tap", broken)
    x, y = float8_data()
    baseline, profiled = float8_model(), float8_model()
    profiled.set_weights(baseline.get_weights())
    baseline.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    baseline.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    with pytest.warns(RuntimeWarning, match="stopped recording float8_shares"):
        run = _fit(tmp_path, profiled, x, y, numerics_every=1)
    for expected, got in zip(baseline.get_weights(), profiled.get_weights(), strict=True):
        np.testing.assert_array_equal(expected, got)
    state = run.context["collectors"]["float8_shares"]
    assert state["state"] == "failed" and f"injected into {where}" in state["reason"]
    # The layers are left as found: no wrapper on their call or activation.
    for layer in (profiled.get_layer("hidden"), profiled.get_layer("head")):
        assert "quantized_call" not in vars(layer)
        assert layer.activation in (keras.activations.relu, keras.activations.linear)


def test_replicas_keep_their_own_amax_and_mp017_says_when_they_differ(tmp_path):
    """MirroredStrategy on two logical CPUs: Keras reduces no amax across
    replicas; each replica's shard sets its own scale."""
    result = subprocess.run(
        [sys.executable, os.path.join(TESTS, "float8_mirrored_fit.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=False, cwd=TESTS,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    apart, alike = found["apart"], found["alike"]
    for run in (apart, alike):
        assert run["context"] == {"state": "ok", "replicas": 2,
                                  "amax_across_replicas": "per replica"}
        # What mpprof recorded is what each replica's own history holds.
        assert sorted(run["replica_amax_max"]) == pytest.approx(
            sorted(run["keras_replica_amax_max"]), rel=1e-6)
        # The sampled shares are measured on both replicas.
        assert run["shares"] == {"state": "ok", "samples": 2}
        # The layer hooks see the float8 layers on both replicas (their
        # all-reduces inside the float8 call never desynchronise the replicas'
        # traces), the global batch of 8 rows per sample, 16 and 1 units.
        assert run["numerics"] == "ok" and run["precision"] == {"state": "ok", "traced": True}
        assert run["numerics_counts"] == {"hidden": [8 * 16] * 2, "head": [8] * 2}
    # The first replica's inputs are 10x the second's: so are its amax and scale.
    least, most = apart["replica_amax_max"]
    assert most / least > diagnosis.REPLICA_AMAX_TOLERANCE
    assert [f["layer"] for f in apart["mp017"]] == ["f8/hidden"]
    inputs = apart["mp017"][0]["evidence"]["tensors"]["inputs"]
    assert inputs["replica_amax_ratio"] == pytest.approx(most / least)
    assert "replicas' amax differ" in inputs["problem"]
    # A healthy look-alike: the same shard on both replicas, the same amax.
    assert alike["replica_amax_max"][0] == alike["replica_amax_max"][1]
    assert alike["mp017"] == []


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_float8_layers_are_seen_by_the_inventory_and_the_numerics(tmp_path, policy):
    """Keras calls a quantized layer through `quantized_call`, not `call`: the
    layer hooks must wrap that, or the float8 layers are never seen (no
    inventory, "the train step never traced", rows of zeros)."""
    x, y = float8_data()
    baseline, profiled = float8_model(policy), float8_model(policy)
    profiled.set_weights(baseline.get_weights())
    keras.mixed_precision.set_dtype_policy("float32")
    baseline.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    baseline.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    run = _fit(tmp_path, profiled, x, y, numerics_every=1)
    assert run.context["collectors"]["precision"] == {"state": "ok", "traced": True}
    layers = {layer["name"]: layer for layer in run.inventory["layers"]}
    hidden_dtype = "float16" if policy == "mixed_float16" else "float32"
    for name, dtype in (("hidden", hidden_dtype), ("head", "float32")):
        assert layers[name]["quantization_mode"] == "float8"
        assert layers[name]["quantized_formats"] == schema.FLOAT8_FORMATS
        assert layers[name]["output_dtypes"] == [dtype]
        assert layers[name]["call_index"] is not None
    assert layers["norm"]["quantization_mode"] is None
    assert layers["norm"]["quantized_formats"] is None
    assert [layers[n]["call_index"] for n in ("hidden", "norm", "head")] == [0, 1, 2]
    assert layers["norm"]["inputs_from"] == ["hidden"]
    # Both float8 layers measured on every sampled step, forward and backward.
    numerics = run.numerics
    assert run.context["collectors"]["numerics"]["state"] == "ok"
    for name in ("hidden", "head"):
        column = numerics.layers.index(name)
        assert np.all(numerics.forward["count"][:, column] > 0)
        assert np.all(numerics.forward["abs_max"][:, column] > 0)
        assert np.all(numerics.backward["count"][:, column] > 0)
    # A float8 scale's or amax history's "gradient" is its next value: not
    # measured as a gradient.
    assert not [v for v in numerics.variables if v.endswith(("_scale", "_amax_history"))]
    assert any(v.endswith("hidden/kernel") for v in numerics.variables)
    # The float8 shares still compose with the layer hooks.
    assert run.context["collectors"]["float8_shares"] == {"state": "ok", "samples": STEPS - 1}
    checked = diagnosis.evaluate(run)
    assert not [n for n in checked.notes if "never traced" in n.reason]
    assert not [n for n in checked.notes if "no precision inventory" in n.reason]
    if policy == "float32":
        # Said for what the float8 layers compute, not as plain float32.
        notes = {note.code: note.reason for note in checked.notes}
        assert "float8 layers quantize their matmul operands" in notes["MP003"]
    else:
        # The float8 layers' outputs are float16 and judged by its range:
        # healthy here, nothing found on them. Their GEMMs' odd sizes (input
        # size 8, output size 1) are the data's and the task's: no MP007, on
        # this CPU nor projected on a GPU.
        on_float8 = [f for f in checked.findings if f.layer in ("f8/hidden", "hidden", "head")]
        assert on_float8 == []
        assert "MP007" not in {f.code for f in diagnosis.diagnose(run, assume_gpu=True)}
    # Training is what it is without the profiler, and the layers are left as found.
    for expected, got in zip(baseline.get_weights(), profiled.get_weights(), strict=True):
        np.testing.assert_array_equal(expected, got)
    for layer in [profiled, *profiled._flatten_layers(include_self=False)]:
        assert not {"call", "quantized_call"} & set(vars(layer)), layer.name
    for layer in (profiled.get_layer("hidden"), profiled.get_layer("head")):
        assert layer.activation in (keras.activations.relu, keras.activations.linear)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_other_quantized_layers_are_seen_too(tmp_path, mode):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Input((8,)), keras.layers.Dense(16, name="hidden"),
                              keras.layers.Dense(1, name="head")], name="q")
    model.quantize(mode, filters=lambda layer: layer.name == "hidden")
    x, y = float8_data()
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
              callbacks=[mpprof.MixedPrecisionProfiler(log_dir=str(tmp_path), numerics_every=1)])
    run = read_run(tmp_path, "train")
    layers = {layer["name"]: layer for layer in run.inventory["layers"]}
    assert layers["hidden"]["quantization_mode"] == mode
    assert layers["hidden"]["quantized_formats"] is None
    assert layers["hidden"]["output_dtypes"] == ["float32"]
    assert layers["head"]["quantization_mode"] is None
    column = run.numerics.layers.index("hidden")
    assert np.all(run.numerics.forward["count"][:, column] > 0)
    for layer in [model, *model._flatten_layers(include_self=False)]:
        assert not {"call", "quantized_call"} & set(vars(layer)), layer.name


def _dense_model(sizes: tuple[int, int, int], policy: str, float8: bool) -> keras.Model:
    """Input(sizes[0]) -> Dense(sizes[1]) -> Dense(sizes[2]) under `policy`,
    both Dense layers in float8 when `float8`."""
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_dtype_policy(policy)
    model = keras.Sequential([
        keras.layers.Input((sizes[0],)),
        keras.layers.Dense(sizes[1], activation="relu", name="hidden"),
        keras.layers.Dense(sizes[2], name="head"),
    ], name="gemm")
    if float8:
        model.quantize("float8", filters=lambda layer: isinstance(layer, keras.layers.Dense))
    return model


def _gemm_run(tmp_path, sizes, policy="float32", float8=True):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, sizes[0])).astype(np.float32)
    y = rng.normal(size=(BATCH * STEPS, sizes[2])).astype(np.float32)
    return _fit(tmp_path, _dense_model(sizes, policy, float8), x, y)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_mp007_judges_float8_gemms_by_multiples_of_16(tmp_path, policy):
    """A float8 layer's GEMM needs multiples of 16 (cuBLASLt's FP8 GEMM under
    XLA), whatever it dequantizes to: 8 and 24 are not, though they suit
    float16/bfloat16 Tensor Cores."""
    run = _gemm_run(tmp_path, (8, 24, 16), policy)
    (finding,) = _findings(run, "MP007")
    assert set(finding.evidence["layers"]) == {"hidden", "head"}
    hidden = finding.evidence["layers"]["hidden"]
    assert hidden["multiple"] == dtypes.FLOAT8_GEMM_MULTIPLE == 16
    # The 8 input features are the data's, the head's 16 outputs the task's.
    assert hidden["misaligned_dims"] == [24]
    assert hidden["quantization_mode"] == "float8"
    assert "input size 8" not in finding.fix and "output size 24 -> 32" in finding.fix
    assert "units=32" in finding.fix and "FP8" in finding.fix
    assert finding.evidence["layers"]["head"]["misaligned_dims"] == [24]


def test_mp007_passes_float8_gemms_in_multiples_of_16(tmp_path):
    run = _gemm_run(tmp_path, (16, 32, 16))
    assert not _findings(run, "MP007")
    assert all(layer["tensor_core_friendly"] for layer in run.inventory["layers"]
               if layer.get("quantization_mode") == "float8")


def test_mp007_keeps_multiples_of_8_for_bfloat16_layers(tmp_path):
    """The same shapes without float8: bfloat16 GEMMs want multiples of 8 only."""
    run = _gemm_run(tmp_path, (8, 24, 16), "mixed_bfloat16", float8=False)
    assert not _findings(run, "MP007")
