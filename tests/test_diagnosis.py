"""The finding catalogue on real CPU runs, and GPU-only rules on written records."""

import json
import math

import numpy as np
import pytest
from diagnosis_runs import (
    A100,
    HOSTILE_NAME,
    P100,
    STEP_LOSSES,
    gpu_samples,
    read,
    write_gpu_run,
)

from mpprof import diagnosis
from mpprof.records import reader, schema
from mpprof.records.writer import RecordWriter


def codes(run) -> set[str]:
    return {finding.code for finding in diagnosis.diagnose(run)}


def only(run, code: str) -> diagnosis.Finding:
    found = [f for f in diagnosis.diagnose(run) if f.code == code]
    assert len(found) == 1, found
    return found[0]


def check_status(run, code: str) -> str:
    return {c.code: c.status for c in diagnosis.evaluate(run).checks}[code]


# --- The API others build on.


def test_finding_to_dict_is_json_with_every_field():
    finding = diagnosis.Finding(
        "MP003",
        "critical",
        "t",
        "layer",
        3,
        {"abs_max": math.inf, "n": np.int64(2)},
        "fix",
    )
    as_dict = finding.to_dict()
    assert set(as_dict) == {
        "code",
        "severity",
        "title",
        "layer",
        "step",
        "evidence",
        "fix",
        "view",
    }
    assert as_dict["view"] == "numerics"  # MP003's evidence is in the numerics view
    # Strict JSON: no Infinity/NaN tokens, numpy scalars made plain.
    assert json.loads(json.dumps(as_dict, allow_nan=False))["evidence"] == {
        "abs_max": "inf",
        "n": 2,
    }


def test_catalogue_covers_every_rule_and_severity():
    assert list(diagnosis.CATALOGUE) == [f"MP{i:03d}" for i in range(1, 22)]
    assert {rule.severity for rule in diagnosis.CATALOGUE.values()} == set(diagnosis.SEVERITIES)


def test_findings_sorted_most_severe_first_then_by_step():
    findings = diagnosis.diagnose(read("collapse"))
    ranks = [
        (diagnosis.SEVERITIES.index(f.severity), f.step is None, f.step or 0) for f in findings
    ]
    assert ranks == sorted(ranks)
    assert [f.code for f in findings][:2] == ["MP001", "MP002"]


# --- Healthy runs: no false alarms.


def test_healthy_mixed_float16_run_has_only_the_cpu_finding():
    run = read("healthy_mixed")
    # MP011 applies: this machine has no fp16 Tensor Cores.
    assert codes(run) == {"MP011"}
    # ...and the numerics rules really looked (numerics were sampled).
    for code in ("MP003", "MP004", "MP005", "MP012"):
        assert check_status(run, code) == "checked"


def test_float32_run_has_no_findings_and_mixed_rules_do_not_apply():
    run = read("healthy_float32")
    assert diagnosis.diagnose(run) == []
    statuses = {c.code: c.status for c in diagnosis.evaluate(run).checks}
    for code in ("MP001", "MP002", "MP003", "MP005", "MP006", "MP008", "MP011"):
        assert statuses[code] == "not applicable"
    assert statuses["MP012"] == "checked"


def test_bfloat16_run_has_no_findings():
    run = read("healthy_bfloat16")
    assert diagnosis.diagnose(run) == []
    assert check_status(run, "MP005") == "not applicable"  # bf16 has fp32's range


def test_probe_overflow_after_each_growth_is_not_a_finding():
    run = read("growth_probes")
    loss_scale = run.loss_scale
    # The run really probed: many growths, each followed by an overflow.
    assert len(loss_scale.growths) >= 5
    assert loss_scale.skipped_steps >= len(loss_scale.growths)
    assert codes(run) == {"MP011"}


# --- Each rule on a real CPU run that must trigger it.


def test_mp001_loss_scale_below_one():
    run = read("collapse")
    finding = only(run, "MP001")
    assert finding.severity == "critical"
    first_below = run.loss_scale.overflows[run.loss_scale.overflows[:, 2] < 1][0]
    assert finding.step == int(first_below[0])
    assert finding.evidence["lowest_scale"] < 1
    assert "mixed_bfloat16" in finding.fix and 'dtype="float32"' in finding.fix


