"""Float8 under MirroredStrategy on two logical CPUs; prints one JSON line.

Two fits of the tiny float8 model: one whose first replica's shard of every
batch is 10x larger ("apart"), one whose two shards are the same ("alike").
Run as a script (logical devices must be set before TensorFlow starts):
    python tests/float8_mirrored_fit.py LOGDIR
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf
from logical_cpus import split_cpu_in_two

split_cpu_in_two()

import numpy as np  # noqa: E402
from float8_runs import BATCH, fit_float8, float8_data, float8_model  # noqa: E402

from mpprof import diagnosis  # noqa: E402
from mpprof.records import reader  # noqa: E402


def shards(apart: bool):
    """The float8 data, each batch's two halves (one per replica) made 10x
    apart or equal."""
    x, y = float8_data()
    halves_x, halves_y = x.reshape(-1, 2, BATCH // 2, 8), y.reshape(-1, 2, BATCH // 2, 1)
    if apart:
        halves_x[:, 0] *= 10.0
    else:
        halves_x[:, 1], halves_y[:, 1] = halves_x[:, 0], halves_y[:, 0]
    return halves_x.reshape(x.shape), halves_y.reshape(y.shape)


def main(logdir: str) -> None:
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    found = {}
    for name in ("apart", "alike"):
        x, y = shards(apart=name == "apart")
        with strategy.scope():
            model = float8_model()
            fit_float8(os.path.join(logdir, name), model, x, y, numerics_every=2)
        hidden = model.get_layer("hidden")
        run = reader.read_run(os.path.join(logdir, name), "train")
        float8 = run.float8
        found[name] = {
            "context": run.context["collectors"]["float8"],
            "numerics": run.context["collectors"]["numerics"]["state"],
            "precision": run.context["collectors"]["precision"],
            "numerics_counts": {
                name: run.numerics.forward["count"][:, run.numerics.layers.index(name)].tolist()
                for name in ("hidden", "head")
            },
            "shares": run.context["collectors"]["float8_shares"],
            "replicas": float8.replicas,
            "amax_across_replicas": float8.amax_across_replicas,
            "replica_amax_max": [
                float8.replica_spread["amax_max_min"][-1, 0, 0],
                float8.replica_spread["amax_max_max"][-1, 0, 0],
            ],
            # Keras' own per-replica histories, read past mpprof.
            "keras_replica_amax_max": [
                float(np.max(v.numpy())) for v in hidden.inputs_amax_history.value.values
            ],
            "sampled_saturated": np.nan_to_num(float8.shares["saturated"]).tolist(),
            "mp017": [
                {"layer": f.layer, "evidence": f.evidence}
                for f in diagnosis.diagnose(run) if f.code == "MP017"
            ],
        }
    print(json.dumps(found))


if __name__ == "__main__":
    main(sys.argv[1])
