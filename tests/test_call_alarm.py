"""The alarm each train-function call returns: which call had trouble."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from batch_logs import BatchLogs
from conftest import overflow_data, overflow_model

import mpprof
from mpprof.backends.tensorflow.call_alarm import CallAlarm
from mpprof.records import reader


def _alarm(host_reads_needed=True):
    skipped = tf.Variable(0, dtype=tf.int64)
    nonfinite = tf.Variable(0, dtype=tf.int64)
    alarm = CallAlarm(lambda: [skipped, nonfinite], lambda: host_reads_needed)
    alarm.install(model=None, patches=None, in_logs=False)
    return alarm, skipped, nonfinite


def test_waiting_it_names_the_call_at_once_and_only_when_a_count_moved():
    alarm, skipped, nonfinite = _alarm()
    assert alarm.hold(alarm.tensor(), 0, 0, wait=True) == []
    skipped.assign_add(1)
    assert alarm.hold(alarm.tensor(), 1, 1, wait=True) == [(1, 1)]
    assert alarm.hold(alarm.tensor(), 2, 2, wait=True) == []
    nonfinite.assign_add(1)
    assert alarm.hold(alarm.tensor(), 3, 6, wait=True) == [(3, 6)]


def test_one_call_late_it_still_names_the_right_call_and_a_flush_drains_it():
    alarm, skipped, _ = _alarm()
    skipped.assign_add(1)
    assert alarm.hold(alarm.tensor(), 0, 0, wait=False) == []  # not read yet
    assert alarm.hold(alarm.tensor(), 1, 1, wait=False) == [(0, 0)]
    skipped.assign_add(1)
    assert alarm.hold(alarm.tensor(), 2, 2, wait=False) == []
    assert alarm.drain() == (2, 2)
    assert alarm.drain() is None


def test_past_what_float32_holds_exactly_every_change_still_rings():
    alarm, skipped, _ = _alarm()
    skipped.assign(2**24 - 1)
    assert alarm.hold(alarm.tensor(), 0, 0, wait=True) == [(0, 0)]
    for step in range(1, 4):  # 2**24, 2**24 + 1, ...: float32 would round them
        skipped.assign_add(1)
        assert alarm.hold(alarm.tensor(), step, step, wait=True) == [(step, step)]


def test_without_an_alarm_in_the_logs_the_host_reads_the_counters_only_if_needed():
    alarm, skipped, _ = _alarm(host_reads_needed=True)
    skipped.assign_add(1)
    assert alarm.hold(None, 0, 0, wait=True) == [(0, 0)]
    quiet, skipped, _ = _alarm(host_reads_needed=False)
    skipped.assign_add(1)
    assert quiet.hold(None, 0, 0, wait=True) == []


def test_with_no_counter_there_is_no_alarm():
    alarm = CallAlarm(lambda: [], lambda: True)
    alarm.install(model=None, patches=None, in_logs=True)  # patches nothing
    assert alarm.hold(None, 0, 0, wait=True) == []


# Logs a custom train step may return, for its loss.
_LOG_LAYOUTS = {
    "the loss": lambda loss: {"loss": loss},
    "another float32 scalar": lambda loss: {"count": tf.constant(1), "mse": loss},
    "no float32 scalar": lambda loss: {"loss": tf.cast(loss, "float16"),
                                       "count": tf.constant(1)},
    "a vector": lambda loss: {"losses": tf.stack([loss, 2 * loss])},
}


class _CustomLogs(keras.Model):
    """A custom train step (its loss watched through `scale_loss`) whose logs
    take one of `_LOG_LAYOUTS`."""

    def __init__(self, layout: str, **kwargs):
        super().__init__(**kwargs)
        self.layout = layout
        self.dense = keras.layers.Dense(1, name="dense")

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(self(x, training=True) - y))
            scaled = self.optimizer.scale_loss(loss)
        gradients = tape.gradient(scaled, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        return _LOG_LAYOUTS[self.layout](loss)


@pytest.mark.parametrize("layout", list(_LOG_LAYOUTS))
def test_callbacks_see_the_step_s_own_logs_and_the_alarm_still_dates_the_loss(
        tmp_path, layout):
    """Whatever logs a custom step returns, Keras and every callback see them
    as in a fit without mpprof (the alarm taken out), and the alarm dates the
    first non-finite loss to its step."""
    rng = np.random.default_rng(0)
    x = rng.random((48, 4), dtype=np.float32)
    y = rng.random((48, 1), dtype=np.float32)
    x[2 * 8 + 3, 1] = np.nan  # in the batch of step 2
    seen = {}
    for profiled in (False, True):
        keras.utils.set_random_seed(0)
        model = _CustomLogs(layout, name="custom_logs")
        model.compile(optimizer=keras.optimizers.SGD(0.01))
        batch_logs = BatchLogs()
        profilers = [mpprof.MixedPrecisionProfiler(str(tmp_path))] if profiled else []
        history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False,
                            callbacks=[*profilers, batch_logs])
        seen[profiled] = (batch_logs.seen, history.history)
    np.testing.assert_equal(seen[True], seen[False])
    assert len(seen[True][0]) == 12
    health = reader.read_run(tmp_path, "train").health
    assert health["first_nonfinite_loss_step"] == health["first_nonfinite_loss_step_last"] == 2


def test_under_loss_scaling_callbacks_see_plain_logs_and_the_alarm_arms_forensics(tmp_path):
    """Keras' own train step: the logs every callback sees equal a fit
    without mpprof, and each overflow's alarm arms a forensic sample of the
    next step."""
    x, y = overflow_data(64)
    seen = {}
    for profiled in (False, True):
        keras.utils.set_random_seed(0)
        model = overflow_model(growth_steps=4)
        batch_logs = BatchLogs()
        profilers = ([mpprof.MixedPrecisionProfiler(str(tmp_path), numerics_every=1000,
                                                    forensic_budget=2, forensic_spacing=1)]
                     if profiled else [])
        history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False,
                            callbacks=[*profilers, batch_logs])
        seen[profiled] = (batch_logs.seen, history.history)
    assert seen[True] == seen[False]
    assert all(list(logs) == ["loss"] and isinstance(logs["loss"], float)
               for logs in seen[True][0])
    run = reader.read_run(tmp_path, "train")
    assert set(run.numerics.steps) <= set(run.loss_scale.overflow_steps + 1)
    assert run.context["collectors"]["numerics"]["forensic_used"] == 2
