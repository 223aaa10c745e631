"""What "verified" means (mpprof.replay.verification), on TensorFlow: real CPU
training of models nobody here wrote, replayed; each fix verified is applied
and retrained, and shown to train like float32 within the stated band.

- keras-io's mnist_convnet (the model code as published), fed 16-bit images
  in raw units (0..65535, the `/ 65535` forgotten): the first op is the cast
  of the input, the lead fix is to bound the inputs (verified, and trains
  like float32 when applied), and the float32 map the search finds is "not
  verified" by the trial (the loss stays flat).
- The demo's Attention overflow (examples/attention_overflow.py): inputs in
  range, so the float32 map leads and is verified (the healthy look-alike).
- A map that stops the overflow but fails a tolerance: a float16 layer that
  differences inputs of ~1000 (float16's spacing there is 0.5).
"""

import os
import sys

import keras
import numpy as np
import pytest

import mpprof
from mpprof.replay import replay, text, verification

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "models"))

from raw_mnist_convnet import mnist_convnet, raw_mnist_data  # noqa: E402


def _epoch_losses(model, x, y, epochs: int, batch_size: int) -> list[float]:
    keras.utils.set_random_seed(1)
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0,
                        shuffle=False)
    return history.history["loss"]


def _trains_like_float32(fixed: list[float], float32: list[float]) -> verification.Trial:
    """The fixed run's per-epoch losses judged against float32's by the
    trial's own band (`verification.judge_trial`)."""
    return verification.judge_trial(fixed, float32)


# --- keras-io mnist_convnet, raw 16-bit inputs ---------------------------------

@pytest.fixture(scope="module")
def raw_mnist(tmp_path_factory):
    logdir = str(tmp_path_factory.mktemp("raw_mnist"))
    keras.utils.set_random_seed(0)
    x, y = raw_mnist_data()
    model = mnist_convnet("mixed_float16")
    model.fit(x, y, batch_size=32, epochs=1, verbose=0,
              callbacks=[mpprof.MixedPrecisionProfiler(logdir, numerics_every=1)])
    return replay(logdir), x, y


def test_raw_inputs_lead_to_bounding_them_verified_and_the_float32_map_not(raw_mnist):
    result, x, _ = raw_mnist
    first = result["first_op"]
    assert (first["op"], first["layer"], first["phase"]) == ("Cast", "conv2d", "forward")
    assert first["input_abs_max"][0] > 65504
    assert result["lead_fix"] == "bound_inputs"
    lead, alternative = result["fixes"]
    assert lead["kind"] == "bound_inputs" and alternative["kind"] == "float32_layers"
    (observed,) = lead["inputs"]
    # The captured batch's range (one batch of the raw images).
    assert 0 <= observed["min"] < 100 and 65504 < observed["max"] <= 65535
    assert observed["abs_max"] > 65504 and observed["integer_valued"] is True
    assert lead["scale"] == pytest.approx(1 / 65535) and lead["scale_text"] == "1 / 65535"
    assert 'keras.layers.Rescaling(1 / 65535, dtype="float32")' in lead["code"][0]
    assert "tf.cast(x, tf.float32) * (1 / 65535)" in lead["code"][1]
    # The lead fix: within the tolerances on the step, and it trains.
    assert lead["verified"] is True, lead["verified_detail"]
    check = lead["verification"]["step"][0]
    tolerances = verification.TOLERANCES["float16"]
    assert check["output_rel_error"] <= tolerances["output"]
    assert check["gradient_rel_error"] <= tolerances["gradient"]
    assert lead["verification"]["trial"]["progress"] >= verification.TRIAL_MIN_PROGRESS
    assert result["verified"] is True and result["verified_detail"] == lead["verified_detail"]
    # The map the search finds (as in the issue: the first conv in float32)
    # stops the overflow; the float16 layers after it still hold raw-unit
    # magnitudes (max pooling, the dropout: ~3e4, under 2x below 65504), and
    # the model stops learning: not verified, by the headroom on the step
    # and by the trial, each with its numbers.
    assert alternative["float32_layers"] == ["conv2d"]
    assert alternative["verified"] is False
    check = alternative["verification"]["step"][0]
    assert check["overflow"] is None and check["failed"] == "headroom"
    room = check["headroom"]
    assert room["dtype"] == "float16" and room["factor"] < verification.HEADROOM_FACTOR
    assert room["layer"] in ("max_pooling2d", "conv2d_1", "max_pooling2d_1", "flatten",
                             "dropout")
    detail = alternative["verified_detail"]
    assert detail.startswith(f"not verified: the output of layer {room['layer']} reaches")
    assert f"only {room['factor']:.3g}x under its max 65504 (at least 16x" in detail
    trial = alternative["verification"]["trial"]
    assert trial["passed"] is False
    assert "in a 30-step trial the loss" in detail
    # Flat while float32's falls (or, later in the trial, non-finite).
    if trial["progress"] is not None:
        assert trial["progress"] < verification.TRIAL_MIN_PROGRESS
        assert f"{trial['progress']:.0%} of float32's decrease" in detail
    # The lead fix leaves every float16 layer far from the max.
    assert lead["verification"]["step"][0]["headroom"]["factor"] > 1000
    # What the CLI and the report print: the lead first, the map as the
    # alternative with its own verdict, and what "verified" was judged by.
    lines = "\n".join(text.result_lines(result))
    assert "fix: the first op to overflow is the cast of a model input to float16" in lines
    assert "alternative: keep these layers in float32" in lines
    assert "not verified: the output of layer" in lines
    assert "verified means: relative error to float32 at most 0.01 for the loss" in lines
    assert text.headline(result).endswith("bound the inputs (times 1 / 65535) (verified)")


