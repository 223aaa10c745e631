"""The precision advisor on planted models trained for real (TensorFlow, CPU).

Each planted model (tests/advise_models.py) hides a reason the plan must
name; the healthy one must get "nothing to change"; no plan lowers a layer
the numerics show overflowing or without headroom; each plan retrained
keeps the loss within the verification's trial band of float32; the
projection's arithmetic matches roofline figures worked out here by hand;
the JAX half of the parity test trains the same models in a subprocess.
"""

import json
import math
import os
import subprocess
import sys

import advise_models
import pytest
from diagnosis_runs import A100, P100

import mpprof
from mpprof import cli, diagnosis
from mpprof.advisor import gpus, projection
from mpprof.advisor.facts import Gemm
from mpprof.records import reader, schema
from mpprof.replay import files
from mpprof.replay.verification import judge_trial

NAMES = list(advise_models.BUILDERS)
PARITY = ("mlp", "overflow", "float8")


@pytest.fixture(scope="module")
def advice(tmp_path_factory):
    """name -> (its logdir, `mpprof.advise` of it). The healthy model keeps
    no batches (advise_batches=0): the unverified case."""
    found = {}
    for name in NAMES:
        logdir = tmp_path_factory.mktemp(f"advise_{name}")
        found[name] = (logdir, advise_models.fit_planted(
            name, logdir, advise_batches=0 if name == "healthy" else 2))
    return found


def _rows(plan, action):
    return {r["layer"].rpartition("/")[2] for r in plan["rows"] if r["action"] == action}


@pytest.mark.parametrize("name", NAMES)
def test_plan_names_the_planted_reasons(advice, name):
    plan = advice[name][1]["plan"]
    expected = advise_models.EXPECTED[name]
    assert expected["lower"] <= _rows(plan, "lower"), plan["rows"]
    assert expected["float32"] == _rows(plan, "float32"), plan["rows"]
    assert expected["float8"] <= _rows(plan, "float8"), plan["rows"]
    for layer in expected.get("stay", ()):
        row = next(r for r in plan["rows"] if r["layer"] == layer)
        assert (row["now"], row["planned"], row["action"]) == ("float32", "float32", "keep")
        assert "needs float32" in row["reasons"][0]
    if name == "healthy":
        assert plan["nothing_to_change"]
        assert "nothing to change" in plan["code"]
    else:
        assert not plan["nothing_to_change"]
        for layer in expected["lower"]:
            assert f'name="{layer}", dtype="mixed_float16"' in plan["code"]
        for layer in expected["float8"]:
            assert f"^{layer}$" in plan["code"]


@pytest.mark.parametrize("name", NAMES)
def test_no_plan_lowers_an_overflowing_layer_or_one_without_headroom(advice, name):
    advised = advice[name][1]
    facts = {f["name"]: f for f in advised["facts"]}
    for row in advised["plan"]["rows"]:
        if row["action"] not in ("lower", "float8"):
            continue
        fact = facts[row["layer"]]
        assert fact["sampled"] and not fact["overflowed"], row
        assert fact["float16_headroom"] >= 16, row
    if name == "overflow":
        boom = facts["boom"]
        assert boom["overflowed"] and boom["first_overflow"]


@pytest.mark.parametrize("name", [n for n in NAMES if n != "healthy"])
def test_retraining_with_the_plan_keeps_the_loss_in_band(advice, name):
    """The model trained with its plan and in float32 from the same weights on
    the same batches: the plan's losses pass the verification's trial band."""
    plan = advice[name][1]["plan"]
    reference, initial = advise_models.retrain(name, None, "float32", [])
    losses, _ = advise_models.retrain(name, advise_models.plan_dtypes(plan), "mixed_float16",
                                      plan["float8_filters"], initial=initial)
    trial = judge_trial(losses, reference)
    assert trial.passed, trial.reason


