"""Whether a train-function call had trouble: a skipped step or a non-finite loss.

The Keras 3 train step adds one number to its logs, the alarm: the steps
skipped by every loss-scale series plus the steps whose loss was non-finite
by every watched optimizer. The host compares each call's alarm with the one
before, as the call returns: on a GPU that waits for the step, but Keras 3
on TensorFlow waits for it too, since its callback list turns every call's
logs into Python numbers before the next call (whatever `verbose`). Only
when the alarm changed does the host read the counters behind it, to date
the first non-finite loss (to the call, so to the step when a call runs one)
and to arm a forensic sample.

tf-keras's train step, or one whose logs are not a dict, reports no alarm;
the host then reads the counters after each call while that is needed. As
tf-keras need not wait for a step's logs, it reads them one call late (call
k's counters once call k+1 is queued) unless an overflow could still arm a
forensic sample of the next call.

The alarm is a float32, the count modulo 2**24 (which float32 holds
exactly): an output costs Keras' train function 15 to 20 us a call on
TensorFlow 2.21's CPU executor, and an int64 one read no cheaper (seed
model, each variant's step timed one at a time in shuffled order).
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from mpprof.backends.base import ALARM_LOGS_KEY
from mpprof.backends.patching import Patches

_MODULUS = 2**24


class CallAlarm:
    """The train step's alarm, read when its call returns or one call late.

    Args:
        counters: returns the in-graph counters the alarm sums (variables;
            asked when the step is traced and on host reads).
        host_reads_needed: returns whether, without an alarm in the logs,
            the host should read the counters after each call.

    Example:

    ```python
    alarm = CallAlarm(lambda: [skipped, nonfinite_losses], lambda: True)
    alarm.install(model, patches, in_logs=True)
    logs = model.train_function(iterator)
    for first_step, last_step in alarm.hold(logs.pop(ALARM_LOGS_KEY, None), 0, 0, wait=True):
        ...  # those steps skipped or had a non-finite loss
    ```
    """

    def __init__(self, counters: Callable[[], list], host_reads_needed: Callable[[], bool]):
        self._counters = counters
        self._host_reads_needed = host_reads_needed
        self._seen: float | None = None
        self._pending: tuple[object, int, int] | None = None

    def install(self, model, patches: Patches, in_logs: bool) -> None:
        """Takes the counters' current value; with `in_logs`, makes
        `model.train_step` report the alarm (undone by `patches.restore`)."""
        if not self._counters():
            return
        self._seen = float(self.tensor())
        if not in_logs:
            return
        train_step = model.train_step

        def train_step_reporting_alarm(data):
            logs = train_step(data)
            if not isinstance(logs, dict):
                return logs
            return {**logs, ALARM_LOGS_KEY: self.tensor()}

        patches.set(model, "train_step", train_step_reporting_alarm)

    def tensor(self) -> tf.Tensor:
        """The alarm: in-graph when traced, else read now."""
        counters = [tf.convert_to_tensor(c) for c in self._counters()]
        total = counters[0] if len(counters) == 1 else tf.add_n(counters)
        return tf.cast(tf.math.floormod(total, _MODULUS), tf.float32)

    def unchanged(self, value) -> bool:
        """Whether a call whose logs held the alarm `value` (None: none)
        surely had no trouble: its alarm is the one last seen, or there are
        no counters. The quick check of a call with nothing else to do; any
        other call goes through `hold`."""
        if value is None:
            return self._seen is None
        return float(value) == self._seen

    def hold(self, value, first_step: int, last_step: int, *,
             wait: bool) -> list[tuple[int, int]]:
        """Keeps the alarm of the call just made (steps `first_step` to
        `last_step`; None when its logs held none) and examines the one
        before, and with `wait` this one too: returns the steps of each call
        whose alarm rang."""
        rang = [self._examine(self._pending)]
        self._pending = (value, first_step, last_step)
        if wait:
            rang.append(self.drain())
        return [steps for steps in rang if steps is not None]

    def drain(self) -> tuple[int, int] | None:
        """Examines the last call's alarm now (before a flush); returns its
        steps when it rang."""
        pending, self._pending = self._pending, None
        return self._examine(pending)

    def _examine(self, held) -> tuple[int, int] | None:
        if held is None or self._seen is None:
            return None
        value, first_step, last_step = held
        if value is None:
            if not self._host_reads_needed():
                return None
            value = self.tensor()
        value = float(value)
        if value == self._seen:
            return None
        self._seen = value
        return first_step, last_step
