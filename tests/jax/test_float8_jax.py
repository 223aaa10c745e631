"""Float8 records on JAX: Keras' float8 layers' scales and amax histories,
read at flush points from the state Keras' JAX fit keeps outside the
variables, replayed into per-step saturation and underflow, and judged
(MP015-MP017), on real CPU fits of `model.quantize("float8")` models.

What the profiler recorded is compared with an unprofiled twin stepped one
batch at a time, whose variables are read after every step."""

import json

import jax_runs
import keras
import numpy as np
import pytest
from float8_runs import BATCH, STEPS, float8_data, float8_model

from mpprof import cli, diagnosis
from mpprof.dtypes import FLOAT8_RANGES
from mpprof.records import schema

FLOAT8_CODES = ("MP015", "MP016", "MP017")
LAYERS = ("hidden", "head")


def _model(policy="float32", frozen=False) -> keras.Model:
    model = float8_model(policy)
    model.get_layer("hidden").trainable = not frozen
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    keras.mixed_precision.set_dtype_policy("float32")
    return model


def _cells(model, what: str) -> np.ndarray:
    """[layers, tensors(, history)] of each float8 tensor's `what` variable."""
    return np.array([[np.asarray(getattr(model.get_layer(name), f"{tensor}_{what}").value)
                      for tensor in schema.FLOAT8_TENSORS] for name in LAYERS], np.float64)


class _Twin:
    """The same model trained unprofiled, one batch per `train_on_batch`,
    with each float8 tensor's scale and amax history read after every
    update it applied (a step the LossScaleOptimizer skipped applies none)."""

    def __init__(self, x, y, epochs: int, **model):
        self.model = _model(**model)
        self.scales, self.histories = [_cells(self.model, "scale")], [
            _cells(self.model, "amax_history")]
        self.updates_by_step = [0]  # updates applied after each step
        iterations = self.model.optimizer.iterations
        for _ in range(epochs):
            for i in range(STEPS):
                before = int(iterations.value)
                self.model.train_on_batch(x[i * BATCH:(i + 1) * BATCH],
                                          y[i * BATCH:(i + 1) * BATCH])
                applied = int(iterations.value) > before
                if applied:
                    self.scales.append(_cells(self.model, "scale"))
                    self.histories.append(_cells(self.model, "amax_history"))
                self.updates_by_step.append(self.updates_by_step[-1] + applied)

    def at_step(self, step: int) -> dict:
        """The FLOAT8_STATE columns a flush at `step` (after the previous
        flush at `since`) should hold, from the variables alone."""
        k = self.updates_by_step[step]
        history = self.histories[k]
        return {"scale": self.scales[k], "amax_max": history.max(axis=-1),
                "amax_last": history[..., 0]}

    def verdicts(self, since: int, step: int) -> dict:
        """Per update between two flushes, as each step saw it: the scale it
        quantized with (the variable before it), its amax (the newest entry of
        the history after it), and whether that scale came from an amax
        (Keras keeps the initial scale while the history before the update
        that set it held only zeros)."""
        found = {name: np.zeros((len(LAYERS), len(schema.FLOAT8_TENSORS))) for name in (
            "steps", "saturated_steps", "underflowed_steps", "warmup_steps")}
        limits = [FLOAT8_RANGES[schema.FLOAT8_FORMATS[t]] for t in schema.FLOAT8_TENSORS]
        fmax = np.array([r.max for r in limits])
        half_tiny = np.array([r.smallest_subnormal / 2 for r in limits])
        for u in range(self.updates_by_step[since], self.updates_by_step[step]):
            used, amax = self.scales[u], self.histories[u + 1][..., 0]
            from_amax = (self.histories[u - 1].max(axis=-1) > 0 if u >= 1
                         else np.zeros(used.shape, bool))
            judged = from_amax & (amax > 0)
            found["steps"] += 1
            found["warmup_steps"] += ~from_amax
            found["saturated_steps"] += judged & (amax > used * fmax)
            found["underflowed_steps"] += judged & (amax / used <= half_tiny)
        return found


def _plain_fit_weights(x, y, epochs: int, **model) -> list:
    plain = _model(**model)
    plain.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0, shuffle=False)
    return plain.get_weights()


def _profiled(tmp_path, x, y, epochs=1, flush_every_steps=2, numerics_every=500,
              steps_per_execution=1, **model):
    profiled = _model(**model)
    if steps_per_execution != 1:
        profiled.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse",
                         steps_per_execution=steps_per_execution)
    run = jax_runs.fit(tmp_path, profiled, x, y, batch_size=BATCH, epochs=epochs,
                       flush_every_steps=flush_every_steps, numerics_every=numerics_every)
    return profiled, run