def test_mp002_overflow_storm_beyond_probes():
    run = read("storm")
    assert "MP001" not in codes(run)  # the scale settles above 1
    finding = only(run, "MP002")
    loss_scale = run.loss_scale
    assert finding.evidence["overflows"] == loss_scale.skipped_steps
    assert finding.evidence["excess_overflows"] >= diagnosis.MIN_EXCESS_OVERFLOWS
    assert finding.step == int(loss_scale.overflow_steps[0])
    # The fix starts the scale where the storm left it.
    settled = finding.evidence["scale_after_initial_descent"]
    assert f"initial_scale=2.0**{int(math.log2(settled))}" in finding.fix


def test_mp003_names_the_first_overflowing_layer_and_step():
    run = read("forward_overflow")
    finding = only(run, "MP003")
    # "first" outputs 2,400 (fits); "second" is the first past 65504; "head"
    # only inherits the inf.
    assert finding.layer == "second"
    assert finding.step == int(run.numerics.steps[0])
    assert finding.evidence["later_layers_also_overflowing"] == ["head"]
    assert finding.evidence["input_abs_max"] == pytest.approx(2400.0)
    assert 'keras.layers.Dense(..., dtype="float32")' in finding.fix
    assert "MP004" not in codes(run)


def test_mp004_little_headroom():
    finding = only(read("headroom"), "MP004")
    assert finding.layer == "second"
    assert finding.evidence["abs_max"] == pytest.approx(8192.0)
    assert "MP003" not in codes(read("headroom"))


def test_mp005_gradient_underflow():
    run = read("underflow")
    finding = only(run, "MP005")
    assert finding.evidence["median_underflow_frac"] >= diagnosis.UNDERFLOW_SHARE
    assert finding.layer in run.numerics.layers
    assert "initial_scale=2.0**4" in finding.fix  # scale 1 raised 16x


def test_mp006_and_mp007_on_a_float16_output_with_odd_shapes():
    run = read("half_output_misaligned")
    mp006 = only(run, "MP006")
    assert mp006.layer == "logits"  # the last layer
    assert 'dtype="float32"' in mp006.fix
    # MP007 only on a GPU: this CPU run is judged as a stated projection.
    assert "MP007" not in codes(run)
    (mp007,) = [f for f in diagnosis.diagnose(run, assume_gpu=True) if f.code == "MP007"]
    assert mp007.evidence["projection"] is True and "projection" in mp007.fix
    # One finding listing the layers: the 20 input features are the data's,
    # the logits layer is the task's head (and MP006's fix makes it float32).
    assert list(mp007.evidence["layers"]) == ["hidden"]
    assert mp007.evidence["layers"]["hidden"]["misaligned_dims"] == [100]
    assert mp007.evidence["not_judged"]["hidden"] == "input size set by the data"
    assert "output size 100 -> 104" in mp007.fix and "input size" not in mp007.fix
    assert "keras.layers.Dense(units=104, ...)" in mp007.fix


def test_mp007_on_a_gpu_run_needs_no_projection(tmp_path):
    run = write_gpu_run(tmp_path, "half_output_misaligned", [A100])
    (mp007,) = [f for f in diagnosis.diagnose(run) if f.code == "MP007"]
    assert mp007.evidence["projection"] is False and "projection" not in mp007.fix
    assert list(mp007.evidence["layers"]) == ["hidden"]
    # A healthy look-alike on the same GPU: every size the user sets aligned.
    assert "MP007" not in codes(write_gpu_run(tmp_path / "ok", "healthy_mixed", [A100]))


def test_mp008_float16_without_loss_scaling():
    finding = only(read("no_loss_scaling"), "MP008")
    assert finding.severity == "critical"
    assert finding.evidence["optimizer"] == "Adam"
    assert "LossScaleOptimizer" in finding.fix


def test_mp009_policy_set_after_building():
    run = read("policy_after_build")
    assert codes(run) == {"MP009"}
    assert only(run, "MP009").evidence["global_policy"] == "mixed_float16"


def test_mp011_mixed_float16_on_cpu():
    finding = only(read("healthy_mixed"), "MP011")
    assert finding.evidence["cpu_only"] is True
    assert "float32" in finding.fix and "mixed_bfloat16" in finding.fix


