"""Per-layer numerics on real training runs on CPU."""


import keras
import numpy as np
import pytest
from conftest import BatchTimes, mnist_like, overflow_data, overflow_model, seed_model

import mpprof
from mpprof import diagnosis
from mpprof.backends.numerics_rows import SAMPLE_VALUES
from mpprof.records import reader, schema


def _fit(model, x, y, logdir, epochs=1, batch_size=8, **profiler_kwargs):
    profiler = mpprof.MixedPrecisionProfiler(log_dir=str(logdir), **profiler_kwargs)
    model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0, shuffle=False,
              callbacks=[profiler])
    return reader.read_run(logdir, "train")


def _forward_overflow_model(**compile_kwargs):
    """Dense kernels of 300: the second Dense layer's output passes 65504."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    big = keras.initializers.Constant(300.0)
    model = keras.Sequential([
        keras.layers.Input((8,)),
        keras.layers.Dense(8, kernel_initializer=big, name="first"),
        keras.layers.Dense(8, kernel_initializer=big, name="second"),
        keras.layers.Dense(1, dtype="float32", name="head"),
    ])
    # A zero learning rate keeps the weights, so an eager pass reproduces them.
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", **compile_kwargs)
    return model


@pytest.mark.parametrize("every", [2, 5])
def test_a_sample_every_n_steps(tmp_path, every):
    """`numerics_every=N` samples every N steps, with the quiet calls between
    two samples counted before the schedule is asked."""
    model = seed_model("float32")
    x, y = mnist_like(40 * 8)
    run = _fit(model, x, y, tmp_path, numerics_every=every, forensic_budget=0)
    np.testing.assert_array_equal(run.numerics.steps, np.arange(every, 40, every))


def _mp003(run):
    return [f for f in diagnosis.diagnose(run) if f.code == "MP003"]


def test_forward_overflow_under_steps_per_execution_names_the_call_s_steps(tmp_path):
    model = _forward_overflow_model(steps_per_execution=4)
    x = np.linspace(0.01, 0.1, 64 * 8, dtype="float32").reshape(64, 8)
    run = _fit(model, x, np.ones((64, 1), "float32"), tmp_path, numerics_every=4)
    (finding,) = _mp003(run)
    step = finding.step
    assert finding.layer == "second" and finding.evidence["steps_in_sample"] == 4
    assert f"on steps {step} to {step + 3} (" in finding.title


class _InlineMask(keras.layers.Layer):
    """Adds a -1e9 mask in its own `call` (as keras-hub's T5 attention does):
    -inf in float16, and 0 * -inf is NaN; its Dropout only passes it on."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.proj = keras.layers.Dense(8, name="proj")
        self.drop = keras.layers.Dropout(0.0, name="drop")

    def call(self, inputs):
        hidden = self.proj(inputs)
        mask = keras.ops.ones_like(hidden)
        return self.drop(hidden + (1.0 - mask) * -1e9)


def test_forward_overflow_made_by_a_parent_s_own_ops_names_the_parent(tmp_path):
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    model = keras.Sequential([keras.layers.Input((8,)), _InlineMask(name="attn"),
                              keras.layers.Dense(1, dtype="float32", name="head")])
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    run = _fit(model, rng.random((32, 8), dtype=np.float32),
               rng.random((32, 1), dtype=np.float32), tmp_path, numerics_every=1)
    layers = {layer["name"]: layer for layer in run.inventory["layers"]}
    assert layers["attn/drop"]["inputs_made_outside_layers"]
    assert not layers["attn/proj"]["inputs_made_outside_layers"]
    (finding,) = _mp003(run)
    assert finding.layer == "attn"
    assert finding.evidence["input_made_by"] == "attn"
    assert finding.title.startswith("Forward overflow in attn's own ops (the input of attn/drop)")


def test_forward_overflow_of_a_nested_first_layer_fed_by_the_data_names_it(tmp_path):
    """The look-alike: a nested block's first layer fed by the model's input
    (no layer made it, no parent's op either) overflowed by itself."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    block = keras.Sequential([
        keras.layers.Input((8,)),
        keras.layers.Dense(8, kernel_initializer=keras.initializers.Constant(300.0),
                           name="big"),
    ], name="block")
    model = keras.Sequential([keras.layers.Input((8,)), block,
                              keras.layers.Dense(1, dtype="float32", name="head")])
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    run = _fit(model, np.full((32, 8), 100.0, np.float32), np.ones((32, 1), "float32"),
               tmp_path, numerics_every=1)
    layers = {layer["name"]: layer for layer in run.inventory["layers"]}
    assert not layers["block/big"]["inputs_made_outside_layers"]
    (finding,) = _mp003(run)
    assert finding.layer == "block/big" and "input_made_by" not in finding.evidence


def test_forward_overflow_is_not_blamed_on_samples_after_the_weights_went_nonfinite(tmp_path):
    """bfloat16 without loss scaling: a NaN in step 2's data makes its loss
    non-finite, and its update every weight NaN; the samples after it show
    NaN outputs that no layer made. MP012 says so; MP003 names no layer."""
    keras.mixed_precision.set_dtype_policy("mixed_bfloat16")
    model = keras.Sequential([
        keras.layers.Input((8,)), keras.layers.Dense(16, name="first"),
        keras.layers.Dense(16, name="second"), keras.layers.Dense(1, dtype="float32", name="head"),
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.random((64, 8), dtype=np.float32)
    x[2 * 8 + 1, 3] = np.nan
    run = _fit(model, x, rng.random((64, 1), dtype=np.float32), tmp_path, numerics_every=3)
    assert run.health["first_nonfinite_loss_step"] == 2
    np.testing.assert_array_equal(run.numerics.steps, [3, 6])
    assert diagnosis.forward_overflow_mask(run).all()
    assert not _mp003(run)
    statuses = {c.code: c for c in diagnosis.evaluate(run).checks}
    assert statuses["MP003"].status == "not measured"
    assert "came after step 2" in statuses["MP003"].reason
    assert any(f.code == "MP012" for f in diagnosis.diagnose(run))


def test_forward_overflow_in_a_bfloat16_run_is_not_told_to_train_in_bfloat16(tmp_path):
    keras.mixed_precision.set_dtype_policy("mixed_bfloat16")
    model = keras.Sequential([
        keras.layers.Input((8,)),
        keras.layers.Dense(8, kernel_initializer=keras.initializers.Constant(1e10), name="big"),
        keras.layers.Lambda(lambda t: keras.ops.minimum(t, 1.0), name="clip"),
        keras.layers.Dense(1, dtype="float32", name="head"),
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    run = _fit(model, np.full((32, 8), 1e30, np.float32), np.ones((32, 1), "float32"),
               tmp_path, numerics_every=1)
    (finding,) = _mp003(run)
    assert finding.layer == "big" and finding.evidence["dtype"] == "bfloat16"
    assert "train in bfloat16" not in finding.fix and "mixed_bfloat16" not in finding.fix


@pytest.mark.parametrize(
    "compile_kwargs", [{}, {"jit_compile": True, "steps_per_execution": 2}],
    ids=["plain", "jit_compile+steps_per_execution=2"],
)
def test_first_forward_offender_and_exact_abs_max(tmp_path, compile_kwargs):
    model = _forward_overflow_model(**compile_kwargs)
    x = np.linspace(0.01, 0.1, 64 * 8, dtype="float32").reshape(64, 8)
    run = _fit(model, x, np.ones((64, 1), "float32"), tmp_path, numerics_every=2,
               forensic_budget=0)
    numerics = run.numerics
    assert numerics.layers == ["first", "second", "head"]
    assert len(numerics.steps) >= 2 and not numerics.forensic.any()
    assert numerics.policy_max == schema.FLOAT16_MAX
    for sample in range(len(numerics.steps)):
        assert diagnosis.first_forward_offender(run, sample) == 1
    # The same forward pass, eagerly: abs-max of "first" over the sampled batches.
    first = model.get_layer("first")
    steps_covered = int(numerics.steps_covered[0])
    for sample, step in enumerate(numerics.steps):
        batch = x[step * 8:(step + steps_covered) * 8]
        expected = float(np.max(np.abs(np.asarray(first(batch)).astype(np.float32))))
        assert numerics.forward["abs_max"][sample, 0] == pytest.approx(expected, rel=1e-6)
        assert numerics.forward["nonfinite_frac"][sample, 0] == 0
        assert numerics.forward["nonfinite_frac"][sample, 1] == 1.0


def test_gradient_storm_and_forensic_budget(tmp_path):
    keras.utils.set_random_seed(2)
    model = overflow_model(growth_steps=4)
    x, y = overflow_data()
    run = _fit(model, x, y, tmp_path, epochs=2, numerics_every=1000, forensic_budget=3,
               forensic_spacing=1)
    numerics, overflows = run.numerics, run.loss_scale.overflow_steps
    assert numerics.forensic.all() and len(numerics.steps) == 3
    # Each capture is the step right after an overflow.
    assert set(numerics.steps) <= set(overflows + 1)
    assert numerics.forward["nonfinite_frac"].max() == 0
    assert numerics.forward["abs_max"].max() < schema.FLOAT16_MAX
    assert all(diagnosis.first_forward_offender(run, i) is None for i in range(3))
    gradient_overflowed = numerics.backward["nonfinite_frac"] > 0
    assert gradient_overflowed.any()
    sample = int(np.flatnonzero(gradient_overflowed.any(axis=1))[0])
    assert diagnosis.first_backward_offender(run, sample) is not None
    assert numerics.variable_grads["nonfinite_frac"][sample].max() > 0
    assert run.context["collectors"]["numerics"]["forensic_used"] == 3


def test_underflow_of_tiny_scaled_gradients(tmp_path):
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    model = keras.Sequential([
        keras.layers.Input((32,)),
        keras.layers.Dense(64, name="hidden"),
        keras.layers.Dense(1, dtype="float32", name="head"),
    ])
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=1.0, dynamic_growth_steps=10**9
    )

    def tiny_loss(y_true, y_pred):
        return 1e-8 * keras.ops.mean(keras.ops.square(y_true - y_pred))

    model.compile(optimizer=optimizer, loss=tiny_loss)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 32)).astype("float32"), rng.random((64, 1)).astype("float32")
    numerics = _fit(model, x, y, tmp_path, numerics_every=2).numerics
    hidden = numerics.layers.index("hidden")
    backward = numerics.backward
    lost = backward["underflow_frac"][:, hidden] + backward["zero_frac"][:, hidden]
    assert (lost > 0.9).all()
    kernel = next(i for i, v in enumerate(numerics.variables) if v.endswith("hidden/kernel"))
    assert numerics.unscaled_variable_grads["abs_max"][:, kernel].max() < 1e-3


def test_instrumentation_does_not_change_training(tmp_path):
    def train(profiled: bool):
        keras.utils.set_random_seed(3)
        keras.mixed_precision.set_dtype_policy("mixed_float16")
        model = keras.Sequential([
            keras.layers.Input((16,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(1, dtype="float32"),
        ])
        model.compile(optimizer="adam", loss="mse")
        rng = np.random.default_rng(0)
        x = rng.standard_normal((96, 16)).astype("float32")
        y = rng.random((96, 1)).astype("float32")
        profiler = mpprof.MixedPrecisionProfiler(str(tmp_path), numerics_every=1)
        callbacks = [profiler] if profiled else []
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False, callbacks=callbacks)
        return [w.numpy() for w in model.weights]

    plain, profiled = train(False), train(True)
    for a, b in zip(plain, profiled, strict=True):
        np.testing.assert_array_equal(a, b)
    numerics = reader.read_run(tmp_path, "train").numerics
    assert len(numerics.steps) == 23  # every step but the first, which builds the model


def test_shared_layer_aggregates_its_call_sites(tmp_path):
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    shared = keras.layers.Dense(8, name="shared")
    inputs = keras.Input((8,))
    twice = shared(shared(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1, dtype="float32", name="head")(twice))
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((16, 8), "float32")
    numerics = _fit(model, x, np.ones((16, 1), "float32"), tmp_path, numerics_every=1).numerics
    shared_row = numerics.layers.index("shared")
    # Two call sites of 8 values per example, 8 examples per batch.
    assert numerics.forward["count"][0, shared_row] == 2 * 8 * 8


def test_tensor_statistics_counts_and_log2_bins():
    from mpprof.backends.tensorflow.tensor_statistics import tensor_statistics

    values = np.array([0.0, -1e-9, 1e-5, 1.0, -3.0, 7e4, 2.0**-41, np.inf, np.nan], np.float32)
    counts, abs_max, histogram = (np.asarray(t) for t in tensor_statistics(values))
    columns = dict(zip(schema.NUMERICS_COUNT_COLUMNS, counts, strict=True))
    assert columns == {"count": 9, "nonfinite": 2, "zero": 1, "below_normal": 3,
                       "below_subnormal": 2}
    assert abs_max == pytest.approx(7e4)
    edges = np.asarray(schema.NUMERICS_HIST_EDGES)
    finite_nonzero = np.abs(values[np.isfinite(values) & (values != 0)])
    expected = np.bincount(np.searchsorted(edges, np.log2(finite_nonzero), side="right"),
                           minlength=len(edges) + 1)
    np.testing.assert_array_equal(histogram, expected)


def _exact_columns(values: np.ndarray) -> dict[str, float]:
    """The count columns of `values`, computed on every value by numpy."""
    magnitude = np.abs(values.astype(np.float64))
    finite = np.isfinite(magnitude)
    nonzero = finite & (magnitude > 0)
    return {
        "count": values.size,
        "nonfinite": int((~finite).sum()),
        "zero": int((finite & (magnitude == 0)).sum()),
        "below_normal": int((nonzero & (magnitude < schema.FLOAT16_SMALLEST_NORMAL)).sum()),
        "below_subnormal": int(
            (nonzero & (magnitude < schema.FLOAT16_SMALLEST_SUBNORMAL)).sum()),
    }


def _statistics(values: np.ndarray, dtype: str, *, dynamic: bool, jit: bool = False):
    """The statistics of `values` cast to `dtype`, their device part traced
    with the first dimension unknown (as a batch is) when `dynamic`,
    XLA-compiled when `jit`."""
    import tensorflow as tf

    from mpprof.backends.numerics_rows import statistics_of_rows
    from mpprof.backends.tensorflow.tensor_statistics import raw_statistics

    shape = [None, *values.shape[1:]] if dynamic else list(values.shape)
    function = tf.function(
        lambda t: raw_statistics(tf.cast(t, dtype)),
        input_signature=[tf.TensorSpec(shape, tf.float32)], jit_compile=jit,
    )
    stats, histogram = statistics_of_rows(function(tf.constant(values, tf.float32)).numpy())
    columns = dict(zip(schema.NUMERICS_STAT_COLUMNS, stats, strict=True))
    return columns, float(columns.pop("abs_max")), histogram


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("jit", [False, True], ids=["graph", "xla"])
@pytest.mark.parametrize("integer_maximum", [True, False], ids=["int_max", "float_max"])
def test_large_tensor_nonfinite_count_and_abs_max_stay_exact(
    dtype, jit, integer_maximum, monkeypatch
):
    """Also with the float maximum a GPU host takes (no integer maximum there)."""
    from mpprof.backends.tensorflow import tensor_statistics

    monkeypatch.setattr(tensor_statistics, "_integer_maximum_available",
                        lambda: integer_maximum)
    rng = np.random.default_rng(0)
    values = rng.uniform(-1.0, 1.0, (8, 64, 64, 16)).astype(np.float32)
    assert values.size > 8 * SAMPLE_VALUES
    # A few values no sample of 1 in 32 would be sure to meet: one NaN, two
    # infinities, and the largest finite value, all in one channel.
    flat = values.reshape(-1)
    flat[[16 * 1001 + 3, 16 * 20_000 + 3, 16 * 30_007 + 3]] = [np.nan, np.inf, -np.inf]
    flat[16 * 12_345 + 3] = -300.0
    for dynamic in (False, True):
        columns, abs_max, _ = _statistics(values, dtype, dynamic=dynamic, jit=jit)
        assert columns["count"] == values.size
        assert columns["nonfinite"] == 3
        assert abs_max == 300.0
    # Without a non-finite value the largest magnitude still comes out exact.
    flat[[16 * 1001 + 3, 16 * 20_000 + 3, 16 * 30_007 + 3]] = 0.5
    columns, abs_max, _ = _statistics(values, dtype, dynamic=True, jit=jit)
    assert columns["nonfinite"] == 0 and abs_max == 300.0


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "unknown_batch"])
def test_large_tensor_shares_are_estimated_from_every_channel(dynamic):
    """Channel 0 is all zero and channel 1 all subnormal: a stride in step with
    the 16 channels would see one share of 100% and the other of 0%."""
    rng = np.random.default_rng(1)
    values = rng.uniform(0.5, 2.0, (8, 64, 64, 16)).astype(np.float32)
    values[..., 0] = 0.0
    values[..., 1] = 1e-6
    values[..., 2] = rng.uniform(-1e-5, 1e-5, (8, 64, 64))  # mixed normal and not
    columns, abs_max, histogram = _statistics(values, "float16", dynamic=dynamic)
    exact = _exact_columns(values.astype(np.float16))
    assert columns["count"] == exact["count"] and columns["nonfinite"] == 0
    assert abs_max == float(np.abs(values.astype(np.float16)).max())
    # Within four standard errors of a share (at most 0.5 / sqrt(sample)).
    tolerance = 4 * 0.5 / np.sqrt(SAMPLE_VALUES)
    for column in ("zero", "below_normal", "below_subnormal"):
        share, true_share = columns[column] / values.size, exact[column] / values.size
        assert share == pytest.approx(true_share, abs=tolerance), column
    # The histogram is scaled to the whole tensor: it counts its non-zero values.
    assert histogram.sum() / values.size == pytest.approx(
        1 - exact["zero"] / values.size, abs=tolerance)


@pytest.mark.parametrize("length", [0, 9, SAMPLE_VALUES])
def test_small_tensor_of_unknown_length_is_measured_whole(length):
    """A tensor no larger than the sample, traced with an unknown length: every
    count exact (the sample's unused places are masked out)."""
    rng = np.random.default_rng(2)
    values = rng.choice(
        np.array([0.0, 1e-9, -1e-5, 1.0, -3.0, np.inf, np.nan], np.float32), length
    ).reshape(length, 1)
    columns, abs_max, histogram = _statistics(values, "float32", dynamic=True)
    assert columns == _exact_columns(values)
    finite = np.abs(values[np.isfinite(values)])
    assert abs_max == (float(finite.max()) if finite.size else 0.0)
    assert histogram.sum() == int((finite > 0).sum())


def _sequence_data(samples=16, steps=5, features=4):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((samples, steps, features)).astype("float32")
    return x, rng.random((samples, 1)).astype("float32")


@pytest.mark.parametrize("recurrent", ["GRU", "LSTM", "Bidirectional"])
def test_rnn_measured_at_its_boundary_and_its_cell_skipped(tmp_path, recurrent):
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    if recurrent == "Bidirectional":
        layer = keras.layers.Bidirectional(keras.layers.GRU(8, name="inner"), name="rnn")
    else:
        layer = getattr(keras.layers, recurrent)(8, name="rnn")
    model = keras.Sequential([
        keras.layers.Input((5, 4)), layer, keras.layers.Dense(1, dtype="float32", name="head"),
    ])
    model.compile(optimizer="adam", loss="mse")
    x, y = _sequence_data()
    run = _fit(model, x, y, tmp_path, batch_size=4, numerics_every=2)
    numerics = run.numerics
    skipped = run.latest(schema.NUMERICS_LAYOUT)["skipped"]
    if recurrent == "Bidirectional":
        # Each direction's GRU stands in for its own cell.
        boundaries = ["rnn/forward_inner", "rnn/backward_inner"]
        assert numerics.layers == [*boundaries, "head"]
        assert {s["layer"]: s["measured_at"] for s in skipped} == {
            f"{b}/gru_cell": b for b in boundaries
        }
    else:
        assert numerics.layers == ["rnn", "head"]
        cell = f"rnn/{recurrent.lower()}_cell"
        assert [(s["layer"], s["measured_at"]) for s in skipped] == [(cell, "rnn")]
    assert all("runs inside the recurrent layer" in s["reason"] for s in skipped)
    # Measured outside the loop: the whole [batch, units] output and the
    # gradient flowing into it, on every sample.
    for row in range(len(numerics.layers) - 1):
        assert (numerics.forward["count"][:, row] == 4 * 8).all()
        assert (numerics.backward["count"][:, row] == 4 * 8).all()
        assert (numerics.backward["abs_max"][:, row] > 0).all()


@pytest.mark.parametrize("control_flow", ["while_loop", "cond"])
def test_layer_in_custom_control_flow_is_measured_at_the_enclosing_layer(
    tmp_path, control_flow
):
    """A gradient tap inside a tf.while_loop or tf.cond branch fails the fit's
    trace; the enclosing layer is measured instead."""
    import tensorflow as tf

    class Repeated(keras.layers.Layer):
        """Applies its Dense twice in a tf.while_loop, or once in a tf.cond branch."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.inner = keras.layers.Dense(8, name="inner")

        def build(self, input_shape):
            self.inner.build(input_shape)

        def call(self, x):
            if control_flow == "cond":
                return tf.cond(tf.reduce_sum(x) > 0, lambda: self.inner(x),
                               lambda: 2 * self.inner(x))
            return tf.while_loop(lambda i, h: i < 2, lambda i, h: (i + 1, self.inner(h)),
                                 (tf.constant(0), x))[1]

    keras.mixed_precision.set_dtype_policy("mixed_float16")
    model = keras.Sequential([
        keras.layers.Input((8,)), keras.layers.Dense(8, name="first"),
        Repeated(name="repeated"), keras.layers.Dense(1, dtype="float32", name="head"),
    ])
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((16, 8), "float32")
    run = _fit(model, x, np.ones((16, 1), "float32"), tmp_path, numerics_every=1)
    assert run.numerics.layers == ["first", "repeated", "head"]
    [skipped] = run.latest(schema.NUMERICS_LAYOUT)["skipped"]
    assert skipped["layer"] == "repeated/inner" and skipped["measured_at"] == "repeated"
    body = "a tf.cond branch" if control_flow == "cond" else "a tf.while_loop body"
    assert skipped["reason"].startswith(f"called inside {body}")
    assert (run.numerics.backward["count"][:, 1] == 8 * 8).all()


def test_model_without_trainable_weights(tmp_path):
    """Zero variable rows (all frozen) and zero layer rows (no layers at all)."""
    frozen = keras.Sequential([
        keras.layers.Input((4,)), keras.layers.Dense(4, trainable=False, name="frozen"),
    ])

    class NoLayers(keras.Model):
        def call(self, x):
            return x * 2.0

    for name, model in (("frozen", frozen), ("no_layers", NoLayers())):
        model.compile(optimizer="sgd", loss="mse")
        x = np.ones((16, 4), "float32")
        numerics = _fit(model, x, x, tmp_path / name, numerics_every=1).numerics
        assert numerics.variables == []
        assert numerics.variable_grads["count"].shape == (len(numerics.steps), 0)
        assert numerics.layers == (["frozen"] if name == "frozen" else [])
        assert numerics.forward["count"].shape[0] >= 1


def test_samples_of_a_model_without_trainable_weights_have_their_own_steps(tmp_path):
    model = keras.Sequential([
        keras.layers.Input((4,)), keras.layers.Dense(4, trainable=False, name="frozen"),
    ])
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((16, 4), "float32")
    numerics = _fit(model, x, x, tmp_path, batch_size=4, numerics_every=1).numerics
    assert list(numerics.steps) == [1, 2, 3]  # every step but the first


def test_layer_whose_taps_cannot_be_built_is_skipped_with_the_reason(tmp_path, monkeypatch):
    from mpprof.backends.tensorflow.numerics_taps import NumericsTaps

    gradient_tap = NumericsTaps._gradient_tap

    def failing_tap(self, tensor, row):
        if self.layer_names[row] == "second":
            raise TypeError("injected: no tap here")
        return gradient_tap(self, tensor, row)

    monkeypatch.setattr(NumericsTaps, "_gradient_tap", failing_tap)
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    model = keras.Sequential([
        keras.layers.Input((8,)), keras.layers.Dense(8, name="first"),
        keras.layers.Dense(8, name="second"), keras.layers.Dense(1, dtype="float32", name="head"),
    ])
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((16, 8), "float32")
    run = _fit(model, x, np.ones((16, 1), "float32"), tmp_path, numerics_every=1)
    assert run.numerics.layers == ["first", "head"]
    assert run.latest(schema.NUMERICS_LAYOUT)["skipped"] == [{
        "layer": "second", "measured_at": None,
        "reason": "its taps could not be built (TypeError: injected: no tap here)",
    }]
    assert (run.numerics.backward["count"] > 0).all()


def test_optimizers_wrapped_once_each_and_restored():
    """A GAN's two optimizers can each be wrapped; None (a model.optimizer
    never built) and a repeat wrap nothing."""
    import tensorflow as tf

    from mpprof.backends.patching import Patches
    from mpprof.backends.tensorflow.numerics_taps import NumericsTaps

    model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(2, name="dense")])
    collector = NumericsTaps(model, tf.distribute.get_strategy())
    first, second = keras.optimizers.SGD(), keras.optimizers.Adam()
    patches = Patches()
    collector.wrap_optimizer(None, lambda: 1.0, patches)
    for optimizer in (first, second, first):
        collector.wrap_optimizer(optimizer, lambda: 1.0, patches)
    wrapped = vars(first)["apply"]
    assert "apply" in vars(second) and wrapped.__closure__ is not None
    # The repeat did not wrap the wrapper: its closure holds the bound method.
    assert not any(getattr(c.cell_contents, "__name__", "") == "instrumented_apply"
                   for c in wrapped.__closure__)
    assert len(patches) == 2
    assert not patches.restore()
    assert "apply" not in vars(first) and "apply" not in vars(second)


def test_an_overflow_amid_quiet_calls_is_dated_and_sampled_at_once(tmp_path):
    """Most calls run quiet (only a count and the alarm's check, their
    bookkeeping settled later): an overflow among them is dated to its step,
    arms a forensic sample of the very next step, and the flushes and the
    step count stay exact."""
    model = overflow_model(initial_scale=1.0, growth_steps=10**6)
    x, y = overflow_data(8 * 64)
    x[8 * 40] = 1e5  # float16 activations overflow on step 40 only
    run = _fit(model, x, y, tmp_path, numerics_every=1000, flush_every_steps=16)
    assert run.loss_scale.overflow_steps.tolist() == [40]
    assert run.health["first_nonfinite_loss_step"] == run.health[
        "first_nonfinite_loss_step_last"] == 40
    assert run.numerics.steps.tolist() == [41] and run.numerics.forensic.all()
    flushed = [r.step for r in run.records[schema.HEALTH]]
    assert flushed[:4] == [16, 32, 48, 64] and set(flushed[4:]) == {64}  # then epoch, fit end
    assert run.health["checked_step"] == 64


def test_quiet_calls_still_flush_on_time(tmp_path):
    """A flush by seconds falls due in the midst of quiet calls: the call
    after its deadline flushes (steps last at least 20 ms here, so 100 ms
    span at most 5 of them)."""
    keras.utils.set_random_seed(0)
    model = overflow_model(initial_scale=1.0, growth_steps=10**6)
    x, y = overflow_data(8 * 40)
    profiler = mpprof.MixedPrecisionProfiler(str(tmp_path), numerics_every=None,
                                             flush_every_steps=10**5, flush_every_seconds=0.1)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False,
              callbacks=[profiler, BatchTimes(sleep_s=0.02)])
    flushed = [r.step for r in reader.read_run(tmp_path, "train").records[schema.HEALTH]]
    on_time = [step for step in flushed if step < 40]
    assert len(on_time) >= 3
    assert max(b - a for a, b in zip([0, *on_time], on_time, strict=False)) <= 6
