"""Per-layer activation and gradient statistics on sampled train steps.

A `LayerCallPatch` hook. While the instrumented train function is traced
(`instrumenting` is True), every leaf layer's output gets statistics ops that
add into device-side tables, and an identity with a custom gradient does the
same for the gradient flowing into that output. The plain train function is
traced with `instrumenting` False and carries none of this, so steps that are
not sampled cost nothing. The host resets the tables before a sampled call and
reads them after it: one device-to-host copy per sample.

A layer called several times in a step (a shared layer, or several steps in
one execution with `steps_per_execution > 1`) is aggregated: counts add up and
the abs-max is the maximum.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from mpprof import schema
from mpprof.collectors.layer_calls import walk_layers
from mpprof.tf_keras_support import variable_path

_SMALLEST_NORMAL = schema.FLOAT16_SMALLEST_NORMAL
_SMALLEST_SUBNORMAL = schema.FLOAT16_SMALLEST_SUBNORMAL
_EDGES = np.asarray(schema.NUMERICS_HIST_EDGES, dtype=np.float32)


def tensor_statistics(
    tensor: tf.Tensor, with_histogram: bool = True
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor | None]:
    """Counts (`schema.NUMERICS_COUNT_COLUMNS`), finite abs-max and log2 histogram.

    Computed in float32 so that float16 values are measured, not re-rounded.
    """
    if with_histogram:
        return _statistics_with_histogram(tensor)
    return (*_statistics(tensor), None)


# XLA fuses the dozen element-wise passes below into one: without it they
# cost as much as the layer itself on large activations. Static shapes
# throughout (no boolean_mask, no bincount) so that it compiles.
@tf.function(jit_compile=True, autograph=False)
def _statistics_with_histogram(tensor):
    return _compute_statistics(tensor, True)


@tf.function(jit_compile=True, autograph=False)
def _statistics(tensor):
    return _compute_statistics(tensor, False)[:2]


def _compute_statistics(tensor, with_histogram):
    # Compared in the tensor's own dtype (no float32 copy of a large tensor);
    # both thresholds are exact in float16 and bfloat16.
    values = tf.reshape(tensor, [-1])
    magnitude = tf.abs(values)
    finite = tf.math.is_finite(values)
    nonzero = tf.logical_and(finite, magnitude > 0)
    counts = tf.stack([
        tf.cast(tf.size(values), tf.float32),
        _count(tf.logical_not(finite)),
        _count(tf.equal(values, 0)),
        _count(tf.logical_and(nonzero, magnitude < tf.cast(_SMALLEST_NORMAL, values.dtype))),
        _count(tf.logical_and(nonzero, magnitude < tf.cast(_SMALLEST_SUBNORMAL, values.dtype))),
    ])
    abs_max = tf.cast(tf.reduce_max(tf.where(finite, magnitude, tf.zeros_like(magnitude))),
                      tf.float32)
    if not with_histogram:
        return counts, abs_max, None
    # The histogram only shows where values sit: it is estimated from at most
    # _HISTOGRAM_VALUES evenly spaced values, each counting for `stride`.
    stride = tf.maximum(1, tf.size(values) // _HISTOGRAM_VALUES)
    sampled = tf.cast(values[::stride], tf.float32)
    sampled_nonzero = tf.logical_and(tf.math.is_finite(sampled), sampled != 0)
    bins = tf.clip_by_value((_binary_exponent(sampled) - _FIRST_EDGE) // 2 + 1, 0, _BINS - 1)
    histogram = tf.math.unsorted_segment_sum(
        tf.cast(sampled_nonzero, tf.float32), bins, num_segments=_BINS
    ) * tf.cast(stride, tf.float32)
    return counts, abs_max, histogram


# Histogram bins: edges 2 binades apart, so a value's bin follows from its
# binary exponent alone (integer ops, far cheaper than a log and a search).
_BINS = len(_EDGES) + 1
_FIRST_EDGE = schema.NUMERICS_HIST_EDGES[0]
_HISTOGRAM_VALUES = 2**16


def _binary_exponent(values: tf.Tensor) -> tf.Tensor:
    """floor(log2|v|) of float32 values, from their exponent bits."""
    bits = tf.bitwise.right_shift(tf.bitcast(values, tf.int32), 23)
    return tf.bitwise.bitwise_and(bits, 0xFF) - 127


def _count(mask: tf.Tensor) -> tf.Tensor:
    return tf.reduce_sum(tf.cast(mask, tf.float32))


class StatisticsTable:
    """Device-side statistics of `rows` tensors, aggregated until drained.

    One variable holds, per row, the counts, the abs-max and (optionally) the
    histogram, so one read brings a whole table to the host.

    Args:
        rows: how many tensors (layers or variables) the table holds.
        name: variable name.
        with_histogram: whether to keep the log2 histogram too.
    """

    def __init__(self, rows: int, name: str, with_histogram: bool = True):
        self.rows = rows
        self.with_histogram = with_histogram
        self.columns = len(schema.NUMERICS_STAT_COLUMNS) + (_BINS if with_histogram else 0)
        self.table = tf.Variable(
            tf.zeros((rows, self.columns)), trainable=False, name=f"mpprof_{name}"
        )

    def record(self, row: int, tensor: tf.Tensor) -> None:
        counts, abs_max, histogram = tensor_statistics(tensor, self.with_histogram)
        sums = counts if histogram is None else tf.concat([counts, histogram], 0)
        context = tf.distribute.get_replica_context()
        if context is not None and context.num_replicas_in_sync > 1:
            # MirroredStrategy all-reduces only SUM and MEAN: the maximum is
            # taken from a sum of one-hot vectors, one slot per replica.
            per_replica_max = abs_max * tf.one_hot(
                context.replica_id_in_sync_group, context.num_replicas_in_sync
            )
            sums, per_replica_max = context.all_reduce(
                tf.distribute.ReduceOp.SUM, [sums, per_replica_max]
            )
            abs_max = tf.reduce_max(per_replica_max)
        # One-hot updates instead of scatter ops: XLA has no ResourceScatterNdMax.
        one_hot = tf.one_hot(row, self.rows)[:, None]
        count_columns = len(schema.NUMERICS_COUNT_COLUMNS)
        table = self.table
        self.table.assign(tf.concat([
            table[:, :count_columns] + one_hot * sums[None, :count_columns],
            tf.maximum(table[:, count_columns:count_columns + 1], one_hot * abs_max),
            table[:, count_columns + 1:] + one_hot * sums[None, count_columns:],
        ], axis=1))

    def split(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """A read table as ([rows, NUMERICS_STAT_COLUMNS], [rows, bins] or None)."""
        stats_columns = len(schema.NUMERICS_STAT_COLUMNS)
        histogram = values[:, stats_columns:] if self.with_histogram else None
        return values[:, :stats_columns], histogram


class NumericsCollector:
    """Per-layer forward/backward and per-variable gradient statistics.

    Args:
        model: the built model.
        strategy: the model's distribution strategy (tables live in its scope).
    """

    def __init__(self, model, strategy):
        self.instrumenting = False
        self._model = model
        leaves = [
            (name, layer) for name, layer, _ in walk_layers(model)
            # list(): tf-keras returns a generator, Keras 3 a list.
            if not list(layer._flatten_layers(include_self=False, recursive=False))
        ]
        self.layer_names = [name for name, _ in leaves]
        self._rows = {id(layer): row for row, (_, layer) in enumerate(leaves)}
        self._call_order: list[int] = []
        self._variables = list(model.trainable_variables)
        self.variable_names = [variable_path(v) for v in self._variables]
        self._variable_rows = {id(v): row for row, v in enumerate(self._variables)}
        with strategy.scope():
            self.forward = StatisticsTable(len(leaves), "forward")
            self.backward = StatisticsTable(len(leaves), "backward")
            self.gradients = StatisticsTable(
                len(self._variables), "gradients", with_histogram=False
            )
            self.unscaled_gradients = StatisticsTable(
                len(self._variables), "unscaled_gradients", with_histogram=False
            )
            # Filled by collectors whose optimizer has no `scale_loss` for
            # LossHealthCollector to watch (tf-keras).
            self._loss = tf.Variable(0.0, trainable=False, name="mpprof_sampled_loss")

    @property
    def call_order(self) -> list[int]:
        """Layer rows in the order the instrumented step called them."""
        seen = dict.fromkeys(self._call_order)
        return list(seen) + [r for r in range(len(self.layer_names)) if r not in seen]

    def on_call(self, layer, args, kwargs, outputs):
        row = self._rows.get(id(layer))
        if not self.instrumenting or row is None:
            return outputs
        flat = tf.nest.flatten(outputs)
        position = next(
            (i for i, t in enumerate(flat) if isinstance(t, tf.Tensor) and t.dtype.is_floating),
            None,
        )
        if position is None:
            return outputs
        self._call_order.append(row)
        self.forward.record(row, flat[position])
        flat[position] = self._gradient_tap(flat[position], row)
        return tf.nest.pack_sequence_as(outputs, flat)

    def _gradient_tap(self, tensor: tf.Tensor, row: int) -> tf.Tensor:
        backward = self.backward

        @tf.custom_gradient
        def identity(x):
            def grad(upstream):
                backward.record(row, upstream)
                return tf.identity(upstream)

            return tf.identity(x), grad

        return identity(tensor)

    def wrap_optimizer(self, optimizer, loss_scale_getter):
        """An instance-level wrapper of `optimizer.apply` (see `remove`).

        The step's loss comes from `LossHealthCollector`, which watches
        `scale_loss` on every step.
        """
        apply = optimizer.apply

        def instrumented_apply(grads, trainable_variables=None):
            if self.instrumenting:
                scale = tf.cast(loss_scale_getter(), tf.float32)
                variables = trainable_variables or self._variables
                for grad, variable in zip(grads, variables, strict=True):
                    row = self._variable_rows.get(id(variable))
                    if grad is None or row is None or isinstance(grad, tf.IndexedSlices):
                        continue
                    self.gradients.record(row, grad)
                    self.unscaled_gradients.record(row, tf.cast(grad, tf.float32) / scale)
            return apply(grads, trainable_variables)

        optimizer.apply = instrumented_apply
        self._optimizer = optimizer

    def remove(self) -> None:
        optimizer = getattr(self, "_optimizer", None)
        if optimizer is not None and "apply" in vars(optimizer):
            del optimizer.apply
        self._optimizer = None

    @property
    def _tables(self) -> tuple[StatisticsTable, ...]:
        return (self.forward, self.backward, self.gradients, self.unscaled_gradients)

    @tf.function
    def _read_and_reset(self) -> tf.Tensor:
        """Every table, flattened into one tensor (one device-to-host copy),
        and zeroes them for the next sample."""
        values = tf.concat(
            [tf.reshape(t.table, [-1]) for t in self._tables] + [[self._loss]], axis=0
        )
        with tf.control_dependencies([values]):
            for table in self._tables:
                table.table.assign(tf.zeros_like(table.table))
        return tf.identity(values)

    def read(self) -> dict[str, np.ndarray]:
        """One sample, and zeroes the tables: arrays keyed by `schema` record
        name, layers in call order, plus "loss"."""
        values = self._read_and_reset().numpy()
        tables = {}
        offset = 0
        for table in self._tables:
            size = table.rows * table.columns
            tables[table] = table.split(values[offset:offset + size].reshape(table.rows, -1))
            offset += size
        order = self.call_order
        forward, forward_hist = tables[self.forward]
        backward, backward_hist = tables[self.backward]
        return {
            schema.NUMERICS_FORWARD: forward[order],
            schema.NUMERICS_BACKWARD: backward[order],
            schema.NUMERICS_FORWARD_HIST: forward_hist[order],
            schema.NUMERICS_BACKWARD_HIST: backward_hist[order],
            schema.NUMERICS_GRADIENTS: tables[self.gradients][0],
            schema.NUMERICS_UNSCALED_GRADIENTS: tables[self.unscaled_gradients][0],
            "loss": float(values[-1]),
        }

    def layout(self, policy_max: float) -> dict:
        """The JSON record naming the rows of every sample."""
        return {
            "layers": [self.layer_names[row] for row in self.call_order],
            "variables": self.variable_names,
            "hist_edges": schema.NUMERICS_HIST_EDGES,
            "policy_max": policy_max,
            "aggregation": (
                "per layer, summed over its call sites in the step and over the "
                "steps of one execution (abs_max: maximum)"
            ),
        }
