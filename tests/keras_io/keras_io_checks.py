"""What the keras-io suites of every backend share (tests/keras_io/test_keras_io.py,
tests/jax/test_keras_io_jax.py, tests/torch/test_keras_io_torch.py): a fit at
mpprof's defaults, the findings' codes, the one finding of a code, a fresh
global policy, the raw-units MNIST replay's verdicts checked by retraining
each fix from the start, and the custom-`train_step` guide's runs.
"""

from __future__ import annotations

import os

import keras
import numpy as np
from keras_io_examples import mnist_data, mnist_retrained_losses

import mpprof
from mpprof import diagnosis
from mpprof.reader import read_logdir
from mpprof.replay import replay, verification

BATCH = 32


def fit(log_dir, model, x, y, steps=2):
    """`model.fit` for `steps` steps with a profiler at its defaults; the run."""
    model.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=steps, verbose=0,
              callbacks=[mpprof.MixedPrecisionProfiler(log_dir=str(log_dir))])
    return read_logdir(str(log_dir))["train"]


def codes(run, **kwargs) -> set[str]:
    return {f.code for f in diagnosis.diagnose(run, **kwargs)}


def only(run, code, **kwargs):
    """The run's one finding of `code` (fails on none or several)."""
    found = [f for f in diagnosis.diagnose(run, **kwargs) if f.code == code]
    assert len(found) == 1, [f.title for f in found]
    return found[0]


def policy(name):
    """A fresh session (layer names from 1 again: conv2d, dense...), seeded,
    under the global policy `name`."""
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_dtype_policy(name)


def check_raw_units_fixes_retrain(run) -> dict:
    """The replay of the raw-units MNIST run (on the backend that trained it):
    bounding the inputs leads, verified, and retrained from the start it
    trains like float32 within the stated band; the float32 conv2d map
    leaves its float16 layers at raw-unit magnitudes, is not verified (the
    headroom), and retrained it does not train like float32. Returns the
    replay's result."""
    result = replay(os.path.dirname(run.path))
    fixes = {fix["kind"]: fix for fix in result["fixes"]}
    lead = fixes["bound_inputs"]
    assert result["lead_fix"] == "bound_inputs"
    assert lead["verified"] is True, lead["verified_detail"]
    assert lead["scale_text"] == "1 / 65535"
    alternative = fixes["float32_layers"]
    assert alternative["float32_layers"] == ["conv2d"] and alternative["verified"] is False
    check = alternative["verification"]["step"][0]
    assert check["overflow"] is None and check["failed"] == "headroom"
    assert check["headroom"]["factor"] < verification.HEADROOM_FACTOR
    x, y = mnist_data(BATCH * 2, raw_units=True)
    scale = lead["scale"]
    bounded = verification.judge_trial(
        mnist_retrained_losses("mixed_float16", scale, x, y, BATCH),
        mnist_retrained_losses("float32", scale, x, y, BATCH))
    assert bounded.passed, bounded.reason
    mapped = verification.judge_trial(
        mnist_retrained_losses("mixed_float16", 1.0, x, y, BATCH, first_conv_dtype="float32"),
        mnist_retrained_losses("float32", 1.0, x, y, BATCH))
    assert not mapped.passed, mapped.reason
    return result


def guide_runs(model_class, mktemp) -> dict:
    """The Keras guides' first custom-`train_step` model ("Customizing what
    happens in fit()", `model_class` the backend's: a functional
    `Dense(1)` on 32 inputs, compiled with Adam, mse and mae) fitted under
    mixed_float16: "published" as the guide has it (no `scale_loss`, its
    Dense(1) head in float16), "healthy" with MP018's fix (`model_class.scale`
    set: the step calls `scale_loss`) and MP006's (a float32 output). Runs by
    name; `mktemp(name)` gives each its logdir."""
    runs = {}
    rng = np.random.default_rng(0)
    x, y = rng.random((BATCH * 2, 32)), rng.random((BATCH * 2, 1))
    for name, scale in (("published", False), ("healthy", True)):
        policy("mixed_float16")
        inputs = keras.Input(shape=(32,))
        outputs = keras.layers.Dense(1)(inputs)
        if scale:  # a float32 Dense(1) would leave no float16 layer
            outputs = keras.layers.Activation("linear", dtype="float32")(outputs)
        model = model_class(inputs, outputs)
        model.scale = scale
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
        runs[name] = fit(mktemp(f"guide_{name}"), model, x, y)
    keras.mixed_precision.set_dtype_policy("float32")
    return runs
