"""The JAX call alarm: read only once done, the newest done one only, and at
most every LOOK_INTERVAL_S on quiet calls (it only arms forensic samples)."""

import numpy as np

from mpprof.backends.jax import call_alarm
from mpprof.backends.jax.call_alarm import CallAlarm


class _Alarm:
    """A jax.Array's stand-in: a running count, done or not, reads counted."""

    reads = 0

    def __init__(self, value: float, done: bool = True):
        self.value, self.done = value, done

    def is_ready(self) -> bool:
        return self.done

    def __array__(self, dtype=None, copy=None):
        _Alarm.reads += 1
        return np.asarray(self.value, dtype)


def _alarm() -> CallAlarm:
    alarm = CallAlarm(lambda: [], lambda: False)
    alarm.install(model=None, patches=None, in_logs=False)
    return alarm


def test_the_newest_done_alarm_says_whether_any_call_since_the_last_look_rang():
    alarm = _alarm()
    assert alarm.hold(_Alarm(0), 0, 0, wait=False) == []  # sets the baseline
    _Alarm.reads = 0
    for count in (0, 1, 1):  # the call of step 2 overflowed
        assert alarm.unchanged(_Alarm(count, done=False))
    assert _Alarm.reads == 0  # not done: never waited for
    for pending in alarm._pending:
        pending.done = True
    # One read (the newest done), the older ones dropped, the steps since the
    # last report given (the step dates the overflow itself).
    assert alarm.hold(_Alarm(1, done=False), 4, 4, wait=False) == [(0, 4)]
    assert _Alarm.reads == 1 and len(alarm._pending) == 1
    assert alarm.hold(_Alarm(1), 5, 5, wait=False) == []
    assert alarm.drain() is None and not alarm._pending


def test_a_ring_is_reported_once_over_the_steps_since_the_last_report():
    alarm = _alarm()
    assert alarm.hold(_Alarm(0), 0, 0, wait=False) == []
    assert alarm.hold(_Alarm(2), 1, 3, wait=False) == [(0, 3)]
    assert alarm.hold(_Alarm(2), 4, 4, wait=False) == []
    assert alarm.hold(_Alarm(3, done=False), 5, 5, wait=False) == []
    assert alarm.drain() == (4, 4)  # waits for every pending one
    assert alarm.drain() is None


def test_quiet_calls_look_at_most_every_interval(monkeypatch):
    alarm = _alarm()
    assert alarm.hold(_Alarm(0), 0, 0, wait=False) == []
    monkeypatch.setattr(call_alarm, "LOOK_INTERVAL_S", 3600.0)
    assert alarm.unchanged(_Alarm(0))  # looks: the first look is due at once
    _Alarm.reads = 0
    for _ in range(10):
        assert alarm.unchanged(_Alarm(1))  # rang, not looked at yet
    assert _Alarm.reads == 0 and len(alarm._pending) == 10
    alarm._next_look = 0.0
    assert not alarm.unchanged(_Alarm(1))  # one read says it
    assert _Alarm.reads == 1 and not alarm._pending


def test_too_many_pending_alarms_wait_for_one():
    alarm = _alarm()
    assert alarm.hold(_Alarm(0), 0, 0, wait=False) == []
    for _ in range(call_alarm.MAX_PENDING):
        alarm.unchanged(_Alarm(0, done=False))
    _Alarm.reads = 0
    alarm.unchanged(_Alarm(1, done=False))
    # The oldest past the limit is read (waited for), the rest kept.
    assert _Alarm.reads == 1 and len(alarm._pending) == call_alarm.MAX_PENDING


def test_the_newest_done_of_many_pending_is_found_without_asking_each():
    alarm = _alarm()
    assert alarm.hold(_Alarm(0), 0, 0, wait=False) == []
    asked = []

    class Counted(_Alarm):
        def is_ready(self):
            asked.append(self)
            return self.done

    pending = [Counted(1 if i >= 30 else 0, done=i < 40) for i in range(60)]
    alarm._pending.extend(pending)
    assert alarm.hold(None, 1, 60, wait=False) == [(0, 60)]
    assert alarm._pending == pending[40:]  # the done ones read (the newest) and dropped
    assert len(asked) <= 8


def test_an_overflow_in_the_very_first_call_rings():
    """The count the fit started from is known at install: the first alarm
    read is compared with it, so a lone overflow in the first call arms a
    forensic sample (it set the baseline, and was missed, before)."""
    alarm = CallAlarm(lambda: [], lambda: False, start=lambda: 3)
    alarm.install(model=None, patches=None, in_logs=False)
    assert alarm.hold(_Alarm(4), 0, 0, wait=False) == [(0, 0)]
    assert alarm.hold(_Alarm(4), 1, 1, wait=False) == []
    calm = CallAlarm(lambda: [], lambda: False, start=lambda: 3)
    calm.install(model=None, patches=None, in_logs=False)
    assert calm.hold(_Alarm(3), 0, 0, wait=False) == []