def test_mp012_nan_loss_then_nan_weights():
    run = read("nan_weights")
    found = [f for f in diagnosis.diagnose(run) if f.code == "MP012"]
    finding = next(f for f in found if "nonfinite_weights" in f.evidence)
    loss = next(f for f in found if f is not finding)
    assert loss.step == run.health["first_nonfinite_loss_step"] == 0
    assert finding.severity == loss.severity == "critical"
    assert finding.evidence["nonfinite_weights"] == run.health["nonfinite_weights"]
    assert finding.layer == run.health["nonfinite_weights"][0].split("/")[-2]
    assert "TerminateOnNaN" in finding.fix


def test_rules_without_their_data_say_not_measured():
    run = read("storm")  # numerics_every=None
    result = diagnosis.evaluate(run)
    unmeasured = {c.code: c.reason for c in result.not_measured}
    # The profiler records the optimizers' calls MP018 needs: it is judged.
    assert [o["name"] for o in run.context["optimizers"]] == ["optimizer"]
    assert set(unmeasured) == {"MP003", "MP004", "MP005", "MP019"}
    assert check_status(run, "MP018") == "checked"
    assert "numerics_every" in unmeasured["MP003"]


# --- Rules on records written through the schema writer (GPU-only data).


# MP010's advice beyond the GEMM shapes, by the backend the run trained on:
# what it must say, and what belongs to another backend.
MP010_ADVICE = {
    "tensorflow": (("compile with XLA", "jit_compile=True", "dataset.prefetch(tf.data.AUTOTUNE)"),
                   ("torch", "grain")),
    "jax": (("a tf.data or grain pipeline with prefetch",), ("jit_compile", "XLA", "torch")),
    # Keras on PyTorch is eager unless jit_compile=True, which means torch.compile.
    "torch": (("torch.compile", "jit_compile=True", "torch.utils.data.DataLoader(",
               "num_workers=", "pin_memory=True"), ("XLA", "AUTOTUNE", "tf.data.", "jax")),
}


@pytest.mark.parametrize("backend", sorted(MP010_ADVICE))
def test_mp010_low_tensor_core_activity_from_gpm(tmp_path, backend):
    run = write_gpu_run(
        tmp_path,
        "healthy_mixed",
        [A100],
        samples=gpu_samples(tensor_util=1.0, gpu_util=90.0),
        backend=backend,
    )
    finding = only(run, "MP010")
    assert finding.evidence["median_tensor_util_percent"] == pytest.approx(1.0)
    assert finding.evidence["busy_samples"] == 50
    said, foreign = MP010_ADVICE[backend]
    assert [text for text in said if text not in finding.fix] == [], finding.fix
    assert [text for text in foreign if text in finding.fix] == [], finding.fix


def test_mp010_low_tensor_core_share_from_kernel_stats(tmp_path):
    kernels = {
        "source": "xprof",
        "tensor_core_share": 0.05,
        "total_gpu_kernel_us": 1000.0,
        "tensor_core_us": 50.0,
        "eligible_not_using_us": 700.0,
        "top_ops": [],
    }
    finding = only(write_gpu_run(tmp_path, "healthy_mixed", [A100], kernels=kernels), "MP010")
    assert finding.evidence["tensor_core_share"] == pytest.approx(0.05)


# A GEMM of layer "model/dense" in each backend's op naming, as XProf's
# kernel_stats names it: XProf judges TensorFlow's and XLA's ops, PyTorch's
# op table its aten ops.
MP010_GEMMS = {
    "tensorflow": "model/dense/MatMul",
    "jax": "jit(train_step)/jvp(model)/dense/dot_general",
    "torch": "model/dense/aten::mm",
}


