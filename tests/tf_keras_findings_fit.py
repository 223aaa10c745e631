"""Fits two tf-keras models and prints their findings as one JSON line.

Run with TF_USE_LEGACY_KERAS=1 (tests/test_diagnosis_tf_keras.py does):
"logits" ends in a linear Dense(8) into "sparse_categorical_crossentropy"
(MP014), "softmax" ends in Activation("softmax", dtype="float32") (none).
"""

import json
import os
import sys
import tempfile

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import numpy as np
import tf_keras

import mpprof
from mpprof import diagnosis
from mpprof.records import reader


def findings(head) -> list[dict]:
    tf_keras.utils.set_random_seed(0)
    model = tf_keras.Sequential(
        [tf_keras.layers.Input((16,)), tf_keras.layers.Dense(16, activation="relu"), *head]
    )
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    x, y = rng.random((32, 16), dtype=np.float32), rng.integers(0, 8, 32)
    log_dir = tempfile.mkdtemp(dir=sys.argv[1])
    profiler = mpprof.MixedPrecisionProfiler(log_dir, numerics_every=2, gpu_interval=None)
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[profiler])
    return [f.to_dict() for f in diagnosis.diagnose(reader.read_run(log_dir, "train"))]


tf_keras.mixed_precision.set_global_policy("mixed_float16")
print(json.dumps({
    "logits": findings([tf_keras.layers.Dense(8, name="scores")]),
    "softmax": findings([
        tf_keras.layers.Dense(8),
        tf_keras.layers.Activation("softmax", dtype="float32", name="probs"),
    ]),
}))
