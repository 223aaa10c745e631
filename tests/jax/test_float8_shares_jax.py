"""Float8 shares on JAX: on sampled steps, the share of each float8 layer's
inputs, kernel and output gradient that saturates or quantizes to zero,
measured in the instrumented step (outputs, no host callback), on real CPU
fits of `model.quantize("float8")` models, read back by the reader and judged
(MP015/MP016 from shares where they are measured).

The shares are compared with what Keras' own quantizer does to the same
step's values with the same scales, taken from an unprofiled twin stepped one
batch at a time."""

import json

import jax
import jax.numpy as jnp
import jax_runs
import keras
import numpy as np
import pytest
from custom_step_models import CustomStepRegressor
from float8_runs import BATCH, STEPS, compiled_float8_model, float8_data

from mpprof import cli, diagnosis
from mpprof.backends.float8_replay import float8_layers
from mpprof.backends.jax import float8_shares
from mpprof.dtypes import FLOAT8_RANGES
from mpprof.records import schema

FLOAT8_CODES = ("MP015", "MP016", "MP017")
LAYERS = ("hidden", "head")
E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"


def _keras_counts(values: np.ndarray, scale: float, fmt: str) -> np.ndarray:
    """FLOAT8_SHARE_COLUMNS of `values` as Keras' own quantizer treats them."""
    values = np.asarray(values, np.float32)
    quantized = np.asarray(keras.quantizers.quantize_and_dequantize(
        values, np.float32(scale), fmt, "float32"))
    fmax = FLOAT8_RANGES[fmt].max
    clipped = np.isclose(np.abs(quantized), fmax * np.float32(scale), rtol=1e-6) & (
        np.abs(values) > np.abs(quantized))
    return np.array([values.size, np.count_nonzero(values), clipped.sum(),
                     ((values != 0) & (quantized == 0)).sum(), np.float32(scale),
                     np.abs(values).max()], np.float64)


class _Twin:
    """The model trained unprofiled, one `train_on_batch` a step; before
    each step, the FLOAT8_SHARE_COLUMNS Keras' quantizer gives each float8
    tensor with the scales the step quantizes with: the batch and the
    normalised activations each layer receives, the kernels, and the
    gradients flowing into each layer's activation, by `jax.grad` of the
    mse through Keras' own float8 layers (the head's backward quantizes the
    gradient it passes on)."""

    def __init__(self, x, y, **model):
        self.model = compiled_float8_model(**model)
        self.expected = []
        for i in range(STEPS):
            xb, yb = x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]
            self.expected.append(self._rows(xb, yb))
            self.model.train_on_batch(xb, yb)

    def _rows(self, xb, yb) -> np.ndarray:
        hidden, norm, head = (self.model.get_layer(name) for name in ("hidden", "norm", "head"))
        relu = hidden.activation
        hidden.activation = keras.activations.linear  # its pre-activation output
        try:
            z = jnp.asarray(hidden(xb))
        finally:
            hidden.activation = relu

        normalised = norm(relu(z))
        # The head's output gradient: that of a linear float32 head's mse.
        head_gradient = 2 * (np.asarray(head(normalised)) - yb) / BATCH
        hidden_gradient = jax.grad(lambda z: jnp.mean(jnp.square(head(norm(relu(z))) - yb)))(z)
        rows = np.zeros((len(LAYERS), len(schema.FLOAT8_TENSORS),
                         len(schema.FLOAT8_SHARE_COLUMNS)))
        for row, (layer, inputs, gradient) in enumerate(
                ((hidden, xb, hidden_gradient), (head, normalised, head_gradient))):
            rows[row, 0] = _keras_counts(inputs, layer.inputs_scale.value, E4M3)
            rows[row, 1] = _keras_counts(layer._kernel.value, layer.kernel_scale.value, E4M3)
            rows[row, 2] = _keras_counts(gradient, layer.outputs_grad_scale.value, E5M2)
        return rows


def _fit(log_dir, x, y, numerics_every=1, **model):
    profiled = compiled_float8_model(**model)
    run = jax_runs.fit(log_dir, profiled, x, y, batch_size=BATCH, flush_every_steps=2,
                       numerics_every=numerics_every)
    return profiled, run