@pytest.mark.parametrize("backend", sorted(MP010_GEMMS))
def test_mp010_names_the_layers_whose_eligible_ops_missed_tensor_cores(tmp_path, backend):
    from mpprof.backends import xprof_kernels

    gemm = MP010_GEMMS[backend]
    elementwise = gemm.rpartition("/")[0] + ("/aten::relu" if backend == "torch" else "/Relu")
    launches = [("volta_sgemm_128x64_nn", gemm, 700.0),  # no Tensor Cores
                ("sm80_xmma_gemm_f16f16_f16f32_f32_nn_n_tilesize128x128x32", gemm, 50.0),
                ("void elementwise_kernel<relu>", elementwise, 250.0)]
    kernels = xprof_kernels.summarize_kernel_stats(
        xprof_kernels.kernel_stats_of_launches(launches), source="session")
    assert (kernels["eligible_us"], kernels["eligible_not_using_us"]) == (750.0, 700.0)
    run = write_gpu_run(tmp_path, "healthy_mixed", [A100], kernels=kernels, backend=backend)
    finding = only(run, "MP010")
    assert finding.title == ("Only 5% of GPU kernel time ran on Tensor Cores; eligible ops "
                             "missed them in model/dense")
    [missed] = finding.evidence["top_ops"]
    assert (missed["op_name"], missed["layer"], missed["total_us"]) == (gemm, "model/dense",
                                                                          700.0)
    # The same misses in the float32 head ("logits", float32 on purpose):
    # set apart, never named as a layer that missed the Tensor Cores.
    head = gemm.replace("/dense/", "/logits/")
    head_kernels = xprof_kernels.summarize_kernel_stats(
        xprof_kernels.kernel_stats_of_launches(
            [(kernel, head if op == gemm else op, us) for kernel, op, us in launches]),
        source="session")
    finding = only(write_gpu_run(tmp_path, "healthy_mixed", [A100], kernels=head_kernels,
                                 backend=backend, name="head"), "MP010")
    assert finding.title == "Only 5% of GPU kernel time ran on Tensor Cores"
    assert finding.evidence["float32_layers"] == ["model/logits"]
    # A run recorded before PyTorch's op table (its eligible time unknown):
    # the share alone, no layer.
    old = dict(kernels, eligible_us=None, eligible_not_using_us=None, top_ops=[])
    finding = only(write_gpu_run(tmp_path, "healthy_mixed", [A100], kernels=old,
                                 backend=backend, name="old"), "MP010")
    assert finding.title == "Only 5% of GPU kernel time ran on Tensor Cores"


def test_mp010_busy_tensor_cores_and_idle_gaps_are_no_finding(tmp_path):
    samples = gpu_samples(tensor_util=40.0, gpu_util=95.0)
    # Idle samples (input pipeline) must not dilute the busy ones.
    samples[:20, schema.GPU_SAMPLE_COLUMNS.index("tensor_util")] = 0.0
    samples[:20, schema.GPU_SAMPLE_COLUMNS.index("gpu_util")] = 0.0
    run = write_gpu_run(tmp_path, "healthy_mixed", [A100], samples=samples)
    assert "MP010" not in codes(run)
    assert "MP011" not in codes(run)  # an A100 has fp16 Tensor Cores


def test_mp010_not_measured_without_gpu_data(tmp_path):
    run = write_gpu_run(tmp_path, "healthy_mixed", [A100], gpu_mode="unavailable")
    assert check_status(run, "MP010") == "not measured"
    assert check_status(read("healthy_mixed"), "MP010") == "not applicable"  # CPU


def test_mp011_gpu_without_fp16_tensor_cores(tmp_path):
    finding = only(write_gpu_run(tmp_path, "healthy_mixed", [P100]), "MP011")
    assert finding.evidence["gpus"][0]["compute_capability"] == [6, 0]
    assert "P100" in finding.title


def test_mp013_fp16_overflows_on_bf16_hardware(tmp_path):
    run = write_gpu_run(tmp_path, "storm", [A100])
    finding = only(run, "MP013")
    assert finding.evidence["because_of"] == ["MP002"]
    assert 'set_dtype_policy("mixed_bfloat16")' in finding.fix
    # Hardware without bf16, or a run without overflows: no hint.
    assert "MP013" not in codes(write_gpu_run(tmp_path / "p100", "storm", [P100]))
    assert "MP013" not in codes(write_gpu_run(tmp_path / "ok", "healthy_mixed", [A100]))


def test_mp012_nonfinite_loss_not_caught_by_the_loss_scale(tmp_path):
    run = read("healthy_float32")
    writer = RecordWriter(tmp_path / "train")
    for record, found in run.records.items():
        for item in found:
            if record == schema.HEALTH:
                continue
            if isinstance(item.value, dict):
                writer.write_json(record, item.value, item.step)
            else:
                writer.write_array(record, item.value, item.step)
    writer.write_json(
        schema.HEALTH,
        {
            "first_nonfinite_loss_step": 5,
            "nonfinite_loss_batches": 3,
            "nonfinite_weights": [],
            "checked_step": 8,
        },
        8,
    )
    writer.close()
    finding = only(reader.read_run(tmp_path, "train"), "MP012")
    assert finding.step == 5
    assert finding.evidence["loss_scaled"] is False


