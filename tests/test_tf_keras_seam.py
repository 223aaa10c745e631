"""What the callback learns from a fit's other callbacks, under tf-keras too
(its CallbackList and TensorBoard classes are not Keras 3's)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from tf_keras_env import require_tf_keras

# One tf-keras process for the module's two scenarios (a tf-keras start costs
# seconds): each writes into its own folder of the logdir and fills its key of
# the one JSON line printed.
SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import numpy as np
    import tf_keras
    import mpprof
    from mpprof.records import reader

    found = {}


    def siblings(logdir):
        tf_keras.mixed_precision.set_global_policy("mixed_float16")
        model = tf_keras.Sequential([
            tf_keras.layers.Dense(8, input_shape=(4,)),
            tf_keras.layers.Dense(1, dtype="float32"),
        ])
        model.compile(optimizer="sgd", loss="mse")
        x, y = np.ones((64, 4), np.float32), np.ones((64, 1), np.float32)
        tensorboard = tf_keras.callbacks.TensorBoard(logdir, profile_batch=(2, 3))
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[
            tensorboard, mpprof.MixedPrecisionProfiler(logdir, profile_steps=(2, 3),
                                                       gpu_interval=None)])
        kernels = reader.read_run(logdir, "train").context["collectors"]["kernels"]
        try:
            model.fit(x, y, batch_size=8, verbose=0, callbacks=[
                mpprof.MixedPrecisionProfiler(os.path.join(logdir, "a")),
                mpprof.MixedPrecisionProfiler(os.path.join(logdir, "b"))])
            second = "accepted"
        except ValueError as e:
            second = str(e)
        return {"kernels": kernels, "second_profiler": second}


    def dropout(logdir):
        tf_keras.mixed_precision.set_global_policy("mixed_float16")
        rng = np.random.default_rng(0)
        x, y = rng.random((64, 16), np.float32), rng.random((64, 1), np.float32)

        def fit(callbacks):
            tf_keras.utils.set_random_seed(0)
            model = tf_keras.Sequential([
                tf_keras.layers.Dense(32, activation="relu", input_shape=(16,)),
                tf_keras.layers.Dropout(0.5),
                tf_keras.layers.Dense(1, dtype="float32"),
            ])
            model.compile(optimizer="sgd", loss="mse")
            model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                      callbacks=callbacks)
            return model.get_weights()

        def profiled(run):
            return [mpprof.MixedPrecisionProfiler(os.path.join(logdir, run), numerics_every=2,
                                                  gpu_interval=None)]

        def numerics(run):
            recorded = reader.read_run(os.path.join(logdir, run), "train")
            numerics = recorded.numerics
            return {"state": recorded.context["collectors"]["numerics"]["state"],
                    "samples": 0 if numerics is None else len(numerics.steps)}

        plain = fit([])
        legacy = fit(profiled("legacy"))
        tf_keras.backend.experimental.enable_tf_random_generator()
        generator_plain = fit([])
        generator = fit(profiled("generator"))
        return {
            "legacy_equal": all(np.array_equal(a, b) for a, b in zip(plain, legacy)),
            "generator_equal": all(np.array_equal(a, b)
                                   for a, b in zip(generator_plain, generator)),
            "legacy": numerics("legacy"), "generator": numerics("generator"),
        }


    # The dropout scenario last: it turns on tf-keras' random generator for
    # the rest of the process.
    for name, scenario in (("siblings", siblings), ("dropout", dropout)):
        found[name] = scenario(os.path.join(sys.argv[1], name))
    print(json.dumps(found))
""")


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory) -> dict:
    require_tf_keras()
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path_factory.mktemp("tf_keras_seam"))],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "TF_USE_LEGACY_KERAS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_tf_keras_siblings_are_seen(scenarios):
    found = scenarios["siblings"]
    # tf-keras's TensorBoard owns the profiler: mpprof reads its trace.
    assert found["kernels"]["state"] in ("reusing", "done", "no_gpu_kernels"), found
    assert "TensorBoard(profile_batch" in found["kernels"]["reason"]
    assert "Two mpprof.MixedPrecisionProfiler callbacks" in found["second_profiler"]


def test_tf_keras_dropout_keeps_a_seeded_run_unchanged(scenarios):
    """tf-keras' Dropout keeps its random state in each traced function
    unless `enable_tf_random_generator()`: then numerics samples stay off."""
    found = scenarios["dropout"]
    assert found["legacy_equal"] and found["legacy"] == {"state": "off", "samples": 0}, found
    # With its state in a variable, both functions share it: sampled, unchanged.
    assert found["generator_equal"], found
    assert found["generator"]["state"] == "ok" and found["generator"]["samples"] >= 4, found