def test_the_healthy_run_without_batches_is_labelled_unverified(advice, capsys):
    logdir, advised = advice["healthy"]
    verification = advised["verification"]
    assert verification["state"] == "unverified"
    assert "advise_batches=" in verification["detail"]
    assert cli.main(["advise", str(logdir), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "verification: unverified" in out and "advise_batches=4" in out


def test_advise_batches_are_spread_across_the_fit_and_kept_apart(advice):
    logdir, advised = advice["mlp"]
    # 64 samples / 8 = 8 steps, 2 batches: the middles of the halves, steps 2 and 6.
    kept = files.find_captures(logdir, "train", folder=files.ADVISE_FOLDER)
    assert [c.step for c in kept] == [2, 6]
    assert all(c.manifest["purpose"] == "advise" for c in kept)
    assert files.find_captures(logdir, "train") == []  # not a replay's step
    assert advised["verification"]["batches"] == 2


def test_verify_replays_the_plan_with_the_verification_api(advice):
    logdir, _ = advice["mlp"]
    advised = mpprof.advise(str(logdir), verify=True)
    verification = advised["verification"]
    assert verification["state"] == "verified", verification["detail"]
    assert verification["plan"]["dtype"] == "float16"
    assert len(verification["plan"]["step"]) == 2  # both kept batches checked
    assert verification["plan"]["trial"]["passed"]
    assert verification["current"]["candidate"]["label"] == "the current policy"
    assert all(r["verified"] for r in advised["plan"]["rows"] if r["action"] != "keep")
    # Each layer's replayed sensitivity: float16 rounds ~8x finer than bfloat16.
    island = next(f for f in advised["facts"] if f["name"] == "island")["sensitivity"]
    assert 0 < island["float16"]["output"] < island["bfloat16"]["output"] < 0.05
    # Float8's rounding of its GEMM's operands (e4m3: 3 mantissa bits, e5m2: 2),
    # coarser than float16's and bfloat16's (10 and 7).
    assert island["bfloat16"]["output"] < island["float8"]["input"] < 0.1
    assert island["float8"]["input"] < island["float8"]["gradient"] < 0.2


def test_float8_rounding_by_hand():
    """[2, 1, 0.1] at amax scaling: x 224 -> 448, 224, 22.4; e4m3 holds 448
    and 224 exactly and rounds 22.4 to 22 (steps of 2 between 16 and 32)."""
    from mpprof.advisor.verify import float8_rounding

    values = [2.0, 1.0, 0.1]
    error = math.hypot(0.1 - 22 / 224) / math.hypot(*values)
    assert float8_rounding(values, "float8_e4m3fn") == pytest.approx(error, rel=1e-12)
    assert float8_rounding([0.0, 0.0], "float8_e4m3fn") is None


def test_cli_json_and_text(advice, capsys):
    logdir, _ = advice["overflow"]
    assert cli.main(["advise", str(logdir), "--format", "json", "--gpu", "a100"]) == 0
    advised = json.loads(capsys.readouterr().out)
    assert advised["projection"]["gpu"] == "A100"
    assert advised["plan"]["must_float32"] == ["hot", "boom", "out"]
    assert cli.main(["advise", str(logdir)]) == 0
    text = capsys.readouterr().out
    assert "must be float32:\n    boom (Dense, float16 -> float32)" in text
    assert "a projection, not a measurement" in text


def test_an_unknown_gpu_lists_the_known_ones(advice, capsys):
    logdir, _ = advice["healthy"]
    assert cli.main(["advise", str(logdir), "--gpu", "RTX9999"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "unknown GPU 'RTX9999'" in err
    for name in ("V100", "T4", "A100", "L4", "H100", "H200", "B200"):
        assert name in err


def test_the_run_context_says_what_float32_matmuls_run_as(advice):
    import tensorflow as tf

    matmuls = advice["mlp"][1]["baseline"]["float32_matmuls"]
    assert matmuls["framework"] == "tensorflow"
    assert matmuls["tf32_enabled"] is tf.config.experimental.tensor_float_32_execution_enabled()
    assert advice["mlp"][1]["baseline"]["float32_runs_as"] == "tf32"  # H100, TF32 on


def _on_gpu(tmp_path, logdir, gpu, **context):
    """The run of `logdir` rewritten as if it had trained on `gpu`."""
    from diagnosis_runs import rewrite_run

    source = reader.read_run(logdir, "train")
    rewrite_run(tmp_path, source, context={
        "hardware": {"cpu_only": False, "gpus": [gpu], "source": "test"}, **context})
    return reader.read_run(tmp_path, "train")


def _mp020(run):
    result = diagnosis.evaluate(run)
    status = next(c.status for c in result.checks if c.code == "MP021")
    return status, [f for f in result.findings if f.code == "MP021"]


def test_mp020_a_float32_island_runs_tf32_on_ampere(advice, tmp_path):
    """The mlp's "island" (a float32 Dense) on an A100 with TF32 on (the
    default, as recorded): its matmul runs in TF32."""
    status, found = _mp020(_on_gpu(tmp_path, advice["mlp"][0], A100))
    assert status == "checked" and len(found) == 1
    assert found[0].evidence["layers"] == ["island"]  # not "out", the float32 output
    assert found[0].layer == "island"
    assert "enable_tensor_float_32_execution(False)" in found[0].fix


def test_mp020_look_alikes_are_no_finding(advice, tmp_path):
    logdir = advice["mlp"][0]
    # On its CPU, or a GPU without TF32: float32 is float32.
    assert _mp020(reader.read_run(logdir, "train"))[0] == "not applicable"
    assert _mp020(_on_gpu(tmp_path / "p100", logdir, P100))[0] == "not applicable"
    # TF32 turned off; a model whose only float32 layer is its output.
    matmuls = {**reader.read_run(logdir, "train").context.float32_matmuls,
               "tf32_enabled": False}
    assert _mp020(_on_gpu(tmp_path / "off", logdir, A100, float32_matmuls=matmuls)) == (
        "checked", [])
    assert _mp020(_on_gpu(tmp_path / "healthy", advice["healthy"][0], A100)) == ("checked", [])


def test_a_layer_fed_by_a_normalization_knows_its_producer(advice):
    """keras-hub's encoder feeds its float16 feed-forward Dense the output of
    a LayerNormalization, which computes in float32 and ends in a Cast: that
    Cast is the norm's output, not one of the Dense's (TensorFlow's tracer
    looked behind it and lost the producer, so the float8 input share was
    unknown and the plan differed from JAX's)."""
    facts = {f["name"]: f for f in advice["hub"][1]["facts"]}
    dense = facts["transformer_layer_0/feedforward_intermediate_dense"]
    assert dense["producer"] == "transformer_layer_0/self_attention_layer_norm"
    assert dense["float8_input_loss"] is not None


def test_both_backends_give_the_same_plan(advice, tmp_path):
    env = {**os.environ, "KERAS_BACKEND": "jax"}
    subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "advise_models.py"),
                    str(tmp_path), *PARITY], env=env, check=True, capture_output=True)
    jax_plans = json.loads((tmp_path / "plans.json").read_text())
    for name in PARITY:
        tf_plan = advice[name][1]["plan"]
        summary = {key: tf_plan[key] for key in jax_plans[name]}
        assert jax_plans[name] == summary, name


# The projection's arithmetic, against roofline figures worked out by hand
# from the datasheet numbers (typed here, not read from the table).

def test_a_large_gemm_on_h100_is_compute_bound():
    gemm = Gemm(m=4096, n=4096, k=4096, basis="test")
    seconds, bound = projection.gemm_seconds(gemm, gpus.FP16, gpus.gpu("H100"))
    flops = 2 * 4096**3                                   # 1.374e11
    compute = flops / (989.4e12 * 0.78)                   # 178 us
    memory = 3 * 4096**2 * 2 / (3.35e12 * 0.92)           # 32.7 us
    assert bound == "compute"
    assert seconds == pytest.approx(3 * max(compute, memory), rel=1e-12)
    assert seconds == pytest.approx(5.341e-4, rel=1e-3)


def test_a_thin_gemm_on_a100_is_memory_bound_and_float32_runs_as_tf32():
    a100 = gpus.gpu("nvidia a100")
    assert projection.mode_of("float32", a100, None) == gpus.TF32
    assert projection.mode_of("float32", a100, False) == gpus.FP32
    gemm = Gemm(m=8, n=1024, k=1024, basis="test")
    seconds, bound = projection.gemm_seconds(gemm, gpus.TF32, a100)
    moved = (8 * 1024 + 1024 * 1024 + 8 * 1024) * 4      # 4.26 MB
    assert bound == "memory"
    assert seconds == pytest.approx(3 * moved / (2.039e12 * 0.92), rel=1e-12)
    assert seconds == pytest.approx(6.815e-6, rel=1e-3)


def test_gpus_without_tf32_bf16_or_fp8_fall_back():
    v100, t4, l4 = gpus.gpu("V100"), gpus.gpu("T4"), gpus.gpu("L4")
    assert projection.mode_of("float32", v100, True) == gpus.FP32
    assert projection.mode_of("bfloat16", t4, True) == gpus.FP32
    assert projection.mode_of("float8", v100, True) == gpus.FP16
    assert projection.mode_of("float8", l4, True) == gpus.FP8
    gemm = Gemm(m=2048, n=2048, k=2048, basis="test")
    seconds, _ = projection.gemm_seconds(gemm, gpus.FP32, v100)
    assert seconds == pytest.approx(3 * 2 * 2048**3 / (15.7e12 * 0.78), rel=1e-12)


def test_cast_traffic_by_hand():
    gemm = Gemm(m=64, n=32, k=16, basis="test")
    # float16 layer fed float32: the input and its gradient cast (64x16, 4+2
    # bytes each way), and the float32 kernel cast both ways (16x32, 4+2).
    assert projection.cast_bytes(gemm, gpus.FP16, gpus.TF32) == (
        2 * 64 * 16 * 6 + 2 * 16 * 32 * 6)
    # float32 fed float32: nothing.
    assert projection.cast_bytes(gemm, gpus.TF32, gpus.TF32) == 0
    # float8 fed float16: input cast (2+1), kernel (4+1), and one more read of
    # each quantized tensor for its amax (2 bytes each).
    assert projection.cast_bytes(gemm, gpus.FP8, gpus.FP16) == (
        2 * 64 * 16 * 3 + 2 * 16 * 32 * 5 + (64 * 16 + 16 * 32 + 64 * 32) * 2)


def test_the_whole_projection_of_a_plan_by_hand(advice):
    advised = mpprof.advise(str(advice["mlp"][0]), gpu="H100")
    facts = {f["name"]: f for f in advised["facts"]}
    island = next(t for t in advised["projection"]["layers"] if t["layer"] == "island")
    (g,) = facts["island"]["gemms"]
    # 8 rows (the batch) x 40 x 40: memory bound at TF32 now, float16 planned.
    assert (g["m"], g["n"], g["k"]) == (8, 40, 40)
    moved = 8 * 40 + 40 * 40 + 8 * 40
    assert island["now_s"] == pytest.approx(3 * moved * 4 / (3.35e12 * 0.92), rel=1e-12)
    assert island["plan_s"] == pytest.approx(3 * moved * 2 / (3.35e12 * 0.92), rel=1e-12)
    total = sum(t["plan_s"] + t["plan_cast_s"] for t in advised["projection"]["layers"])
    assert advised["projection"]["gemm_seconds_plan"] == pytest.approx(total)
    assert not math.isnan(advised["projection"]["gemm_speedup"])


def test_the_tab_serves_the_advice(advice):
    from test_plugin_routes import get_json, tensorboard_client

    logdir = advice["overflow"][0]
    client = tensorboard_client(logdir)
    payload = get_json(client, "advice", run="train")
    assert payload["available"]
    assert payload["plan"]["must_float32"] == ["hot", "boom", "out"]
    assert payload["plan"] == mpprof.advise(str(logdir))["plan"]
    assert payload["verification"]["state"] == "unverified"
    (listed,) = get_json(client, "runs")["runs"]
    assert listed["float32_matmuls"].startswith(
        "tf.config.experimental.tensor_float_32_execution_enabled()")
    assert client.get("/data/plugin/mpprof/advice?run=nope").status_code == 404


def test_the_report_has_the_advice_section(advice):
    from mpprof import report

    mpprof.advise(str(advice["mlp"][0]), verify=True)  # saved beside the batches
    html = report.build_report(advice["mlp"][0])
    section = html[html.index("<h3>Precision advice</h3>"):html.index("<h3>Precision inventory")]
    assert "<td>island</td><td>Dense</td><td>float32</td><td>float16 (can go lower)</td>" in (
        section)
    assert "<b>Verification:</b> verified:" in section
    assert "float32 matmuls</th><td>tf.config.experimental" in html


def test_amdahl_over_a_measured_step_by_hand(advice):
    """Only the GEMMs change: with the run's step measured on the GPU, the
    rest of the step stays."""
    from mpprof.advisor import advise_run
    from mpprof.advisor.facts import layer_facts
    from mpprof.advisor.plan import make_plan

    run = reader.read_run(advice["cnn"][0], "train")
    facts = layer_facts(run)
    plan = make_plan(facts, "mixed_float16", "float16")
    h100 = gpus.gpu("H100")
    alone = projection.project(plan, facts, h100, True)
    now, planned = alone["gemm_seconds_now"], alone["gemm_seconds_plan"]
    step = 4 * now  # the GEMMs (and their casts) a quarter of the step
    measured = projection.project(plan, facts, h100, True, measured_step_s=step)
    assert measured["gemm_share_of_step"] == pytest.approx(0.25)
    assert measured["step_speedup"] == pytest.approx(1 / (0.75 + 0.25 * planned / now))
    assert 1 < measured["step_speedup"] < alone["gemm_speedup"]
    assert advise_run(run)["projection"]["step_speedup"] is None  # a CPU run: GEMMs only


# Attention: sized from the recorded shapes, checked against FLOPs worked out
# by hand from the models' definitions (tests/advise_models.py).

def _attention_flops(batch, heads, queries, keys, key_dim, value_dim):
    """Forward and backward FLOPs of QK^T and AV: 3 x 2 x B·H·T·S·(dk + dv)."""
    return 3 * 2 * batch * heads * queries * keys * (key_dim + value_dim)


def test_multi_head_attention_is_sized_from_the_recorded_shapes(advice):
    """The planted transformer: MultiHeadAttention(num_heads=2, key_dim=8) on
    8 tokens of 16 features, batch 8; its projections are EinsumDense rows."""
    advised = mpprof.advise(str(advice["transformer"][0]), gpu="H100")
    facts = {f["name"]: f for f in advised["facts"]}
    qk, av = facts["mha"]["gemms"]
    assert (qk["name"], qk["batch"], qk["m"], qk["n"], qk["k"]) == ("QK^T", 16, 8, 8, 8)
    assert (av["name"], av["batch"], av["m"], av["n"], av["k"]) == ("AV", 16, 8, 8, 8)
    assert facts["mha"]["step_flops"] == _attention_flops(8, 2, 8, 8, 8, 8) == 98304
    # The query projection: (8 x 8 tokens) x 16 features -> 2 heads x 8.
    assert facts["mha/query"]["step_flops"] == 3 * 2 * (8 * 8) * 16 * (2 * 8)
    assert facts["mha"]["aligned"] is True
    row = next(r for r in advised["plan"]["rows"] if r["layer"] == "mha")
    assert (row["action"], row["planned"]) == ("keep", "float16")
    assert "QK^T: 16 x 8x8x8" in row["reasons"][-1] and "Tensor Core friendly" in (
        row["reasons"][-1])
    # Its roofline on H100 in float16, by hand: each product moves
    # 16 x (64 + 64 + 64) halves and computes 2 x 16 x 512 FLOP: memory bound.
    timed = next(t for t in advised["projection"]["layers"] if t["layer"] == "mha")
    moved = 16 * (8 * 8 * 3) * 2
    per_product = max(2 * 16 * 8 * 8 * 8 / (989.4e12 * 0.78), moved / (3.35e12 * 0.92))
    assert timed["now_bound"] == "memory"
    assert timed["now_s"] == pytest.approx(2 * 3 * per_product, rel=1e-12)
    assert timed["now_cast_s"] == 0  # both operands made inside, in its dtype
    assert "mha" not in advised["projection"]["unsized_layers"]


@pytest.fixture(scope="module")
def cross_attention(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("advise_cross_attention")
    return logdir, advise_models.fit_planted("cross_attention", logdir, advise_batches=0)


def test_cross_attention_with_a_misaligned_key_length_is_sized_and_left_alone(
        cross_attention):
    """The healthy look-alike: 6 queries attend to 10 keys, everything in
    mixed_float16: both attention layers sized by hand, flagged misaligned
    (10 is no multiple of 8), and nothing to change; the text and the report
    say so, though no row changes."""
    from mpprof import report
    from mpprof.advisor.text import advice_lines

    logdir, advised = cross_attention
    facts = {f["name"]: f for f in advised["facts"]}
    cross, dot = facts["cross"], facts["dot"]
    assert [(g["batch"], g["m"], g["n"], g["k"]) for g in cross["gemms"]] == [
        (16, 6, 10, 8), (16, 6, 8, 10)]
    assert cross["step_flops"] == _attention_flops(8, 2, 6, 10, 8, 8)
    # keras.layers.Attention([q, v]): one head, the 16 features contracted.
    assert [(g["batch"], g["m"], g["n"], g["k"]) for g in dot["gemms"]] == [
        (8, 6, 10, 16), (8, 6, 16, 10)]
    assert dot["step_flops"] == _attention_flops(8, 1, 6, 10, 16, 16)
    assert cross["aligned"] is False and dot["aligned"] is False
    plan = advised["plan"]
    assert plan["nothing_to_change"], plan["rows"]
    for name, sizes in (("cross", "[8, 10]"), ("dot", "[10, 16]")):
        row = next(r for r in plan["rows"] if r["layer"] == name)
        assert row["action"] == "keep"
        assert f"{sizes} are not all multiples of 8" in row["reasons"][-1]
    assert advised["projection"]["unsized_layers"] == []
    text = "\n".join(advice_lines(advised))
    assert "attention (sized from the recorded shapes):\n    cross (MultiHeadAttention): " \
        "attention GEMMs per step" in text
    assert "dot (Attention): attention GEMMs per step" in text
    html = report.build_report(logdir)
    assert "<li>cross (MultiHeadAttention): attention GEMMs per step" in html


def _island(name, cls, sampled=True):
    """A float32 layer whose sampled output fits float16 with room to spare."""
    from mpprof.advisor.facts import LayerFacts

    return LayerFacts(name=name, path=name, cls=cls, compute_dtype="float32",
                      policy="float32", quantization_mode=None, is_output=False,
                      gemms=[], gemm_dims=None, aligned=None, float8_eligible=False,
                      sampled=sampled, samples=8, forward_abs_max=3.0,
                      backward_abs_max=1.0, forward_underflow=0.0, backward_underflow=0.0)


H100 = {"name": "NVIDIA H100 80GB HBM3", "compute_capability": [9, 0],
        "architecture": "Hopper", "fp16_tensor_cores": True, "bf16": True}


# The GPU sampler's clock in the rewritten runs: a sample every 50 ms, each
# at the next step.
STEP_S = 0.05


def _on_h100(tmp_path, logdir, traced_steps=None, kernels=False, eligibility_known=True):
    """The run of `logdir` as if it had trained on an H100 whose sampler saw
    a step every STEP_S, with (`kernels`) a profile window whose trace is
    tests/xplanes.py's kernels, converted by the real XProf (`traced_steps`:
    the window's steps, None for a TensorBoard trace)."""
    import numpy as np
    from xplanes import write_gpu_xspace

    from mpprof.backends.xprof_kernels import tensor_core_share
    from mpprof.records.writer import RecordWriter

    source = reader.read_run(logdir, "train")
    collectors = dict(source.context["collectors"])
    if kernels:
        collectors["kernels"] = {"state": "ok", "window": [2, 3], "phase": "done",
                                 "reason": "test"}
        if traced_steps:
            collectors["kernels"]["traced_steps"] = traced_steps
    _on_gpu(tmp_path, logdir, H100, collectors=collectors)
    writer = RecordWriter(tmp_path / "train")
    rows = np.full((8, len(schema.GPU_SAMPLE_COLUMNS)), np.nan)
    rows[:, schema.GPU_SAMPLE_COLUMNS.index("step")] = np.arange(8)
    rows[:, schema.GPU_SAMPLE_COLUMNS.index("wall_time")] = 1000 + STEP_S * np.arange(8)
    rows[:, schema.GPU_SAMPLE_COLUMNS.index("device")] = 0
    writer.write_array(schema.GPU_SAMPLES, rows, 7)
    if kernels:
        write_gpu_xspace(tmp_path / "trace" / "2026_01_01_00_00_00")
        table = tensor_core_share(tmp_path / "trace")
        if not eligibility_known:  # as PyTorch's window recorded it before its op table
            table.update(eligible_us=None, eligible_not_using_us=None, top_ops=[])
        writer.write_json(schema.KERNEL_STATS, table, 4)
    writer.close()
    return reader.read_run(tmp_path, "train")


def test_amdahl_over_the_measured_step_from_xprof_kernel_times(advice, tmp_path):
    """With a profile window, the GEMMs' share of the step is measured: the
    Tensor-Core-eligible ops' kernel time per traced step over the step time
    the GPU sampler saw; without the traced steps (TensorBoard's trace),
    their share of GPU kernel time; without a window, the roofline's GEMM
    time over the step (as before)."""
    from xplanes import KERNELS, total_us

    from mpprof.advisor import advise_run

    gemm_us = total_us([k for k in KERNELS if k[5]])  # the eligible ops' kernels
    logdir = advice["cnn"][0]
    run = _on_h100(tmp_path / "window", logdir, [2, 3], kernels=True)
    projected = advise_run(run)["projection"]
    assert projected["gpu"] == "H100"
    assert projected["measured_step_seconds"] == pytest.approx(STEP_S)
    share = gemm_us * 1e-6 / 2 / STEP_S  # two traced steps
    assert projected["amdahl_source"] == projection.AMDAHL_XPROF_STEP
    assert projected["gemm_share_of_step"] == pytest.approx(share, rel=1e-9)
    ratio = projected["gemm_seconds_plan"] / projected["gemm_seconds_now"]
    assert projected["step_speedup"] == pytest.approx(1 / ((1 - share) + share * ratio))
    assert "2 traced steps" in projected["amdahl_detail"]

    tensorboard = advise_run(_on_h100(tmp_path / "tb", logdir, None, kernels=True))
    projected = tensorboard["projection"]
    assert projected["amdahl_source"] == projection.AMDAHL_XPROF_SHARE
    assert projected["gemm_share_of_step"] == pytest.approx(gemm_us / total_us(KERNELS))

    # Look-alikes: on H100 without a window, the roofline's share; projected
    # for another GPU, the H100's times say nothing: GEMMs only.
    plain = advise_run(_on_h100(tmp_path / "plain", logdir))["projection"]
    assert plain["amdahl_source"] == projection.AMDAHL_ROOFLINE
    assert plain["gemm_share_of_step"] == pytest.approx(plain["gemm_seconds_now"] / STEP_S)
    other = advise_run(run, gpu=gpus.gpu("A100"))["projection"]
    assert other["step_speedup"] is None and other["amdahl_source"] is None
    # A trace whose eligible time is unknown (a PyTorch run recorded before
    # PyTorch's op table judged its aten ops): the roofline's.
    unknown = advise_run(_on_h100(tmp_path / "torch", logdir, [2, 3], kernels=True,
                                  eligibility_known=False))["projection"]
    assert unknown["amdahl_source"] == projection.AMDAHL_ROOFLINE


def test_an_attention_island_keeps_its_projections_float32():
    """A float32 MultiHeadAttention stays float32 and so do its projections,
    though their outputs fit float16: they make the scores' operands."""
    from mpprof.advisor.plan import make_plan

    plan = make_plan([_island("mha/query", "EinsumDense"),
                      _island("mha", "MultiHeadAttention", sampled=False),
                      _island("mha_out", "Dense")], "mixed_float16", "float16")
    query, mha, after = plan.rows
    assert (mha.action, mha.planned) == ("keep", "float32")
    assert "attention scores" in mha.reasons[0]
    assert (query.action, query.planned) == ("keep", "float32")
    assert "inside mha" in query.reasons[0]
    assert (after.action, after.planned) == ("lower", "float16")  # "mha_out" is not inside


def test_an_attention_island_is_never_lowered_on_its_output_headroom():
    """Its query-key scores (what overflows) are inside it, never sampled:
    the same output numbers lower a Dense island but not an Attention one."""
    from mpprof.advisor.plan import make_plan

    plan = make_plan([_island("attention", "Attention"), _island("dense", "Dense")],
                     "mixed_float16", "float16")
    attention, dense = plan.rows
    assert (attention.action, attention.planned) == ("keep", "float32")
    assert "attention scores" in attention.reasons[0]
    assert (dense.action, dense.planned) == ("lower", "float16")


def test_the_summary_says_what_float32_matmuls_ran_as(advice, capsys):
    logdir = str(advice["mlp"][0])
    assert cli.main(["summary", logdir]) == 0
    assert "  float32 matmuls: tf.config.experimental.tensor_float_32_execution_enabled() = " \
        "True" in capsys.readouterr().out
    assert cli.main(["summary", logdir, "--format", "json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["float32_matmuls"].endswith("= True")
