"""Forensic samples on JAX: fit dispatches ahead of the host, so the call
alarm rings a call or more after an overflow; the sample is still of the
overflowed step (its kept batch, evaluated beside the call without donating
anything), and training stays that of an unprofiled twin."""

import jax_runs
import keras
import numpy as np

from mpprof import diagnosis

# A small examples/attention_overflow.py: two batches in raw units make the
# attention scores (quadratic in the input scale) overflow float16.
STEPS, FEATURES, UNITS, BATCH, BATCHES = 8, 8, 32, 8, 32
RAW_BATCHES, RAW_GAIN = (12, 13), 300.0


def _data(raw=RAW_BATCHES):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH * BATCHES, STEPS, FEATURES)).astype("float32")
    y = (x[:, :, 0].mean(axis=1) > 0).astype("int32")
    for b in raw:
        x[b * BATCH:(b + 1) * BATCH] *= RAW_GAIN
    return x, y


def _model(**loss_scale) -> keras.Model:
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inputs = keras.layers.Input((STEPS, FEATURES))
    h = keras.layers.Dense(UNITS, name="embed")(inputs)
    h = keras.layers.Attention(name="attention")([h, h])
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    outputs = keras.layers.Dense(2, name="logits", dtype="float32")(h)
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3),
                                                      **loss_scale),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _replayed(run) -> list[dict]:
    numerics = run.context["collectors"]["numerics"]
    return numerics.get("forensic_of_earlier_steps", {}).get("samples", [])


def _mp003(run):
    return [f for f in diagnosis.diagnose(run) if f.code == "MP003"]


def test_a_burst_is_sampled_at_its_first_overflow(tmp_path):
    x, y = _data()
    truth, model, run = jax_runs.fit_beside_a_twin(tmp_path, _model, x, y, numerics_every=16)
    assert truth["overflows"] == list(RAW_BATCHES)
    first = RAW_BATCHES[0]
    forensic = run.numerics.steps[run.numerics.forensic]
    assert forensic.tolist() == [first]
    found = _mp003(run)
    assert found and found[0].layer == "attention" and found[0].step == first
    # The sample ran with the state of a later call (how much later depends
    # on the host's lag): the weights the overflowed step saw when the burst
    # skipped every step since, else that call's.
    (note,) = _replayed(run)
    assert note["step"] == first and note["state_of_step"] > first
    right_after = note["state_of_step"] <= RAW_BATCHES[-1] + 1
    assert note["weights_of_step"] == (first if right_after else note["state_of_step"])
    # The evaluation beside the call changed nothing: not the weights, not
    # the counts.
    assert jax_runs.same_weights(truth["weights"], model)
    assert run.loss_scale.overflow_steps.tolist() == list(RAW_BATCHES)


def test_healthy_look_alike_takes_no_forensic_sample(tmp_path):
    x, y = _data(raw=())
    truth, model, run = jax_runs.fit_beside_a_twin(tmp_path, _model, x, y, numerics_every=16)
    assert truth["overflows"] == []
    assert not run.numerics.forensic.any() and not _replayed(run)
    assert not _mp003(run)
    assert jax_runs.same_weights(truth["weights"], model)


def test_a_gradient_only_probe_is_sampled_but_names_no_layer(tmp_path):
    # No raw batch: the loss scale grows every 2 steps until the scaled
    # gradients overflow (a probe), with every forward output in range.
    x, y = _data(raw=())
    truth, model, run = jax_runs.fit_beside_a_twin(
        tmp_path, lambda: _model(initial_scale=2.0**12, dynamic_growth_steps=2), x, y,
        numerics_every=16, forensic_spacing=4)
    assert truth["overflows"]
    replayed = _replayed(run)
    assert replayed and all(n["step"] in truth["overflows"] for n in replayed)
    assert not _mp003(run)
    assert jax_runs.same_weights(truth["weights"], model)
