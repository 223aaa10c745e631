"""The alarm each train-function call returns: which call had trouble."""

import tensorflow as tf

from mpprof.call_alarm import CallAlarm


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
