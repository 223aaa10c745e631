"""What the callback learns from a fit's other callbacks, under tf-keras too
(its CallbackList and TensorBoard classes are not Keras 3's)."""

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
    from mpprof import reader

    logdir = sys.argv[1]
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
    print(json.dumps({"kernels": kernels, "second_profiler": second}))
""")


def test_tf_keras_siblings_are_seen(tmp_path):
    require_tf_keras()
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
        timeout=300, env={**os.environ, "TF_USE_LEGACY_KERAS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    # tf-keras's TensorBoard owns the profiler: mpprof reads its trace.
    assert found["kernels"]["state"] in ("reusing", "done", "no_gpu_kernels"), found
    assert "TensorBoard(profile_batch" in found["kernels"]["reason"]
    assert "Two mpprof.MixedPrecisionProfiler callbacks" in found["second_profiler"]

