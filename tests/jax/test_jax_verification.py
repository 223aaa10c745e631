"""What "verified" means, on JAX: keras-io's mnist_convnet (the model code as
published) fed 16-bit images in raw units, replayed through its jaxpr.
Bounding the inputs leads, is verified, and applied and retrained trains like
float32 within the band. The float32 map the search finds stops the overflow
and is not verified: on JAX float32 itself does not learn from the raw
inputs (Keras' crossentropy of a saturated softmax clips the probabilities:
no gradient), so the trial cannot show that the map trains."""

from __future__ import annotations

import jax_runs
import keras
import pytest
from raw_mnist_convnet import mnist_convnet, raw_mnist_data

import mpprof.replay
from mpprof.replay import verification


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("raw_mnist_jax")
    keras.utils.set_random_seed(0)
    x, y = raw_mnist_data(32)
    jax_runs.fit(logdir, mnist_convnet("mixed_float16"), x, y, batch_size=16,
                 numerics_every=1)
    return mpprof.replay.replay(str(logdir), save=False), x, y


def test_raw_inputs_lead_to_bounding_them_verified_on_jax(raw):
    result, _, _ = raw
    first = result["first_op"]
    assert (first["op"], first["layer"]) == ("convert_element_type", "conv2d")
    assert result["lead_fix"] == "bound_inputs"
    lead, alternative = result["fixes"]
    assert lead["verified"] is True, lead["verified_detail"]
    assert 'keras.layers.Rescaling(1 / 65535, dtype="float32")' in lead["code"][0]
    assert 'x = x.astype("float32") * (1 / 65535)' in lead["code"][1]  # NumPy, not tf
    assert lead["verification"]["step"][0]["failed"] is None
    assert alternative["kind"] == "float32_layers" and "conv2d" in alternative["float32_layers"]
    # Not verified, by the trial (float32 itself does not learn from the raw
    # inputs, or the map's loss stays flat or goes non-finite), with numbers.
    assert alternative["verified"] is False
    trial = alternative["verification"]["trial"]
    assert trial is not None and trial["passed"] is False, alternative["verified_detail"]
    assert trial["reason"] in alternative["verified_detail"]


def test_the_bounded_inputs_applied_train_like_float32_on_jax(raw):
    _, x, y = raw
    losses = {}
    for policy in ("mixed_float16", "float32"):
        keras.utils.set_random_seed(1)
        history = mnist_convnet(policy, rescale=True).fit(
            x, y, batch_size=16, epochs=8, verbose=0, shuffle=False)
        losses[policy] = history.history["loss"]
    judged = verification.judge_trial(losses["mixed_float16"], losses["float32"])
    assert judged.passed, judged.reason
