"""mpprof on keras-io examples (code nobody here wrote), Keras 3 on PyTorch.

The twin of tests/keras_io/test_keras_io.py (TensorFlow) and
tests/jax/test_keras_io_jax.py (JAX): the MNIST convnet (healthy, its
published float16 softmax head, raw 16-bit inputs whose replayed fixes are
retrained from the start), the text Transformer, the bidirectional LSTM (each
as published and with a float32 head) and the Keras guide's PyTorch custom
`train_step` ("Customizing what happens in fit() with PyTorch",
guides/custom_train_step_in_torch.py), which never calls `scale_loss`. The
ViT with a top-5 metric trains on PyTorch (TensorFlow's fit raises: MP020);
the VAE stays TensorFlow's (its published `train_step` is `tf.GradientTape`
code).

All in mixed_float16: PyTorch's CPU runs float16 attention (JAX's does not),
and at these sizes its float16 kernels are fast enough (measured on 2 busy
cores: a float16 step of the MNIST convnet 0.06-0.35 s; the raw-units
replay, whose verification trains 30-step trials, and its fixes retrained
take 40-90 s, most of this module's time).
"""

from __future__ import annotations

import keras
import pytest
import torch
from keras_io_checks import BATCH, check_raw_units_fixes_retrain
from keras_io_checks import codes as _codes
from keras_io_checks import fit as _fit
from keras_io_checks import guide_runs as fit_guide_runs
from keras_io_checks import only as _only
from keras_io_checks import policy as _policy
from keras_io_examples import (
    bidirectional_lstm,
    imdb_data,
    mnist_convnet,
    mnist_data,
    text_data,
    text_transformer,
    vit_classifier,
    vit_data,
)

# ---------------------------------------------------------------------------
# examples/vision/mnist_convnet.py


@pytest.fixture(scope="module")
def mnist_runs(tmp_path_factory):
    runs = {}
    for name, head, raw in (("published", None, False), ("healthy", "float32", False),
                            ("raw_units", "float32", True)):
        _policy("mixed_float16")
        x, y = mnist_data(BATCH * 2, raw_units=raw)
        runs[name] = _fit(tmp_path_factory.mktemp(f"mnist_{name}"), mnist_convnet(head), x, y)
    keras.mixed_precision.set_dtype_policy("float32")
    return runs


def test_mnist_healthy_has_only_the_cpu_finding_on_torch(mnist_runs):
    run = mnist_runs["healthy"]
    assert _codes(run) == {"MP011"}
    assert list(run.numerics.steps) == [1]  # sampled at the defaults
    assert _codes(run, assume_gpu=True) == {"MP011"}  # no MP007: 1 channel, 10 classes


def test_mnist_published_float16_head_is_mp006_on_torch(mnist_runs):
    run = mnist_runs["published"]
    assert _codes(run) == {"MP006", "MP011"}
    finding = _only(run, "MP006")
    assert finding.layer == "dense"
    assert finding.evidence["loss_input_dtypes"] == ["float16"]


def test_mnist_raw_units_names_the_first_conv_only_on_torch(mnist_runs):
    run = mnist_runs["raw_units"]
    codes = _codes(run)
    assert "MP003" in codes and "MP004" not in codes
    assert codes <= {"MP003", "MP002", "MP011", "MP019", "MP013"}
    mp003 = _only(run, "MP003")
    assert mp003.layer == "conv2d"
    assert mp003.step == 1


def test_mnist_raw_units_fixes_on_torch_retrain_as_their_verdicts_say(mnist_runs):
    """The replay on PyTorch (the step run eagerly under a dispatch mode):
    the lead fix (bounding the inputs) verified and retraining like float32,
    the float32 conv2d map not verified and not retraining like float32
    (`check_raw_units_fixes_retrain`)."""
    assert check_raw_units_fixes_retrain(mnist_runs["raw_units"])["backend"] == "torch"


# ---------------------------------------------------------------------------
# examples/nlp/text_classification_with_transformer.py and
# examples/nlp/bidirectional_lstm_imdb.py


@pytest.fixture(scope="module")
def text_runs(tmp_path_factory):
    runs = {}
    for name, build, data in (("transformer", text_transformer, text_data),
                              ("bilstm", bidirectional_lstm, imdb_data)):
        for head in (None, "float32"):
            _policy("mixed_float16")
            x, y = data(BATCH * 2)
            key = f"{name}_{'healthy' if head else 'published'}"
            runs[key] = _fit(tmp_path_factory.mktemp(key), build(head), x, y)
    keras.mixed_precision.set_dtype_policy("float32")
    return runs