def test_hostile_layer_name_is_kept_verbatim_in_findings():
    finding = only(read("hostile"), "MP003")
    assert finding.layer == HOSTILE_NAME


# --- MP014: a probability loss on raw outputs.


def test_mp014_logits_into_a_probability_loss():
    run = read("logits_into_sparse_ce")
    finding = only(run, "MP014")
    assert finding.severity == "critical" and finding.layer == "scores"
    assert finding.evidence["loss"] == "sparse_categorical_crossentropy"
    assert finding.evidence["from_logits"] is False
    assert finding.evidence["final_op"] not in ("Softmax", "Sigmoid")
    # Confirmed by the recorded loss: far above chance (log 8 = 2.08).
    assert finding.evidence["loss_above_chance"] is True
    assert "SparseCategoricalCrossentropy(from_logits=True)" in finding.fix
    assert 'Activation("softmax", dtype="float32")' in finding.fix


def test_mp014_under_bfloat16_with_a_loss_object():
    finding = only(read("logits_into_binary_ce_bf16"), "MP014")
    assert finding.evidence["loss"] == "BinaryCrossentropy"
    assert "BinaryCrossentropy(from_logits=True)" in finding.fix


@pytest.mark.parametrize(
    "name", ["healthy_mixed", "healthy_bfloat16", "healthy_float32",
             "float32_softmax_activation", "sigmoid_into_binary_ce"],
)
def test_mp014_does_not_fire_on_logits_losses_or_probability_heads(name):
    run = read(name)
    assert "MP014" not in codes(run)
    assert check_status(run, "MP014") == "checked"


# --- MP005: judged by the dtype each gradient was computed in.


def test_mp005_names_the_float16_layer_whose_gradient_flushed_to_zero():
    run = read("flushed_gradients")
    finding = only(run, "MP005")
    # The float32 readout's gradients never were float16: not blamed.
    assert finding.layer == "features"
    assert finding.evidence["how"] == "flushed to zero"
    assert finding.evidence["median_underflow_frac"] >= diagnosis.FLUSH_SHARE
    assert not any("readout" in key for key in finding.evidence["underflowing"])
    assert "all values" in finding.evidence["share_of"]


def test_mp005_quiet_on_the_same_model_with_a_normal_loss():
    run = read("unshrunk_gradients")
    assert "MP005" not in codes(run)
    assert check_status(run, "MP005") == "checked"


def test_mp005_judges_estimated_shares_of_large_tensors_alike():
    """Shares of a tensor larger than the sample are estimated from it: the
    fault is still found, on the same layer, and its healthy twin stays quiet."""
    from mpprof.backends.numerics_rows import SAMPLE_VALUES

    run = read("flushed_gradients_sampled")
    layout = run.latest(schema.NUMERICS_LAYOUT)
    assert layout["estimated"]["sample_values"] == SAMPLE_VALUES
    features = run.numerics.layers.index("features")
    assert (run.numerics.backward["count"][:, features] > SAMPLE_VALUES).all()
    finding = only(run, "MP005")
    assert finding.layer == "features"
    assert finding.evidence["how"] == "flushed to zero"
    healthy = read("unshrunk_gradients_sampled")
    assert (healthy.numerics.backward["count"][:, features] > SAMPLE_VALUES).all()
    assert "MP005" not in codes(healthy)
    assert check_status(healthy, "MP005") == "checked"


def test_mp005_not_applicable_in_bfloat16():
    assert check_status(read("flushed_gradients_bf16"), "MP005") == "not applicable"


def test_mp005_needs_enough_ordinary_samples():
    run = read("flushed_gradients_two_samples")
    assert len(run.numerics.steps) == 2
    result = diagnosis.evaluate(run)
    reason = {c.code: c.reason for c in result.not_measured}["MP005"]
    assert f"at least {diagnosis.MIN_UNDERFLOW_SAMPLES}" in reason


def test_mp005_leaves_out_a_bias_whose_gradient_is_zero_by_construction():
    run = read("conv_bias_before_batch_norm")
    grads = run.numerics.variable_grads
    bias = next(i for i, name in enumerate(run.numerics.variables) if name.endswith("conv/bias"))
    # The raw data would have blamed it: mostly subnormal, or zero in every sample.
    assert (np.median(grads["underflow_frac"][:, bias]) >= diagnosis.UNDERFLOW_SHARE
            or (grads["zero_frac"][:, bias] >= 1).all())
    assert run.inventory["layers"][1]["inputs_from"] == ["conv"]  # norm is fed by conv
    assert "MP005" not in codes(run)


