"""Findings on real tf-keras (Keras 2) runs speak tf_keras (a subprocess:
tf-keras must be chosen before TensorFlow starts)."""

import json
import os
import subprocess
import sys

import pytest
from tf_keras_env import require_tf_keras

TESTS = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def tf_keras_findings(tmp_path_factory):
    require_tf_keras()
    result = subprocess.run(
        [sys.executable, os.path.join(TESTS, "tf_keras_findings_fit.py"),
         str(tmp_path_factory.mktemp("tf_keras_findings"))],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "TF_USE_LEGACY_KERAS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_mp014_and_its_fix_in_tf_keras(tf_keras_findings):
    found = {f["code"]: f for f in tf_keras_findings["logits"]}
    mp014 = found["MP014"]
    assert mp014["layer"] == "scores" and mp014["evidence"]["final_op"] == "BiasAdd"
    assert "tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)" in mp014["fix"]
    assert 'tf_keras.layers.Activation("softmax", dtype="float32")' in mp014["fix"]
    assert 'tf_keras.mixed_precision.set_global_policy("mixed_bfloat16")' in found["MP011"]["fix"]
    for finding in tf_keras_findings["logits"]:
        assert "keras.mixed_precision.set_dtype_policy" not in finding["fix"]


def test_a_float32_softmax_head_is_no_finding_in_tf_keras(tf_keras_findings):
    assert {f["code"] for f in tf_keras_findings["softmax"]} == {"MP011"}