def _plain_weights(x, y, **model) -> list:
    plain = compiled_float8_model(**model)
    plain.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    return plain.get_weights()


def _shares_record(run) -> np.ndarray:
    """The FLOAT8_SHARES rows as written, [samples, layers, tensors, columns]."""
    records = sorted(run.records[schema.FLOAT8_SHARES], key=lambda r: r.step)
    return np.stack([np.asarray(r.value) for r in records])


@pytest.mark.parametrize("growth", [4.0, 1.0])
def test_sampled_shares_are_keras_quantizer_on_the_steps_values_and_scales(tmp_path, growth):
    """Growth 4: the hidden layer's inputs outgrow their delayed scale and
    saturate; growth 1 (the healthy look-alike): they stay within it."""
    x, y = float8_data(growth)
    profiled, run = _fit(tmp_path, x, y)
    twin = _Twin(x, y)
    # Numerics on every step change no weight.
    plain = _plain_weights(x, y)
    for expected, got in zip(plain, profiled.get_weights(), strict=True):
        np.testing.assert_array_equal(expected, got)
    for expected, got in zip(plain, twin.model.get_weights(), strict=True):
        np.testing.assert_array_equal(expected, got)

    assert run.context["collectors"]["float8_shares"] == {"state": "ok", "samples": STEPS - 1}
    float8 = run.float8
    assert list(float8.sample_steps) == list(range(1, STEPS))
    rows = _shares_record(run)
    column = schema.FLOAT8_SHARE_COLUMN
    exact = [column.count, column.nonzero, column.saturated, column.underflowed, column.scale]
    for sample, step in enumerate(float8.sample_steps):
        expected = twin.expected[int(step)]
        for layer, tensor in np.ndindex(expected.shape[:2]):
            got, want = rows[sample, layer, tensor], expected[layer, tensor]
            where = f"step {step}, {LAYERS[layer]} {schema.FLOAT8_TENSORS[tensor]}"
            np.testing.assert_array_equal(got[exact], want[exact], err_msg=where)
            np.testing.assert_allclose(got[column.abs_max], want[column.abs_max], rtol=1e-5,
                                       err_msg=where)
    # The scales are those the float8 state recorded (the flush at step 4
    # read the scales Keras held then).
    np.testing.assert_array_equal(rows[3, :, :, column.scale],
                                  float8.state["scale"][list(float8.steps).index(4)])
    # After warm-up, the hidden layer's inputs:
    saturated = float8.shares["saturated"][1:, 0, 0]
    peaks = float8.shares["peak_over_max"][1:]
    if growth == 4.0:
        assert np.all(saturated > 0.5)  # most of them clip
        assert np.all(peaks[:, 0, 0] > diagnosis.SATURATION_FACTOR)
    else:
        # Delayed scaling clips a few values a little: no finding's peak.
        assert np.nanmax(peaks) < diagnosis.SATURATION_FACTOR
        assert np.all(float8.shares["underflowed"][1:] == 0)


def test_mp015_and_mp016_are_judged_from_the_shares_and_their_look_alikes_are_quiet(
        tmp_path, capsys):
    found = {}
    for name, growth, amax in (("saturating", 4.0, None), ("underflowing", 1.0, 1e12),
                               ("healthy", 1.0, None)):
        x, y = float8_data(growth)
        _, run = _fit(tmp_path / name, x, y, gradient_amax=amax)
        capsys.readouterr()
        assert cli.main(["diagnose", str(tmp_path / name), "--format", "json"]) == 0
        found[name] = {f["code"]: f for f in json.loads(capsys.readouterr().out)
                       if f["code"] in FLOAT8_CODES}
        if name == "underflowing":
            underflowed = run.float8.shares["underflowed"]
            assert np.all(underflowed[:, 0, 2] == 1.0)  # every gradient value is lost
            assert np.all(underflowed[:, 1] == 0.0)
    assert list(found["saturating"]) == ["MP015"]
    mp015 = found["saturating"]["MP015"]
    assert mp015["layer"] == "f8/hidden"
    inputs = mp015["evidence"]["tensors"]["inputs"]
    # Judged from the sampled shares (the amax replay has no such evidence).
    assert inputs["saturated_share_worst"] > diagnosis.SATURATION_SHARE
    assert inputs["samples_over_share"] == inputs["judged_samples"] == STEPS - 2
    assert f"{inputs['saturated_share_worst']:.1%} of its values clipped" in mp015["title"]
    assert list(found["underflowing"]) == ["MP016"]
    mp016 = found["underflowing"]["MP016"]
    assert mp016["layer"] == "f8/hidden"
    assert mp016["evidence"]["tensors"]["outputs_grad"]["underflowed_share_worst"] == 1.0
    assert "100.0% of its non-zero values quantized to zero" in mp016["title"]
    assert found["healthy"] == {}