# --- Where an overflow starts, and fix texts that hold together.


def test_mp019_names_the_float16_head_where_the_gradient_overflows():
    run = read("half_softmax_gradient_overflow")
    finding = only(run, "MP019")
    assert finding.layer == "probs" and finding.evidence["model_output_is_half"] is True
    assert finding.step == int(run.numerics.steps[0])
    assert "MP006" in finding.fix and 'Activation(..., dtype="float32")' in finding.fix
    assert {"MP001", "MP002"} <= set(finding.evidence["because_of"])
    for code in ("MP001", "MP002"):
        fix = only(run, code).fix
        assert "'probs'" in fix and "MP006" in fix and "MP019" in fix
        assert only(run, code).evidence["gradient_overflow_starts_at"] == "probs"


def test_mp019_quiet_with_a_float32_softmax():
    run = read("float32_softmax_confident")
    assert not codes(run) & {"MP001", "MP002", "MP019", "MP005"}
    assert check_status(run, "MP019") == "checked"


def test_mp019_quiet_when_the_loss_scale_copes():
    # The growth probes overflow once per growth; no numerics there, and the
    # healthy runs with numerics show no gradient overflow at all.
    for name in ("healthy_mixed", "headroom"):
        assert "MP019" not in codes(read(name))


def test_mp019_quiet_on_samples_of_the_loss_scales_initial_descent():
    # Gradients beyond float16 on the descent's samples are the initial
    # scale's, not a layer's: MP002's fix (start the scale lower) is the
    # answer, not a layer in float32.
    run = read("storm_sampled")
    numerics = run.numerics
    descent_end = run.loss_scale.first_step + run.loss_scale.initial_descent
    in_descent = numerics.steps < descent_end
    assert in_descent.any() and (numerics.backward["nonfinite_frac"][in_descent] > 0).any()
    assert "MP019" not in codes(run)
    mp002 = only(run, "MP002")
    assert "initial_scale=2.0**" in mp002.fix
    assert "gradient_overflow_starts_at" not in mp002.evidence


def test_scale_falling_below_one_defers_instead_of_suggesting_a_tiny_scale():
    run = read("overflow_every_step")
    assert run.loss_scale.final_scale < 1
    mp002 = only(run, "MP002")
    assert "initial_scale" not in mp002.fix and "MP001" in mp002.fix
    # The forward pass overflows first: MP003 names it, MP019 does not blame
    # the float32 head that only inherits the NaN.
    assert "'second' (MP003" in mp002.fix and "'second' (MP003" in only(run, "MP001").fix
    assert "MP019" not in codes(run)


def test_mp003_evidence_of_an_all_nonfinite_output_and_its_step():
    run = read("overflow_every_step")
    finding = only(run, "MP003")
    assert finding.evidence["nonfinite_frac"] == 1.0
    assert finding.evidence["abs_max"] is None  # no finite value to report
    assert finding.step == int(run.numerics.steps[0])
    assert finding.evidence["forensic_sample"] is True
    first = finding.evidence["first_overflow_step"]
    assert first == int(run.loss_scale.overflow_steps[0]) == 0 < finding.step
    assert f"on step {finding.step} (forensic sample; the first overflow was at step 0)" in (
        finding.title
    )


# --- The optimizers the train step used, and what it did with the loss.
# Each run's records are the profiler's own: what its train step calls is
# read off the step's code in diagnosis_runs, and written out here by hand.


def _used(name, cls, inner, scale_loss_called):
    return {"name": name, "class": cls, "inner": inner, "loss_scale": inner is not None,
            "apply_called": True, "scale_loss_called": scale_loss_called}