def test_the_bounded_inputs_applied_train_like_float32_and_the_map_does_not(raw_mnist):
    """Each fix applied and retrained (a short fit on the raw data): bounding
    the inputs trains like float32 within the band; the float32 map, which
    the replay said was not verified, does not train."""
    _, x, y = raw_mnist
    epochs = 8
    bounded = _epoch_losses(mnist_convnet("mixed_float16", rescale=True), x, y, epochs, 32)
    bounded32 = _epoch_losses(mnist_convnet("float32", rescale=True), x, y, epochs, 32)
    judged = _trains_like_float32(bounded, bounded32)
    assert judged.passed, judged.reason
    mapped = _epoch_losses(mnist_convnet("mixed_float16", float32_layers=("conv2d",)), x, y,
                           epochs, 32)
    raw32 = _epoch_losses(mnist_convnet("float32"), x, y, epochs, 32)
    judged = _trains_like_float32(mapped, raw32)
    assert not judged.passed and judged.progress < verification.TRIAL_MIN_PROGRESS, (
        mapped, raw32)


# --- the demo's Attention overflow: the float32 map, verified ----------------------

@pytest.fixture(scope="module")
def attention(tmp_path_factory):
    sys.path.insert(0, EXAMPLES)
    try:
        import attention_overflow
    finally:
        sys.path.remove(EXAMPLES)
    logdir = str(tmp_path_factory.mktemp("attention"))
    keras.utils.set_random_seed(0)
    x, y = attention_overflow.make_data()
    model = attention_overflow.build_model(fix=False)
    model.fit(x, y, batch_size=attention_overflow.BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[mpprof.MixedPrecisionProfiler(logdir, numerics_every=16)])
    return replay(logdir), attention_overflow, x, y


def test_the_attention_overflow_s_float32_map_is_verified(attention):
    result = attention[0]
    assert result["first_op"]["layer"] == "attention"
    # Its inputs are in float16's range (the raw-unit sensor reads ~400):
    # no bounding fix; the map leads.
    assert result["lead_fix"] == "float32_layers"
    assert [f["kind"] for f in result["fixes"]] == ["float32_layers"]
    assert result["policy_map"] == {"attention": "float32"}
    assert result["verified"] is True, result["verified_detail"]
    check = result["verification"]["step"][0]
    assert check["failed"] is None and check["overflow"] is None
    assert check["output_rel_error"] <= verification.TOLERANCES["float16"]["output"]
    trial = result["trial"]
    assert trial["passed"] and trial["progress"] >= verification.TRIAL_MIN_PROGRESS
    assert trial["mean_rel_diff"] <= verification.TRIAL_MEAN_BAND


