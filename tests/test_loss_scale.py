"""Loss scale and overflow events against the optimizer's own state."""

import keras
import numpy as np
import pytest
from conftest import mnist_like, overflow_data, overflow_model, seed_model

import mpprof
from mpprof import reader, schema
from mpprof.collectors import loss_scale, loss_scale_growth


class _ScaleProbe(keras.callbacks.Callback):
    """Ground truth: the optimizer's scale and iterations after every batch."""

    def __init__(self):
        super().__init__()
        self.scales, self.iterations = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.scales.append(float(self.model.optimizer.dynamic_scale.numpy()))
        self.iterations.append(int(self.model.optimizer.iterations.numpy()))


def _reference(epochs=3):
    """Per-step truth from an unprofiled run with steps_per_execution=1."""
    keras.utils.set_random_seed(1)
    model = overflow_model(growth_steps=4)
    probe = _ScaleProbe()
    x, y = overflow_data()
    model.fit(x, y, batch_size=8, epochs=epochs, verbose=0, shuffle=False, callbacks=[probe])
    iterations = np.array(probe.iterations)
    skipped = np.flatnonzero(np.diff(np.concatenate([[0], iterations])) == 0)
    return np.array(probe.scales), skipped


@pytest.fixture(scope="module")
def reference():
    return _reference()


def _profiled(logdir, epochs=3, **compile_kwargs):
    keras.utils.set_random_seed(1)
    model = overflow_model(growth_steps=4, **compile_kwargs)
    x, y = overflow_data()
    model.fit(x, y, batch_size=8, epochs=epochs, verbose=0, shuffle=False,
              callbacks=[mpprof.MixedPrecisionProfiler(log_dir=str(logdir))])
    return model, reader.read_run(logdir, "train").loss_scale


@pytest.mark.parametrize(
    "compile_kwargs",
    [{}, {"steps_per_execution": 4}, {"jit_compile": True}],
    ids=["plain", "steps_per_execution=4", "jit_compile"],
)
def test_overflow_events_match_the_optimizer(tmp_path, reference, compile_kwargs):
    true_scales, true_skipped = reference
    model, recorded = _profiled(tmp_path, **compile_kwargs)
    steps = np.arange(len(true_scales))
    assert len(true_skipped) > 5 and recorded.steps_run == len(true_scales)
    np.testing.assert_array_equal(recorded.overflow_steps, true_skipped)
    np.testing.assert_array_equal(recorded.scale_after(steps), true_scales)
    assert recorded.skipped_steps == len(true_skipped)
    # The storm: every overflow halves the scale it found.
    np.testing.assert_array_equal(recorded.overflows[:, 2], recorded.overflows[:, 1] / 2)
    assert len(recorded.growths) > 0
    np.testing.assert_array_equal(recorded.growths[:, 2], recorded.growths[:, 1] * 2)
    assert recorded.final_scale == float(model.optimizer.dynamic_scale.numpy())
    assert recorded.initial_scale == 2.0**30
    expected_skips = len(true_skipped)
    assert recorded.steps_run - expected_skips == int(model.optimizer.iterations.numpy())


def test_gradient_accumulation_dates_every_train_step(tmp_path):
    """Under `gradient_accumulation_steps`, Keras' `iterations` counts
    updates (apply calls // N); the step axis still counts train steps."""
    def fit(callback):
        keras.utils.set_random_seed(1)
        model = overflow_model(growth_steps=3, gradient_accumulation_steps=4)
        x, y = overflow_data()
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False, callbacks=[callback])
        return model

    probe = _ScaleProbe()
    fit(probe)
    true_scales = np.array(probe.scales)
    halved = np.flatnonzero(np.diff(np.concatenate([[2.0**30], true_scales])) < 0)
    model = fit(mpprof.MixedPrecisionProfiler(log_dir=str(tmp_path)))
    run = reader.read_run(tmp_path, "train")
    recorded = run.loss_scale
    assert recorded.steps_run == len(true_scales) == 32
    assert len(halved) > 5
    np.testing.assert_array_equal(recorded.overflow_steps, halved)
    np.testing.assert_array_equal(recorded.scale_after(np.arange(32)), true_scales)
    assert len(recorded.growths) > 0
    assert recorded.final_scale == float(model.optimizer.dynamic_scale.numpy())