STEP_CALLS = {
    # `optimizer.apply` on the raw loss; scale_loss only with scale=True.
    "raw_loss_step": ([_used("optimizer", "LossScaleOptimizer", "Adam", False)], False),
    "scaled_loss_step": ([_used("optimizer", "LossScaleOptimizer", "Adam", True)], True),
    # Plain Adams: the step calls apply on d_opt, then g_opt, and scale_loss on
    # neither; the compiled RMSprop is never called.
    "gan_plain_optimizers": (
        [_used("d_opt", "Adam", None, False), _used("g_opt", "Adam", None, False)], False,
    ),
    # LossScaleOptimizers: scale_loss on g_opt, then d_opt, before any apply.
    "gan_scaled_optimizers": (
        [_used("g_opt", "LossScaleOptimizer", "Adam", True),
         _used("d_opt", "LossScaleOptimizer", "Adam", True)], True,
    ),
}


@pytest.mark.parametrize("name", sorted(STEP_CALLS))
def test_the_profiler_records_what_the_train_step_called(name):
    run = read(name)
    optimizers, loss_watched = STEP_CALLS[name]
    assert run.context["optimizers"] == optimizers
    assert run.health["loss_watched"] is loss_watched
    # numerics_every=1 samples every step but the first (a fit's first call
    # runs the plain traced function). Each sample's loss is the loss its step
    # returned when a watched optimizer saw it, else NaN: "not measured",
    # never a value.
    step_losses = np.array(STEP_LOSSES[name])
    steps = run.numerics.steps
    np.testing.assert_array_equal(steps, np.arange(1, len(step_losses)))
    if loss_watched:
        np.testing.assert_allclose(run.numerics.loss, step_losses[steps], rtol=1e-6)
    else:
        assert np.isnan(run.numerics.loss).all()


def test_mp018_apply_without_scale_loss():
    run = read("raw_loss_step")
    finding = only(run, "MP018")
    assert finding.severity == "critical"
    assert finding.evidence["optimizers"][0]["scale_loss_called"] is False
    assert "self.optimizer.scale_loss(loss)" in finding.fix
    assert "MP008" not in codes(run)  # it is a LossScaleOptimizer
    # Adam normalises a constant factor away: the real loss is underflow.
    assert finding.evidence["update_effect"] == "adaptive"
    assert "flush to zero" in finding.fix and "1.7x" in finding.fix
    assert "too small" not in finding.fix


def test_mp018_with_sgd_says_every_update_is_too_small():
    finding = only(read("raw_loss_step_sgd"), "MP018")
    assert finding.evidence["update_effect"] == "scaled"
    assert "every update is" in finding.fix and "times too small" in finding.fix
    assert "1.7x" not in finding.fix
    assert "tf.GradientTape" in finding.fix  # a TensorFlow run: TensorFlow code


def test_mp018_quiet_when_the_loss_is_scaled():
    run = read("scaled_loss_step")
    assert not codes(run) & {"MP018", "MP008"}
    assert check_status(run, "MP018") == "checked"


def test_an_unwatched_loss_is_not_measured_never_a_value():
    run = read("raw_loss_step")
    assert run.health["loss_watched"] is False
    assert np.isnan(run.numerics.loss).all()  # as the profiler recorded it
    # MP012 must not read the NaN "loss" as a non-finite loss.
    assert "MP012" not in codes(run)
    assert check_status(run, "MP012") == "not measured"


def test_mp008_judges_every_optimizer_the_train_step_used():
    finding = only(read("gan_plain_optimizers"), "MP008")
    assert finding.evidence["optimizers_without_loss_scaling"] == ["d_opt (Adam)", "g_opt (Adam)"]
    assert "d_opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())" in finding.fix
    assert "scale_loss" in finding.fix


def test_mp008_ignores_the_compiled_optimizer_the_step_never_used():
    run = read("gan_scaled_optimizers")
    # The compiled RMSprop (plain, never used) is not among the step's optimizers.
    assert [o["class"] for o in run.context["optimizers"]] == ["LossScaleOptimizer"] * 2
    assert not codes(run) & {"MP008", "MP018"}
    assert check_status(run, "MP008") == "checked"


def _as_tf_keras(tmp_path, name):
    from diagnosis_runs import rewrite_run

    rewrite_run(tmp_path, read(name), context={"keras_flavor": "tf_keras"})
    return reader.read_run(tmp_path, "train")


