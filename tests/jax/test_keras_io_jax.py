"""mpprof on keras-io examples (code nobody here wrote), Keras 3 on JAX.

The twin of tests/keras_io/test_keras_io.py: the MNIST convnet (healthy, raw
16-bit inputs, whose replayed fixes are retrained from the start), the
bidirectional LSTM (its published float16 head, and a float32 one), the text
Transformer and the Keras guide's JAX custom `train_step` ("Customizing what
happens in fit() with JAX", guides/custom_train_step_in_jax.py), which never
calls `scale_loss`. JAX's CPU has no float16 attention (docs/FACTS): the
Transformer trains under mixed_bfloat16 here (a GPU runs float16).
"""

from __future__ import annotations

import os
import sys

import jax
import keras
import numpy as np
import pytest

from mpprof.reader import read_logdir

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "keras_io"))
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
)


@pytest.fixture(scope="module")
def mnist_runs(tmp_path_factory):
    runs = {}
    for name, head, raw in (("healthy", "float32", False), ("raw_units", "float32", True)):
        _policy("mixed_float16")
        x, y = mnist_data(BATCH * 2, raw_units=raw)
        runs[name] = _fit(tmp_path_factory.mktemp(f"mnist_{name}"), mnist_convnet(head), x, y)
    keras.mixed_precision.set_dtype_policy("float32")
    return runs


def test_mnist_on_jax(mnist_runs):
    assert _codes(mnist_runs["healthy"]) == {"MP011"}
    assert list(mnist_runs["healthy"].numerics.steps) == [1]  # sampled at the defaults
    assert "MP007" not in _codes(mnist_runs["healthy"], assume_gpu=True)
    raw = mnist_runs["raw_units"]
    codes = _codes(raw)
    assert "MP003" in codes and "MP004" not in codes
    assert codes <= {"MP003", "MP002", "MP011", "MP019", "MP013"}
    assert _only(raw, "MP003").layer == "conv2d"


def test_mnist_raw_units_fixes_on_jax_retrain_as_their_verdicts_say(mnist_runs):
    """The replay on JAX (the step's jaxpr): the lead fix (bounding the
    inputs) verified and retraining like float32, the float32 conv2d map not
    verified and not retraining like float32 (`check_raw_units_fixes_retrain`)."""
    check_raw_units_fixes_retrain(mnist_runs["raw_units"])


# ---------------------------------------------------------------------------
# examples/nlp/bidirectional_lstm_imdb.py and the text Transformer


@pytest.fixture(scope="module")
def text_runs(tmp_path_factory):
    runs = {}
    for name, build, data, policy in (("bilstm", bidirectional_lstm, imdb_data, "mixed_float16"),
                                      ("transformer", text_transformer, text_data,
                                       "mixed_bfloat16")):
        for head in (None, "float32"):
            _policy(policy)
            x, y = data(BATCH * 2)
            key = f"{name}_{'healthy' if head else 'published'}"
            runs[key] = _fit(tmp_path_factory.mktemp(key), build(head), x, y)
    keras.mixed_precision.set_dtype_policy("float32")
    return runs


def test_bilstm_on_jax(text_runs):
    """The published sigmoid head outputs float16 (MP006 on it); with a
    float32 head only the CPU finding. Projected on a GPU nothing more: the
    1-unit head is the task's, the LSTMs' 8 units a multiple of 8."""
    assert _codes(text_runs["bilstm_healthy"]) == {"MP011"}
    assert _codes(text_runs["bilstm_published"]) == {"MP006", "MP011"}
    assert _only(text_runs["bilstm_published"], "MP006").layer == "dense"
    for run in (text_runs["bilstm_healthy"], text_runs["bilstm_published"]):
        assert "MP007" not in _codes(run, assume_gpu=True)


def test_text_transformer_on_jax_in_bfloat16(text_runs):
    """Under mixed_bfloat16 the published softmax head outputs bfloat16
    (MP006); with a float32 head nothing fires: MP011 is float16's (a CPU
    has no float16 Tensor Cores), and a GPU projection adds no MP007."""
    assert _codes(text_runs["transformer_healthy"]) == set()
    finding = _only(text_runs["transformer_published"], "MP006")
    assert finding.evidence["loss_input_dtypes"] == ["bfloat16"]
    assert _codes(text_runs["transformer_published"]) == {"MP006"}
    for run in (text_runs["transformer_healthy"], text_runs["transformer_published"]):
        assert "MP007" not in _codes(run, assume_gpu=True)


# The guide's first CustomModel, as published: gradients of the loss that
# `stateless_compute_loss` returns, applied by `stateless_apply`; no
# `scale_loss`. `scale=True` is MP018's fix, spelled as its text shows it.


