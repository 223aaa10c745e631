"""A custom `train_step` on PyTorch: the Keras guide's ("Customizing what
happens in fit() with PyTorch") as published takes gradients of the raw
loss, so the LossScaleOptimizer that mixed_float16 gives the model divides
them by a scale they were never multiplied by (MP018). The fix is PyTorch
code; pasted, as its text shows it, in place of the guide's lines, the step
trains as Keras' own PyTorch step does and MP018 is gone. The same for MP008
(an optimizer of the model's own, without loss scaling)."""

from __future__ import annotations

import jax_runs
import keras
import numpy as np
import pytest
import torch

from mpprof import diagnosis
from mpprof.diagnosis.view import RunView

FOREIGN = ("tf.", "GradientTape", "jax", "stateless")

# The guide's step around the lines a fix replaces (`body`).
STEP = '''
def train_step(self, data):
    x, y = data
{body}
    for metric in self.metrics:
        if metric.name == "loss":
            metric.update_state(loss)
        else:
            metric.update_state(y, y_pred)
    return {{m.name: m.result() for m in self.metrics}}
'''
# The guide's own lines: `loss.backward()` on the raw loss.
PUBLISHED = '''
    self.zero_grad()
    y_pred = self(x, training=True)
    loss = self.compute_loss(y=y, y_pred=y_pred)
    loss.backward()
    trainable_weights = [v for v in self.trainable_weights]
    gradients = [v.value.grad for v in trainable_weights]
    with torch.no_grad():
        self.optimizer.apply(gradients, trainable_weights)
'''
MARK = "scale the loss before taking gradients:\n"


def _model(body: str | None, optimizer="adam", own_optimizer=None) -> keras.Model:
    """A small regressor under mixed_float16 whose `train_step` is `STEP`
    around `body` (None: Keras' own PyTorch step); `own_optimizer` is kept
    as `model.opt`, which `body` may use instead of `self.optimizer`."""
    members = {}
    if body is not None:
        namespace = {"torch": torch}
        exec(STEP.format(body=body), namespace)  # the fix's text, as a user pastes it
        members["train_step"] = namespace["train_step"]
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((32,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    outputs = keras.layers.Dense(1, dtype="float32")(keras.layers.Dense(16)(hidden))
    model = type("CustomModel", (keras.Model,), members)(inputs, outputs)
    if own_optimizer is not None:
        model.opt = own_optimizer
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    keras.mixed_precision.set_dtype_policy("float32")
    return model


def _fix_body(finding) -> str:
    return finding.fix.split(MARK, 1)[1]


def _codes(run) -> set[str]:
    return {f.code for f in diagnosis.diagnose(run)}


def _only(run, code: str):
    (found,) = [f for f in diagnosis.diagnose(run) if f.code == code]
    return found


def _status(run, code: str) -> str:
    return next(c.status for c in diagnosis.evaluate(run).checks if c.code == code)


def _weights(model) -> list[np.ndarray]:
    return [keras.ops.convert_to_numpy(w.value) for w in model.trainable_weights]


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    return (rng.random((64, 32), dtype=np.float32),
            rng.random((64, 1), dtype=np.float32))


@pytest.fixture(scope="module")
def published(tmp_path_factory, data):
    model = _model(PUBLISHED)
    return jax_runs.fit(tmp_path_factory.mktemp("published"), model, *data, epochs=2)


def test_the_guide_s_step_as_published_is_mp018_with_torch_code(published):
    assert published.context["keras_backend"] == "torch"
    assert _codes(published) == {"MP018", "MP011"}
    finding = _only(published, "MP018")
    assert finding.evidence["update_effect"] == "adaptive"  # Adam
    for code in ("self.zero_grad()", "self.optimizer.scale_loss(loss).backward()",
                 "gradients = [v.value.grad for v in trainable_weights]",
                 "with torch.no_grad():",
                 "self.optimizer.apply(gradients, trainable_weights)"):
        assert code in finding.fix, code
    assert not [word for word in FOREIGN if word in finding.fix], finding.fix


def test_the_fix_pasted_trains_as_keras_own_step_and_mp018_is_gone(tmp_path, data,
                                                                     published):
    fixed = _model(_fix_body(_only(published, "MP018")))
    run = jax_runs.fit(tmp_path / "fixed", fixed, *data, epochs=2)
    assert _codes(run) == {"MP011"} and _status(run, "MP018") == "checked"
    # Keras' own PyTorch step scales the loss the same way: the same weights,
    # the same loss scale (halved once by a first step that overflows in both).
    own = _model(None)
    own.fit(*data, batch_size=8, epochs=2, verbose=0, shuffle=False)
    assert run.loss_scale.final_scale == float(
        keras.ops.convert_to_numpy(own.optimizer.dynamic_scale.value)) == 2.0**14
    for mine, keras_own in zip(_weights(fixed), _weights(own), strict=True):
        np.testing.assert_allclose(mine, keras_own, rtol=1e-5, atol=1e-6)
    # It trains: the epochs' losses fall.
    history = fixed.fit(*data, batch_size=8, epochs=3, verbose=0, shuffle=False).history
    assert history["loss"][-1] < history["loss"][0]


def test_mp008_on_an_own_optimizer_shows_the_torch_scaled_step(tmp_path, data):
    """An optimizer the model keeps itself (`self.opt`), a plain Adam under
    mixed_float16: MP008, whose line of how to scale the loss is PyTorch's.
    Look-alike: the same step with `self.opt` a LossScaleOptimizer and the
    MP018 fix's lines (for `self.opt`): neither finding."""
    body = PUBLISHED.replace("self.optimizer", "self.opt")
    run = jax_runs.fit(tmp_path / "plain", _model(body, own_optimizer=keras.optimizers.Adam()),
                       *data)
    finding = _only(run, "MP008")
    assert "opt.scale_loss(loss).backward()" in finding.fix
    assert "under torch.no_grad() unscales them" in finding.fix
    assert not [word for word in FOREIGN if word in finding.fix], finding.fix
    syntax = RunView(run).syntax
    scaled = _model(syntax.custom_step("self.opt"), own_optimizer=(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())))
    run = jax_runs.fit(tmp_path / "scaled", scaled, *data)
    assert not _codes(run) & {"MP008", "MP018"}
    assert _status(run, "MP008") == "checked" and _status(run, "MP018") == "checked"