def test_fix_texts_speak_tf_keras_for_a_tf_keras_model(tmp_path):
    run = _as_tf_keras(tmp_path, "half_softmax_gradient_overflow")
    fixes = {f.code: f.fix for f in diagnosis.diagnose(run)}
    assert {"MP001", "MP002", "MP006", "MP019", "MP011"} <= set(fixes)
    for fix in fixes.values():
        assert "keras.mixed_precision.set_dtype_policy" not in fix
        assert "keras.layers." not in fix.replace("tf_keras.layers.", "")
    assert 'tf_keras.mixed_precision.set_global_policy("mixed_bfloat16")' in fixes["MP001"]
    assert 'tf_keras.layers.Activation(..., dtype="float32")' in fixes["MP019"]
    # ...and the Keras 3 run of the same model speaks Keras 3.
    keras3 = {f.code: f.fix for f in diagnosis.diagnose(read("half_softmax_gradient_overflow"))}
    assert 'keras.mixed_precision.set_dtype_policy("mixed_bfloat16")' in keras3["MP001"]


def test_tf_keras_loss_scale_fixes_use_its_optimizer_api(tmp_path):
    storm = {f.code: f for f in diagnosis.diagnose(_as_tf_keras(tmp_path / "storm", "storm"))}
    assert "tf_keras.mixed_precision.LossScaleOptimizer(optimizer, initial_scale=" in (
        storm["MP002"].fix
    )
    raw = only(_as_tf_keras(tmp_path / "raw", "raw_loss_step"), "MP018")
    assert "get_scaled_loss(loss)" in raw.fix and "scale_loss(loss)\n" not in raw.fix


# --- What the front ends list: each finding's view, and the notes.


def test_findings_carry_their_view_and_notes_say_what_was_not_judged():
    run = read("storm")  # no numerics recorded
    result = diagnosis.evaluate(run)
    assert {f.code: f.view for f in result.findings}["MP002"] == "loss_scale"
    as_dict = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    notes = {note["code"]: note for note in as_dict["notes"]}
    assert notes["MP003"]["status"] == "not measured"
    assert "numerics_every" in notes["MP003"]["reason"]
    assert notes["MP003"]["view"] == "numerics" and notes["MP003"]["title"]
    # "not measured" first, then "not applicable"; checked rules are no note.
    statuses = [note["status"] for note in as_dict["notes"]]
    assert statuses == sorted(statuses, key=lambda s: s != "not measured")
    assert notes["MP010"]["status"] == "not applicable"  # CPU only
    checked = {c.code for c in result.checks if c.status == "checked"}
    assert not checked & set(notes)
    assert [f["code"] for f in as_dict["findings"]] == [f.code for f in result.findings]


def test_one_overflow_answer_judged_by_each_layers_dtype():
    run = read("forward_overflow")
    mask = diagnosis.forward_overflow_mask(run)
    layers = run.numerics.layers
    # "second" (float16) overflowed; "head" is float32 and only inherits NaN.
    assert mask[:, layers.index("second")].all()
    assert diagnosis.first_forward_offender(run, 0) == layers.index("second")
    # A float32 layer above 65504 but finite did not overflow float32.
    island = read("float32_island_beyond_half_range")
    head = island.numerics.layers.index("head")
    assert (island.numerics.forward["abs_max"][:, head] > 65504).all()
    assert not diagnosis.forward_overflow_mask(island)[:, head].any()
    assert "MP003" not in codes(island) and "MP004" in codes(island)


def test_gradient_underflow_share_only_for_float16_gradients():
    bf16 = read("flushed_gradients_bf16")
    assert np.isnan(diagnosis.gradient_underflow_share(bf16)).all()
    run = read("flushed_gradients")
    share = diagnosis.gradient_underflow_share(run)
    readout = run.numerics.layers.index("readout")  # float32
    assert np.isnan(share[:, readout]).all()
    assert (run.numerics.backward["underflow_frac"][:, readout] > 0.5).all()  # raw count
    assert np.isfinite(share[:, run.numerics.layers.index("features")]).all()


def test_mp005_leaves_out_an_attention_key_bias():
    run = read("attention_key_bias")
    grads = run.numerics.variable_grads["underflow_frac"]
    key_bias = run.numerics.variables.index("attention/key/bias")
    assert np.median(grads[:, key_bias]) >= diagnosis.UNDERFLOW_SHARE  # would have fired
    assert "MP005" not in codes(run)


def test_mp005_names_a_nested_layer_by_its_full_path():
    finding = only(read("attention_underflow"), "MP005")
    assert finding.layer in ("attention/key", "attention/query", "attention/value")
    assert finding.layer in read("attention_underflow").numerics.layers

