"""Numerics samples: taken by `NumericsCollector`, batched here for writing.

The collector's tables are read once per sampled call; the rows wait on the
host and are written as one [samples, ...] array per record at flush points
(one write per record instead of one per sample).
"""

from __future__ import annotations

import numpy as np

from mpprof import schema

# Samples waiting for the next flush, at most.
MAX_PENDING_SAMPLES = 64


class NumericsSamples:
    """Turns the collector's readings into NUMERICS_* records.

    Args:
        collector: the model's `NumericsCollector`.
        policy_max: the largest finite value of the model's compute dtype.
    """

    def __init__(self, collector, policy_max: float):
        self.collector = collector
        self._policy_max = policy_max
        self._pending: list[dict[str, np.ndarray]] = []
        self._layout_written = None

    def take(self, writer, *, step: int, steps: int, loss: float, scale: float,
             forensic: bool) -> None:
        """Reads the sample the last call recorded (`steps` steps from `step`)."""
        sample = self.collector.read()
        sample.pop("loss", None)  # the loss comes from the health watchers
        layout = self.collector.layout(self._policy_max)
        if layout != self._layout_written:
            self.write(writer)  # samples of the old layout go first
            writer.write_json(schema.NUMERICS_LAYOUT, layout, step)
            self._layout_written = layout
        sample[schema.NUMERICS_STEP] = np.array([step, loss, scale, float(forensic), steps])
        self._pending.append(sample)
        if len(self._pending) >= MAX_PENDING_SAMPLES:
            self.write(writer)

    def write(self, writer) -> None:
        """Writes the pending samples, each record as one [samples, ...] array."""
        if not self._pending:
            return
        samples, self._pending = self._pending, []
        step = int(samples[0][schema.NUMERICS_STEP][0])
        for record in samples[0]:
            writer.write_array(record, np.stack([s[record] for s in samples]), step)
