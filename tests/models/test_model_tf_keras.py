"""tf-keras (Keras 2) families of the real-model suite: a GRU with a
Bidirectional LSTM (with `steps_per_execution=2`, so the whole step runs in a
`tf.while_loop`), and a Conv2D with BatchNormalization.

The fits run in a subprocess (tests/models/tf_keras_models.py) with
TF_USE_LEGACY_KERAS=1, which also reports each model's own view of its
layers; the records are read and diagnosed here.
"""

import json
import os
import subprocess
import sys

import pytest
from model_suite import diagnose_json
from tf_keras_env import require_tf_keras

from mpprof.records import reader, schema

SCRIPT = os.path.join(os.path.dirname(__file__), "tf_keras_models.py")


@pytest.fixture(scope="module")
def tf_keras_fits(tmp_path_factory):
    require_tf_keras()
    logdir = tmp_path_factory.mktemp("tf_keras_models")
    result = subprocess.run([sys.executable, SCRIPT, str(logdir)], capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return logdir, json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family", ["recurrent", "conv_batch_norm"])
def test_tf_keras_family(tf_keras_fits, capsys, family):
    logdir, models = tf_keras_fits
    model = models[family]
    run = reader.read_run(logdir / family, schema.TRAIN_RUN)
    inventory = run.inventory
    recorded = sorted(
        [r["name"].rsplit("/", 1)[-1], r["class"], r["policy"], r["compute_dtype"],
         r["variable_dtype"]]
        for r in inventory["layers"]
    )
    assert recorded == model["layers"]
    assert inventory["model"]["policy"] == model["model_policy"]
    numerics = run.numerics
    assert numerics is not None and len(numerics.steps) >= 1
    assert sorted(name.rsplit("/", 1)[-1] for name in numerics.layers) == model["measured"]
    assert numerics.variables == model["variables"]
    assert (numerics.forward["count"] > 0).all()
    assert (numerics.variable_grads["count"] > 0).all()
    diagnose_json(logdir / family, capsys)
