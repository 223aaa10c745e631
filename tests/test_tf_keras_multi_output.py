"""tf-keras multi-output models train to the same bits with numerics samples.

"The profiler never changes training": every step of these fits is sampled
(`numerics_every=1`, the layer taps and their identity gradients in the
traced step), and the weights must equal those of the same fit without
mpprof, bit for bit. The shapes are those where a tap could change how
gradients are summed: a trunk feeding three heads, outputs that feed other
outputs (an Add and a Concatenate of them), float16 heads, a layer that
returns the same tensor twice, and an LSTM whose output and states are all
outputs. tf-keras runs in its own process (TF_USE_LEGACY_KERAS=1).
"""

import json
import os
import subprocess
import sys
import textwrap

from tf_keras_env import require_tf_keras

SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import numpy as np
    import tf_keras
    import mpprof
    from mpprof.records import reader

    layers = tf_keras.layers
    logdir = sys.argv[1]

    class Twice(layers.Layer):
        def call(self, x):
            y = x * 2.0
            return [y, y]

    def build(shape):
        tf_keras.utils.set_random_seed(0)
        tf_keras.mixed_precision.set_global_policy("mixed_float16")
        if shape == "lstm":
            inputs = tf_keras.Input((5, 8))
            o, h, c = layers.LSTM(8, return_state=True)(inputs)
            heads = [layers.Dense(1, dtype="float32")(t) for t in (o, h, c)]
        else:
            inputs = tf_keras.Input((8,))
            trunk = layers.Dense(16, activation="relu")(inputs)
            if shape == "trunk":  # three float16 heads on one trunk
                heads = [layers.Dense(1)(trunk) for _ in range(3)]
            elif shape == "chain":  # outputs feeding other outputs
                a = layers.Dense(8)(trunk)
                b = layers.Dense(8)(layers.Add()([a, trunk[:, :8]]))
                c = layers.Dense(1, dtype="float32")(layers.Concatenate()([a, b, trunk]))
                heads = [layers.Activation("linear", dtype="float32")(t) for t in (a, b)] + [c]
            else:  # "twice": one layer's two outputs are one tensor
                p, q = Twice()(trunk)
                heads = [layers.Dense(1, dtype="float32")(t) for t in (p, p, q)]
        model = tf_keras.Model(inputs, heads)
        model.compile(optimizer=tf_keras.mixed_precision.LossScaleOptimizer(
                          tf_keras.optimizers.Adam(1e-3)),
                      loss=["mse", "mae", "mse"], loss_weights=[1.0, 0.5, 0.25])
        return model

    found = {}
    for shape in ("trunk", "chain", "twice", "lstm"):
        rng = np.random.default_rng(0)
        x = rng.random((48, 5, 8) if shape == "lstm" else (48, 8), dtype=np.float32)
        weights = []
        for profiled in (False, True):
            model = build(shape)
            ys = [rng.random((48,) + tuple(o.shape[1:]), dtype=np.float32)
                  for o in model.outputs] if not weights else ys
            callbacks = [mpprof.MixedPrecisionProfiler(
                os.path.join(logdir, shape), numerics_every=1, gpu_interval=None)
            ] if profiled else []
            model.fit(x, ys, batch_size=8, epochs=2, shuffle=False, verbose=0,
                      callbacks=callbacks)
            weights.append(model.get_weights())
        run = reader.read_run(os.path.join(logdir, shape), "train")
        found[shape] = {
            "max_difference": max(float(np.max(np.abs(a.astype("f8") - b)))
                                  for a, b in zip(*weights)),
            "equal": all(np.array_equal(a, b) for a, b in zip(*weights)),
            "samples": 0 if run.numerics is None else len(run.numerics.steps),
        }
    print(json.dumps(found))
""")


def test_tf_keras_multi_output_models_train_to_the_same_bits_when_sampled(tmp_path):
    require_tf_keras()
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
        timeout=600, env={**os.environ, "TF_USE_LEGACY_KERAS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    for shape, outcome in found.items():
        assert outcome["samples"] >= 10, (shape, outcome)  # every step sampled
        assert outcome["equal"], (shape, outcome)