@pytest.mark.parametrize("name", ["transformer", "bilstm"])
def test_text_models_on_torch(text_runs, name):
    """The published softmax (Transformer) and sigmoid (BiLSTM) heads output
    float16: MP006 on the head; with a float32 head only the CPU finding.
    Projected on a GPU nothing more: a binary head is the task's, the
    Transformer's Dense(20) a small share, the LSTMs' 8 units a multiple of 8."""
    published, healthy = text_runs[f"{name}_published"], text_runs[f"{name}_healthy"]
    assert _codes(healthy) == {"MP011"}
    assert _codes(published) == {"MP006", "MP011"}
    finding = _only(published, "MP006")
    assert finding.evidence["loss_input_dtypes"] == ["float16"]
    # The head: the Transformer's fourth Dense (its FFN holds dense and
    # dense_1, then the Dense(20)); the BiLSTM's only one.
    assert finding.layer == ("dense_3" if name == "transformer" else "dense")
    for run in (published, healthy):
        assert "MP007" not in _codes(run, assume_gpu=True)


# ---------------------------------------------------------------------------
# examples/vision/image_classification_with_vision_transformer.py, compiled
# as published with its top-5 accuracy metric


@pytest.fixture(scope="module")
def vit_runs(tmp_path_factory):
    runs = {}
    for name, head in (("published", None), ("healthy", "float32")):
        _policy("mixed_float16")
        x, y = vit_data(BATCH * 2)
        runs[name] = _fit(tmp_path_factory.mktemp(f"vit_{name}"), vit_classifier(True, head),
                          x, y)
    keras.mixed_precision.set_dtype_policy("float32")
    return runs


def test_vit_top5_metric_trains_on_torch_and_its_float16_logits_are_mp006(vit_runs):
    """Right for PyTorch, not TensorFlow's MP020: TensorFlow has no float16
    kernel for the top-5 metric's InTopKV2, so its fit raises at step 0;
    PyTorch's `topk` takes float16, the fit trains, and what remains is the
    float16 logits reaching the loss (MP006 on the last Dense)."""
    published = vit_runs["published"]
    assert _codes(published) == {"MP006", "MP011"}
    assert _only(published, "MP006").evidence["loss_input_dtypes"] == ["float16"]
    assert "MP020" not in _codes(published)
    assert _codes(vit_runs["healthy"]) == {"MP011"}


# ---------------------------------------------------------------------------
# guides/custom_train_step_in_torch.py: the guide's first CustomModel, as
# published (gradients of `compute_loss`'s loss by `loss.backward()`, applied
# by `self.optimizer.apply` under `torch.no_grad()`; no `scale_loss`).
# `scale=True` is MP018's fix: `self.optimizer.scale_loss(loss).backward()`.


class CustomModel(keras.Model):
    scale = False

    def train_step(self, data):
        # Unpack the data. Its structure depends on your model and
        # on what you pass to `fit()`.
        x, y = data

        # Call torch.nn.Module.zero_grad() to clear the leftover gradients
        # for the weights from the previous train step.
        self.zero_grad()

        # Compute loss
        y_pred = self(x, training=True)  # Forward pass
        loss = self.compute_loss(y=y, y_pred=y_pred)

        # Call torch.Tensor.backward() on the loss to compute gradients
        # for the weights.
        if self.scale:
            self.optimizer.scale_loss(loss).backward()
        else:
            loss.backward()

        trainable_weights = [v for v in self.trainable_weights]
        gradients = [v.value.grad for v in trainable_weights]

        # Update weights
        with torch.no_grad():
            self.optimizer.apply(gradients, trainable_weights)

        # Update metrics (includes the metric that tracks the loss)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)

        # Return a dict mapping metric names to current value
        # Note that it will include the loss (tracked in self.metrics).
        return {m.name: m.result() for m in self.metrics}


@pytest.fixture(scope="module")
def guide_runs(tmp_path_factory):
    return fit_guide_runs(CustomModel, tmp_path_factory.mktemp)


def test_guide_without_scale_loss_is_mp018_on_torch(guide_runs):
    run = guide_runs["published"]
    assert _codes(run) == {"MP018", "MP006", "MP011"}
    finding = _only(run, "MP018")
    assert finding.evidence["update_effect"] == "adaptive"  # Adam
    assert [o["scale_loss_called"] for o in finding.evidence["optimizers"]] == [False]
    # What the loss received, seen through compute_loss.
    assert _only(run, "MP006").evidence["loss_input_dtypes"] == ["float16"]


def test_guide_with_scale_loss_is_healthy_on_torch(guide_runs):
    assert _codes(guide_runs["healthy"]) == {"MP011"}
