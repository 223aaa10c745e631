"""Which layers JAX numerics can measure: a value of the sampled step's own
trace or of one around it can leave the step, one of an inner trace
(lax.scan, cond, while) cannot. A layer whose output does not depend on the
weights (a Rescaling of the input: a tracer of the jitted step, not of the
differentiation) is measured; a layer called inside a loop is listed as
skipped."""

import jax_runs
import keras
import numpy as np

BATCH, FEATURES = 4, 4


class Looped(keras.layers.Layer):
    """Calls its Dense twice inside `keras.ops.fori_loop` (a lax loop on JAX)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(FEATURES, name="inner")

    def build(self, input_shape):
        self.inner.build(input_shape)

    def call(self, x):
        return keras.ops.fori_loop(0, 2, lambda i, h: self.inner(h), x)


def test_an_input_rescaling_is_measured_and_a_layer_in_a_loop_is_skipped(tmp_path):
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.layers.Input((FEATURES,)),
        keras.layers.Rescaling(0.5, name="scale"),
        Looped(name="looped"),
        keras.layers.Dense(1, dtype="float32", name="head"),
    ])
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.random((16, FEATURES), "float32"), rng.random((16, 1), "float32")
    run = jax_runs.fit(tmp_path, model, x, y, batch_size=BATCH, numerics_every=1)
    numerics = run.numerics
    assert numerics.layers == ["scale", "head"]
    scale = numerics.layers.index("scale")
    # Its whole output, and the gradient flowing into it, on every sample.
    assert (numerics.forward["count"][:, scale] == BATCH * FEATURES).all()
    assert (numerics.backward["count"][:, scale] == BATCH * FEATURES).all()
    per_batch = 0.5 * np.abs(x).reshape(-1, BATCH * FEATURES).max(axis=1)
    np.testing.assert_allclose(numerics.forward["abs_max"][:, scale],
                               per_batch[numerics.steps], rtol=1e-3)  # float16
    skipped = run.latest("numerics/layout")["skipped"]
    assert [(s["layer"], s["measured_at"]) for s in skipped] == [("looped/inner", None)]
    assert "inside JAX control flow" in skipped[0]["reason"]