def test_a_failing_float8_tap_never_reaches_the_users_step(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("injected into quantization_counts")

    monkeypatch.setattr(float8_shares, "quantization_counts", broken)
    x, y = float8_data()
    with pytest.warns(RuntimeWarning, match="stopped recording float8_shares"):
        profiled, run = _fit(tmp_path, x, y)
    for expected, got in zip(_plain_weights(x, y), profiled.get_weights(), strict=True):
        np.testing.assert_array_equal(expected, got)
    state = run.context["collectors"]["float8_shares"]
    assert state["state"] == "failed" and "injected" in state["reason"]
    # The per-layer numerics still ran; the layers are left as found.
    assert run.context["collectors"]["numerics"]["state"] == "ok"
    assert len(run.numerics.steps) == STEPS - 1
    for layer in (profiled.get_layer("hidden"), profiled.get_layer("head")):
        assert "quantized_call" not in vars(layer)
        assert layer.activation in (keras.activations.relu, keras.activations.linear)


def test_a_custom_train_step_says_its_shares_are_not_measured(tmp_path):
    keras.mixed_precision.set_dtype_policy("float32")
    keras.utils.set_random_seed(0)
    model = CustomStepRegressor()
    model(np.zeros((1, 8), np.float32))  # builds its layers
    model.quantize("float8", filters=lambda layer: isinstance(layer, keras.layers.Dense))
    model.compile(optimizer=keras.optimizers.SGD(1e-3))
    x, y = float8_data(4.0)
    run = jax_runs.fit(tmp_path, model, x, y, batch_size=BATCH, numerics_every=1)
    collectors = run.context["collectors"]
    assert collectors["float8"] == {"state": "ok"}
    assert collectors["numerics"]["state"] == "ok"
    shares = collectors["float8_shares"]
    assert shares["state"] == "unavailable" and "own train_step" in shares["reason"]
    assert schema.FLOAT8_SHARES not in run.records


def test_the_plain_step_is_the_layers_own_and_only_a_sampled_trace_measures():
    """The defaults stay cheap: with every float8 layer's `quantized_call`
    wrapped, Keras' train step traces to the same jaxpr as unwrapped; only
    while the instrumented step's trace is on does it count."""
    model = compiled_float8_model()
    model.optimizer.build(model.trainable_variables)
    x, y = float8_data()
    state = tuple([v.value for v in variables] for variables in (
        model.trainable_variables, model.non_trainable_variables,
        model.optimizer.variables, model.metrics_variables))
    shares = float8_shares.Float8Shares(model, True, backend=None)

    def traced(on: bool) -> str:
        def step(probes, state, data):
            if on:
                shares.start(probes)
            try:
                return model.train_step(state, data), shares.forward() if on else None
            finally:
                shares.stop()

        return str(jax.make_jaxpr(step)(shares.probes(), state, (x[:BATCH], y[:BATCH])))

    unwrapped = traced(on=False)
    for row, layer in enumerate(float8_layers(model)):
        layer.quantized_call = shares.wrap(layer, row, layer.quantized_call)
    assert traced(on=False) == unwrapped
    # On: the counts' sums are in the step.
    assert traced(on=True).count("reduce_sum") > unwrapped.count("reduce_sum")