class CustomModel(keras.Model):
    scale = False

    def compute_loss_and_updates(
        self,
        trainable_variables,
        non_trainable_variables,
        metrics_variables,
        x,
        y,
        sample_weight,
        training=False,
        optimizer_variables=None,
    ):
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables,
            non_trainable_variables,
            x,
            training=training,
        )
        loss, (
            trainable_variables,
            non_trainable_variables,
            metrics_variables,
        ) = self.stateless_compute_loss(
            trainable_variables,
            non_trainable_variables,
            metrics_variables,
            x=x,
            y=y,
            y_pred=y_pred,
            sample_weight=sample_weight,
            training=training,
        )
        if self.scale:
            mapping = list(zip(self.optimizer.variables, optimizer_variables, strict=True))
            with keras.StatelessScope(state_mapping=mapping):
                return self.optimizer.scale_loss(loss), (
                    y_pred, non_trainable_variables, metrics_variables)
        return loss, (y_pred, non_trainable_variables, metrics_variables)

    def train_step(self, state, data):
        (
            trainable_variables,
            non_trainable_variables,
            optimizer_variables,
            metrics_variables,
        ) = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)

        # Get the gradient function.
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)

        # Compute the gradients.
        (loss, (y_pred, non_trainable_variables, metrics_variables)), grads = grad_fn(
            trainable_variables,
            non_trainable_variables,
            metrics_variables,
            x,
            y,
            sample_weight,
            training=True,
            optimizer_variables=optimizer_variables,
        )

        # Update trainable variables and optimizer variables.
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables
        )

        # Update metrics.
        new_metrics_vars = []
        logs = {}
        for metric in self.metrics:
            this_metric_vars = metrics_variables[
                len(new_metrics_vars) : len(new_metrics_vars) + len(metric.variables)
            ]
            if metric.name == "loss":
                this_metric_vars = metric.stateless_update_state(
                    this_metric_vars, loss, sample_weight=sample_weight
                )
            else:
                this_metric_vars = metric.stateless_update_state(
                    this_metric_vars, y, y_pred, sample_weight=sample_weight
                )
            logs[metric.name] = metric.stateless_result(this_metric_vars)
            new_metrics_vars += this_metric_vars

        # Return metric logs and updated state variables.
        state = (
            trainable_variables,
            non_trainable_variables,
            optimizer_variables,
            new_metrics_vars,
        )
        return logs, state


@pytest.fixture(scope="module")
def guide_runs(tmp_path_factory):
    return fit_guide_runs(CustomModel, tmp_path_factory.mktemp)


def test_guide_without_scale_loss_is_mp018_in_jax(guide_runs):
    run = guide_runs["published"]
    assert _codes(run) == {"MP018", "MP006", "MP011"}
    finding = _only(run, "MP018")
    assert finding.evidence["update_effect"] == "adaptive"  # Adam
    assert "GradientTape" not in finding.fix and "tf." not in finding.fix
    for code in ("jax.value_and_grad", "keras.StatelessScope(state_mapping=mapping)",
                 "self.optimizer.scale_loss(loss)", "self.optimizer.stateless_apply("):
        assert code in finding.fix
    assert "1.7x" in finding.fix
    # What the loss received, seen through stateless_compute_loss.
    assert _only(run, "MP006").evidence["loss_input_dtypes"] == ["float16"]


def test_guide_with_scale_loss_is_healthy(guide_runs):
    assert _codes(guide_runs["healthy"]) == {"MP011"}


class _RaisesInTraining(keras.layers.Layer):
    """A user's layer whose training branch raises (a bug of the user's own)."""

    def call(self, x, training=False):
        if training:
            raise ValueError("boom in training")
        return x


def test_a_failed_fit_on_jax_is_diagnosed_with_the_users_traceback(tmp_path):
    import traceback
    import warnings

    _policy("mixed_float16")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), _RaisesInTraining(),
                              keras.layers.Dense(1, dtype="float32")])
    model.compile(optimizer="adam", loss="mse")
    with warnings.catch_warnings(record=True) as caught, pytest.raises(ValueError) as raised:
        warnings.simplefilter("always")
        _fit(tmp_path, model, np.ones((64, 4)), np.ones((64, 1)))
    frames = [f.filename for f in traceback.extract_tb(raised.value.__traceback__)]
    assert not [f for f in frames if "/mpprof/" in f], frames
    assert not [w for w in caught if "training goes on" in str(w.message)]
    run = read_logdir(str(tmp_path))["train"]
    finding = _only(run, "MP020")
    assert finding.evidence["type"] == "ValueError" and finding.step == 0
    assert "boom in training" in finding.title
    assert finding.evidence["kind"] == "other"  # not a dtype error: no advice
    assert "numerics_every" not in finding.fix and "cast" not in finding.fix
    assert _codes(run) == {"MP020", "MP011"}
    # `mpprof summary` and the diagnosis text say what fit raised, too.
    from mpprof.display.run_summary import cut_short_text

    assert "model.fit raised ValueError:" in cut_short_text(run)
    assert "boom in training" in cut_short_text(run)
