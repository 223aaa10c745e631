"""Loss scale and overflow events against the optimizer's own state."""

import keras
import numpy as np
import pytest
from conftest import ScaleProbe, mnist_like, overflow_data, overflow_model, seed_model

import mpprof
from mpprof.backends import loss_scale_growth, step_origin
from mpprof.backends.tensorflow import loss_scale_series as loss_scale
from mpprof.records import reader, run_context, schema


def _reference(epochs=3):
    """Per-step truth from an unprofiled run with steps_per_execution=1."""
    keras.utils.set_random_seed(1)
    model = overflow_model(growth_steps=4)
    probe = ScaleProbe()
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

    probe = ScaleProbe()
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


def test_a_new_profiler_continues_the_run_it_finds(tmp_path, reference):
    """A new profiler per fit, same log_dir: Keras 3's apply calls leave out
    the skipped steps the earlier profilers counted; the run's records carry
    them over, so the axis goes on as with one profiler."""
    true_scales, true_skipped = reference
    keras.utils.set_random_seed(1)
    model = overflow_model(growth_steps=4)
    x, y = overflow_data()
    for epoch in range(3):
        model.fit(x, y, batch_size=8, epochs=epoch + 1, initial_epoch=epoch, verbose=0,
                  shuffle=False, callbacks=[mpprof.MixedPrecisionProfiler(log_dir=str(tmp_path))])
    run = reader.read_run(tmp_path, "train")
    steps_per_fit = len(true_scales) // 3
    assert any(true_skipped >= steps_per_fit)  # later fits overflow too
    np.testing.assert_array_equal(run.loss_scale.overflow_steps, true_skipped)
    assert run.loss_scale.steps_run == len(true_scales)
    column = schema.LOSS_SCALE_PROGRESS_COLUMN
    counts = run.loss_scale.progress[:, [column.steps_run, column.skipped_steps]]
    assert (np.diff(counts, axis=0) >= 0).all(), counts
    origin = run.context["collectors"]["loss_scale"]["step_axis_origin"]
    assert origin["skipped_before"] == np.sum(true_skipped < 2 * steps_per_fit), origin
    assert "continues the records of 'optimizer'" in origin["evidence"]
    assert run.context["start_step"] == 2 * steps_per_fit


def _unknown_origin(run) -> str:
    origin = run.context["collectors"]["loss_scale"]["step_axis_origin"]
    assert origin["skipped_before"] is None, origin
    assert "early by the steps skipped before" in origin["evidence"]
    return origin["evidence"]


@pytest.mark.parametrize("between", ["fit_without_mpprof", "another_log_dir"])
def test_a_new_profiler_never_guesses_the_skips_before_it(tmp_path, between):
    """Records that are not this optimizer's as it is now (steps ran without
    mpprof since), or none (a new log_dir): the skipped steps before the fit
    are unknown, and the run context says so instead of continuing."""
    keras.utils.set_random_seed(1)
    model = overflow_model(growth_steps=4)
    x, y = overflow_data()

    def fit(callbacks):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=callbacks)

    fit([mpprof.MixedPrecisionProfiler(log_dir=str(tmp_path / "first"))])
    log_dir = tmp_path / "first"
    if between == "fit_without_mpprof":
        fit([])
    else:
        log_dir = tmp_path / "second"
    applied = int(model.optimizer.iterations.numpy())
    fit([mpprof.MixedPrecisionProfiler(log_dir=str(log_dir))])
    run = reader.read_run(log_dir, "train")
    evidence = _unknown_origin(run)
    assert ("not this optimizer's" if between == "fit_without_mpprof"
            else "no earlier mpprof records") in evidence, evidence
    # The axis starts at the apply calls: no skipped step is made up.
    assert run.context["start_step"] == applied


def test_earlier_records_that_cannot_be_read_leave_the_skips_unknown(tmp_path, monkeypatch):
    """Reading the log_dir never fails the fit, nor its loss-scale records."""
    keras.utils.set_random_seed(1)
    model = overflow_model(growth_steps=4)
    x, y = overflow_data()
    for denied in (False, True):
        if denied:
            monkeypatch.setattr(step_origin, "read_event_file", _denied)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False,
                  callbacks=[mpprof.MixedPrecisionProfiler(log_dir=str(tmp_path))])
    monkeypatch.undo()
    run = reader.read_run(tmp_path, "train")
    assert "PermissionError: denied" in _unknown_origin(run)
    assert run.context["fit_state"] == run_context.FIT_ENDED
    assert run.context["collectors"]["loss_scale"]["state"] == "ok"


def _denied(*args):
    raise PermissionError("denied")


def test_a_new_model_starts_at_step_0_beside_old_records(tmp_path):
    """The look-alike: a fresh model into a log_dir holding another model's
    records ran no step before, whatever those records say."""
    x, y = overflow_data()
    for _ in range(2):
        keras.utils.set_random_seed(1)
        model = overflow_model(growth_steps=4)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False,
                  callbacks=[mpprof.MixedPrecisionProfiler(log_dir=str(tmp_path))])
    context = reader.read_run(tmp_path, "train").context
    assert context["start_step"] == 0
    assert context["collectors"]["loss_scale"]["step_axis_origin"] == {
        "skipped_before": 0, "evidence": "no train step ran before the first profiled fit"}


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
