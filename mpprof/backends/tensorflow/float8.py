"""The float8 layers' delayed scaling on TensorFlow: scales, amax history,
clipping.

At each flush the collector reads every scale and history in one batched
read (a `tf.function`), and `mpprof.backends.float8_replay` replays the steps
since the previous read with Keras' scale rule. Under a distribution
strategy whose replicas keep their own amax histories, each replica's latest
amax and history maximum are recorded too (FLOAT8_REPLICAS).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from mpprof.backends.float8_replay import DelayedScalingState
from mpprof.backends.patching import Patches
from mpprof.records import schema


class Float8State(DelayedScalingState):
    """Records the float8 layers' scales and amax histories at each flush.

    Args: as `mpprof.backends.float8_replay.DelayedScalingState`.
    """

    def __init__(self, model, loss_scales):
        super().__init__(model, loss_scales)
        # Each replica's amax history, where replicas keep their own.
        self._replica_histories = [
            _replicas(history) for _, history in self._variables
        ] if self._variables else []
        self._replica_count = len(self._replica_histories[0]) if self._replica_histories else 1
        self._aggregation = _aggregation(self._variables[0][1]) if self._variables else None
        self._read_all = None

    def install(self, fit, patches: Patches) -> None:
        if not self._layers:
            return
        variables = self._variables

        @tf.function(autograph=False)
        def read_all():
            # One device read: each tensor's scale followed by its history.
            parts = []
            for scale, history in variables:
                parts += [tf.reshape(tf.cast(scale, tf.float64), [1]),
                          tf.cast(tf.reshape(history, [-1]), tf.float64)]
            return tf.concat(parts, axis=0)

        self._read_all = read_all
        if self._replica_count > 1:
            replica_histories = self._replica_histories

            @tf.function(autograph=False)
            def read_replicas():
                # [tensors, replicas, 2]: each replica's latest amax and history max.
                return tf.stack([
                    tf.stack([tf.stack([history[0], tf.reduce_max(history)]) for history in rows])
                    for rows in replica_histories
                ])

            self._read_replicas = read_replicas
        self._start(fit)

    def _read(self) -> list[tuple[float, np.ndarray]]:
        """(scale, amax history) per layer and tensor, in layout order."""
        flat = self._read_all().numpy()
        found, offset = [], 0
        for _, history in self._variables:
            length = int(history.shape[0])
            found.append((float(flat[offset]), flat[offset + 1: offset + 1 + length]))
            offset += 1 + length
        return found

    def _write_replicas(self, fit) -> None:
        if self._replica_count > 1:
            fit.writer.write_array(schema.FLOAT8_REPLICAS, self._replica_spread(), fit.step)

    def _replica_spread(self) -> np.ndarray:
        """The FLOAT8_REPLICAS rows: [layers, tensors, FLOAT8_REPLICA_COLUMNS]."""
        values = self._read_replicas().numpy().astype(np.float64)  # [cells, replicas, 2]
        rows = np.stack([
            np.full(len(values), float(self._replica_count)),
            values[:, :, 0].min(axis=1), values[:, :, 0].max(axis=1),
            values[:, :, 1].min(axis=1), values[:, :, 1].max(axis=1),
        ], axis=1)
        return rows.reshape(len(self._layers), len(schema.FLOAT8_TENSORS), -1)

    def amax_across_replicas(self) -> str | None:
        """How the replicas' amax histories relate (None with one replica):
        "per replica" where each keeps its own (aggregation "none": nothing
        reduces them), else the reduction the variables' aggregation makes
        ("mean", "sum", "first replica")."""
        if self._replica_count <= 1:
            return None
        return _AGGREGATIONS.get(self._aggregation, str(self._aggregation))


# The tf.VariableAggregation of a distributed float8 variable, as the layout
# and run context say how the replicas' amax histories relate.
_AGGREGATIONS = {
    tf.VariableAggregation.NONE: "per replica",
    tf.VariableAggregation.MEAN: "mean",
    tf.VariableAggregation.SUM: "sum",
    tf.VariableAggregation.ONLY_FIRST_REPLICA: "first replica",
}


def _tf_variable(variable):
    """The TensorFlow variable behind a Keras variable (itself otherwise)."""
    return variable if isinstance(variable, tf.Variable) else variable.value


def _replicas(variable) -> list:
    """The per-replica components of a distributed variable ([it] otherwise)."""
    found = _tf_variable(variable)
    values = getattr(found, "values", None)
    return list(values) if isinstance(values, tuple) and values else [found]


def _aggregation(variable):
    return getattr(_tf_variable(variable), "aggregation", None)