def test_second_fit_continues_the_step_axis(tmp_path, reference):
    true_scales, true_skipped = reference
    keras.utils.set_random_seed(1)
    model = overflow_model(growth_steps=4)
    x, y = overflow_data()
    profiler = mpprof.MixedPrecisionProfiler(log_dir=str(tmp_path))
    for _ in range(3):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[profiler])
    run = reader.read_run(tmp_path, "train")
    np.testing.assert_array_equal(run.loss_scale.overflow_steps, true_skipped)
    assert run.loss_scale.steps_run == len(true_scales)
    assert run.context["fit_count"] == 3
    assert run.context["start_step"] == 2 * len(true_scales) // 3


def test_host_fallback_when_private_hooks_are_missing(tmp_path, reference, monkeypatch):
    monkeypatch.setattr(loss_scale, "_FINITE", "_no_such_method")
    true_scales, true_skipped = reference
    _, recorded = _profiled(tmp_path)
    context = reader.read_run(tmp_path, "train").context
    assert context["collectors"]["loss_scale"]["mode"] == loss_scale.MODE_HOST
    np.testing.assert_array_equal(recorded.overflow_steps, true_skipped)
    np.testing.assert_array_equal(recorded.scale_after(np.arange(len(true_scales))), true_scales)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_runs_without_loss_scaling_record_no_loss_scale(tmp_path, policy):
    model = seed_model(policy)
    x, y = mnist_like(64)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0,
              callbacks=[mpprof.MixedPrecisionProfiler(log_dir=str(tmp_path))])
    run = reader.read_run(tmp_path, "train")
    assert run.loss_scale is None
    assert run.context["collectors"]["loss_scale"]["state"] == "absent"
    assert run.context["model_policy"] == policy
    assert len(run.inventory["layers"]) == 2


def test_growth_events_follow_from_the_overflows():
    state = loss_scale_growth.ScaleState
    # growth every 3 finite steps; counter 1 at step 10, scale 8.
    overflows = np.array([[14.0, 16.0], [15.0, 8.0]])
    events, consistent = loss_scale_growth.growth_events(
        state(10, 1, 8.0), overflows, state(22, 0, 16.0), growth_steps=3)
    assert consistent
    growth, overflow = schema.EVENT_GROWTH, schema.EVENT_OVERFLOW
    np.testing.assert_array_equal(events, [
        [11, 8, 16, growth],   # the step finding the counter at 2
        [14, 16, 8, overflow],
        [15, 8, 4, overflow],
        [18, 4, 8, growth],    # three finite steps after the overflow
        [21, 8, 16, growth],
    ])
    # An overflow that does not find the derived scale, or an end state the
    # derivation does not reach: no growth is made up.
    for overflows, end in ((np.array([[14.0, 32.0]]), state(22, 0, 16.0)),
                           (np.empty((0, 2)), state(22, 0, 64.0))):
        events, consistent = loss_scale_growth.growth_events(
            state(10, 1, 8.0), overflows, end, growth_steps=3)
        assert not consistent
        assert (events[:, schema.LOSS_SCALE_EVENT_COLUMN.kind] == overflow).all()


class _ScaleSetter(keras.callbacks.Callback):
    """User code that sets the loss scale itself, mid-epoch."""

    def on_train_batch_end(self, batch, logs=None):
        if batch == 6:
            self.model.optimizer.dynamic_scale.assign(2.0**10)


def test_a_scale_changed_from_outside_makes_no_growth_up(tmp_path, reference):
    keras.utils.set_random_seed(1)
    model = overflow_model(growth_steps=4)
    x, y = overflow_data()
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False,
              callbacks=[_ScaleSetter(), mpprof.MixedPrecisionProfiler(log_dir=str(tmp_path))])
    run = reader.read_run(tmp_path, "train")
    settings = run.context["collectors"]["loss_scale"]
    assert settings["growth_events_missing_between_steps"], settings
    # Every growth that is recorded doubles the scale it found, and none
    # falls inside a window that could not be derived.
    growths = run.loss_scale.growths
    np.testing.assert_array_equal(growths[:, 2], growths[:, 1] * 2)
    for start, end in settings["growth_events_missing_between_steps"]:
        assert not ((growths[:, 0] >= start) & (growths[:, 0] < end)).any()
    assert run.loss_scale.final_scale == float(model.optimizer.dynamic_scale.numpy())
