"""The precision advisor's JAX half: a planted model trained on JAX gets its
plan (the float32 island lowered), JAX's default matmul precision in the run
context as the advisor's baseline, and the plan verified by the JAX replay
engine on the run's own kept batches. (The TensorFlow-vs-JAX parity of the
plans is tests/test_advisor.py's, which trains this half in a subprocess.)"""

import os
import sys

import jax
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # advise_models

import advise_models

import mpprof
from mpprof.replay import files


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("advise_mlp_jax")
    return logdir, advise_models.fit_planted("mlp", logdir)


def test_the_jax_run_gets_the_plan_and_its_matmul_precision(mlp):
    _, advice = mlp
    assert advice["backend"] == "jax"
    assert advice["plan"]["lower"] == ["island"]
    matmuls = advice["baseline"]["float32_matmuls"]
    assert matmuls["framework"] == "jax"
    assert matmuls["jax_default_matmul_precision"] == jax.config.jax_default_matmul_precision
    assert matmuls["tf32_enabled"] is True  # the default: TF32 on A100/H100
    assert advice["baseline"]["float32_runs_as"] == "tf32"


def test_the_jax_engine_verifies_the_plan_on_the_kept_batches(mlp):
    logdir, _ = mlp
    kept = files.find_captures(logdir, "train", folder=files.ADVISE_FOLDER)
    assert [c.manifest["backend"] for c in kept] == ["jax", "jax"]
    verification = mpprof.advise(str(logdir), verify=True)["verification"]
    assert verification["state"] == "verified", verification["detail"]
    assert verification["batch_steps"] == [2, 6]
    assert verification["plan"]["trial"]["passed"]
    # Float8's rounding of the island's GEMM operands, read on JAX's float32 pass.
    rounding = verification["sensitivity"]["float8"]["island"]
    assert 0 < rounding["input"] < rounding["gradient"] < 0.2


def test_attention_is_sized_as_on_tensorflow(tmp_path):
    """The cross-attention look-alike (tests/test_advisor.py sizes it by hand
    on TensorFlow) in mixed_bfloat16 (JAX's CPU has no float16 attention,
    FACTS.md): the same products from JAX's traced shapes, nothing to change."""
    advice = advise_models.fit_planted("cross_attention", tmp_path, advise_batches=0,
                                       policy="mixed_bfloat16")
    facts = {f["name"]: f for f in advice["facts"]}
    assert [(g["batch"], g["m"], g["n"], g["k"]) for g in facts["cross"]["gemms"]] == [
        (16, 6, 10, 8), (16, 6, 8, 10)]  # batch 8 x 2 heads, 6 queries, 10 keys
    assert [(g["batch"], g["m"], g["n"], g["k"]) for g in facts["dot"]["gemms"]] == [
        (8, 6, 10, 16), (8, 6, 16, 10)]
    assert facts["cross"]["aligned"] is False
    assert advice["plan"]["nothing_to_change"]