def test_the_attention_fix_applied_trains_like_float32(attention):
    _, example, x, y = attention
    # The batches in range: the fixed model against float32 on the same data.
    x, y = x[:8 * example.BATCH], y[:8 * example.BATCH]
    fixed = _epoch_losses(example.build_model(fix=True), x, y, 4, example.BATCH)
    # build_model sets mixed_float16 itself: the same model, every layer and
    # the model then set to float32 and compiled again (no loss scaling).
    float32 = example.build_model(fix=False)
    for layer in float32.layers:
        layer.dtype_policy = "float32"
    float32.dtype_policy = "float32"
    float32.compile(optimizer=keras.optimizers.Adam(1e-3),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert all(layer.compute_dtype == "float32" for layer in float32.layers)
    assert not isinstance(float32.optimizer, keras.optimizers.LossScaleOptimizer)
    judged = _trains_like_float32(fixed, _epoch_losses(float32, x, y, 4, example.BATCH))
    assert judged.passed, judged.reason


# --- a map that stops the overflow but fails a tolerance --------------------------

def cancelling_model(offset: float, policy: str = "mixed_float16",
                     blowup_dtype: str | None = None) -> keras.Model:
    """Two branches from inputs near `offset`: `blowup` (Dense, kernel 1e4)
    overflows float16 (8 * 1 * 1e4 > 65504 already at offset 1); `diff` takes
    differences of neighbouring inputs, ~0.1, which float16 cannot resolve at
    offset 1000 (its spacing there is 0.5; at 1, 0.001). Each feeds its own
    float32 head; the overflowing branch is frozen (its activations of 1e4 to
    1e8 would make any learning rate that moves the other branch diverge)."""
    keras.mixed_precision.set_dtype_policy(policy)
    inputs = keras.Input((8,))
    blowup = keras.layers.Dense(16, kernel_initializer=keras.initializers.Constant(1e4),
                                name="blowup", trainable=False, dtype=blowup_dtype)(inputs)
    # Column j: x[j] - x[j + 1].
    kernel = np.eye(8, 7, dtype="float32") - np.eye(8, 7, k=-1, dtype="float32")
    diff = keras.layers.Dense(7, use_bias=False, name="diff",
                              kernel_initializer=keras.initializers.Constant(kernel))(inputs)
    heads = [
        keras.layers.Dense(1, dtype="float32", name="head_blowup", trainable=False,
                           kernel_initializer=keras.initializers.Constant(1e-6 / offset))(
            blowup),
        keras.layers.Dense(1, dtype="float32", name="head_diff",
                           kernel_initializer=keras.initializers.Constant(0.1))(diff),
    ]
    model = keras.Model(inputs, keras.layers.Add(dtype="float32", name="sum")(heads))
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model


def _cancelling_data(offset: float):
    rng = np.random.default_rng(0)
    x = (offset + 0.1 * rng.standard_normal((32, 8))).astype("float32")
    return x, rng.standard_normal((32, 1)).astype("float32")


def _cancelling_run(logdir, offset: float):
    keras.utils.set_random_seed(0)
    x, y = _cancelling_data(offset)
    model = cancelling_model(offset)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False,
              callbacks=[mpprof.MixedPrecisionProfiler(str(logdir), numerics_every=1)])
    return replay(str(logdir))


def test_a_map_that_stops_the_overflow_but_loses_precision_is_not_verified(tmp_path):
    result = _cancelling_run(tmp_path, offset=1000.0)
    assert result["first_op"]["layer"] == "blowup"
    assert result["float32_layers"] == ["blowup"]  # finite with it: the old "verified"
    assert result["lead_fix"] == "float32_layers"  # inputs of ~1000 are in range
    assert result["verified"] is False
    check = result["verification"]["step"][0]
    assert check["overflow"] is None and check["failed"] == "output"
    assert check["worst_output"] == "diff"
    assert check["output_rel_error"] > 10 * verification.TOLERANCES["float16"]["output"]
    assert result["verified_detail"].startswith(
        f"not verified: the output of layer diff is {check['output_rel_error']:.3g} from "
        "float32's (relative L2; tolerance 0.01)")


def test_its_healthy_look_alike_is_verified(tmp_path):
    """The same model on inputs near 1 (float16's spacing 0.001 there):
    `blowup` still overflows, `diff` is resolved well enough, and the same
    map is verified."""
    result = _cancelling_run(tmp_path, offset=1.0)
    assert result["first_op"]["layer"] == "blowup"
    assert result["float32_layers"] == ["blowup"]
    assert result["verified"] is True, result["verified_detail"]
    # Applied and retrained: trains like float32 within the band.
    x, y = _cancelling_data(1.0)
    fixed = _epoch_losses(cancelling_model(1.0, blowup_dtype="float32"), x, y, 10, 8)
    float32 = _epoch_losses(cancelling_model(1.0, policy="float32"), x, y, 10, 8)
    judged = _trains_like_float32(fixed, float32)
    assert judged.passed, judged.reason