def _assert_same_weights(expected: list, got: list) -> None:
    for a, b in zip(expected, got, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("growth, flush_every_steps, steps_per_execution, numerics_every", [
    (1.0, 2, 1, 500),  # healthy: flushes inside the epochs and at their ends
    (4.0, 1, 1, 500),  # saturating: a flush after every step dates each one
    (4.0, 2, 2, 1),  # two steps per call, every call sampled (the instrumented step)
])
def test_the_float8_state_is_what_the_variables_hold_step_by_step(
        tmp_path, growth, flush_every_steps, steps_per_execution, numerics_every):
    x, y = float8_data(growth)
    epochs = 2
    profiled, run = _profiled(tmp_path, x, y, epochs, flush_every_steps, numerics_every,
                              steps_per_execution)
    twin = _Twin(x, y, epochs)
    # The twin steps as fit does, and the profiler changes nothing.
    plain = _plain_fit_weights(x, y, epochs)
    _assert_same_weights(plain, twin.model.get_weights())
    _assert_same_weights(plain, profiled.get_weights())

    float8 = run.float8
    assert run.context["collectors"]["float8"] == {"state": "ok"}
    assert float8.layers == ["f8/hidden", "f8/head"]
    assert float8.policies == ["float8_from_float32"] * 2
    assert float8.amax_history_lengths == [1024, 1024]
    every = max(flush_every_steps, steps_per_execution)
    assert list(float8.steps) == list(range(every, epochs * STEPS + 1, every))
    since = 0
    for row, step in enumerate(float8.steps):
        for name, expected in twin.at_step(int(step)).items():
            np.testing.assert_array_equal(float8.state[name][row], expected, err_msg=name)
        for name, expected in twin.verdicts(since, int(step)).items():
            np.testing.assert_array_equal(float8.state[name][row], expected,
                                          err_msg=f"{name} at step {step}")
        since = int(step)
    saturated = float8.state["saturated_steps"][:, 0, 0]
    peak = np.nanmax(float8.state["peak_over_max"][:, 0, 0])
    if growth == 1.0:
        # Delayed scaling lags: a few steps clip their largest value, a little.
        assert 0 < saturated.sum() and peak < diagnosis.SATURATION_FACTOR
    else:
        assert peak > diagnosis.SATURATION_FACTOR
        # The hidden layer's inputs grow 4x a step: in the first epoch every
        # step after warm-up clips. The second epoch's batches are the
        # first's again, and the history still holds their peaks: its
        # largest batch meets the scale its own amax set, clipped at most by
        # the float32 rounding of that scale.
        assert saturated.sum() >= STEPS - 2
        if flush_every_steps == 1:
            dated = [int(s) for s, n in zip(float8.steps, saturated, strict=True) if n]
            assert dated[:STEPS - 2] == list(range(3, STEPS + 1))
            assert np.nanmax(float8.state["peak_over_max"][STEPS:, 0, 0]) < 1 + 1e-6


def test_a_healthy_float8_fit_has_no_float8_finding_and_a_saturating_one_has_mp015(tmp_path,
                                                                                   capsys):
    found = {}
    for growth in (1.0, 4.0):
        log_dir = tmp_path / f"growth_{growth}"
        x, y = float8_data(growth)
        _profiled(log_dir, x, y)
        capsys.readouterr()
        assert cli.main(["diagnose", str(log_dir), "--format", "json"]) == 0
        found[growth] = [f for f in json.loads(capsys.readouterr().out)
                         if f["code"] in FLOAT8_CODES]
    assert found[1.0] == []
    assert [(f["code"], f["layer"]) for f in found[4.0]] == [("MP015", "f8/hidden")]
    inputs = found[4.0][0]["evidence"]["tensors"]["inputs"]
    assert inputs["saturated_steps"] == inputs["judged_steps"] == STEPS - 2
    assert inputs["worst_peak_over_format_max"] > diagnosis.SATURATION_FACTOR
    assert "filters=lambda layer: layer.name != 'hidden'" in found[4.0][0]["fix"]
    # The rules were judged from the records, not left "not measured".
    run = jax_runs.reader.read_run(str(tmp_path / "growth_1.0"), "train")
    checks = {c.code: c.status for c in diagnosis.evaluate(run).checks}
    assert {code: checks[code] for code in FLOAT8_CODES} == dict.fromkeys(FLOAT8_CODES,
                                                                          "checked")


def test_a_frozen_float8_layer_is_read_from_the_non_trainable_state_mp017(tmp_path):
    x, y = float8_data()
    _, run = _profiled(tmp_path, x, y, frozen=True)
    twin = _Twin(x, y, 1, frozen=True)
    np.testing.assert_array_equal(run.float8.state["scale"][-1], twin.at_step(STEPS)["scale"])
    found = [f for f in diagnosis.diagnose(run) if f.code in FLOAT8_CODES]
    assert [(f.code, f.layer) for f in found] == [("MP017", "f8/hidden")]
    assert found[0].evidence["tensors"]["inputs"]["problem"] == "amax history of zeros"
    # The head, still trained, has its amax.
    assert np.all(run.float8.state["amax_max"][-1, 1] > 0)


def test_steps_the_loss_scale_optimizer_skipped_are_left_out_of_the_replay(tmp_path):
    x, y = float8_data()
    _, run = _profiled(tmp_path, x, y, numerics_every=1, policy="mixed_float16")
    twin = _Twin(x, y, 1, policy="mixed_float16")
    skipped = run.loss_scale.skipped_steps
    assert skipped == STEPS - twin.updates_by_step[-1] > 0
    float8 = run.float8
    assert float8.policies == ["float8_from_mixed_float16", "float8_from_float32"]
    assert np.all(float8.state["steps"].sum(axis=0) == STEPS - skipped)
    since = 0
    for row, step in enumerate(float8.steps):
        np.testing.assert_array_equal(float8.state["scale"][row], twin.at_step(int(step))["scale"])
        for name, expected in twin.verdicts(since, int(step)).items():
            np.testing.assert_array_equal(float8.state[name][row], expected, err_msg=name)
        since = int(step)
    # The shares are measured on every sampled step, those skipped too (their
    # values are the step's, whatever the optimizer then did with them).
    assert run.context["collectors"]["float8_shares"] == {"state": "ok", "samples": STEPS - 1}
    assert list(float8.sample_steps) == list(range(1, STEPS))
    assert np.all(np.isfinite(float8.shares["saturated"]))
