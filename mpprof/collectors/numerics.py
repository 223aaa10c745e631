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

A recurrent layer (GRU, LSTM, any `RNN`) is measured at its boundary, as if
it were a leaf: its cell runs inside the layer's `tf.while_loop`, or not at
all where a fused (cuDNN) kernel does the work. Any other layer called inside
a control-flow body (a custom `tf.while_loop`, a `tf.cond` branch) gets no
taps either: a gradient tap there cannot capture the tables ("... is in list
of internal_captures but not in internal_capture_to_output" when the loop's
gradient is built), and its per-iteration outputs are not what the next
layer sees anyway. The layout lists such layers under "skipped" with the
reason, and the nearest enclosing layer called outside control flow is
measured at its boundary instead. A layer whose taps cannot be built for any
other reason is skipped the same way: instrumenting never stops the user's
training.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from mpprof import schema
from mpprof.collectors.layer_calls import control_flow_inside_caller, walk_layers
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
    # Flattened first, so that tensors of every shape share one trace per
    # dtype: a model with hundreds of layers would otherwise trace the
    # statistics once per distinct shape (a minute for MobileNetV3Small).
    values = tf.reshape(tensor, [-1])
    if with_histogram:
        return _statistics_with_histogram(values)
    return (*_statistics(values), None)


# XLA fuses the dozen element-wise passes below into one: without it they
# cost as much as the layer itself on large activations. Static shapes
# throughout (no boolean_mask, no bincount) so that it compiles; XLA compiles
# each concrete length once, when the step runs.
@tf.function(jit_compile=True, autograph=False, reduce_retracing=True)
def _statistics_with_histogram(values):
    return _compute_statistics(values, True)


@tf.function(jit_compile=True, autograph=False, reduce_retracing=True)
def _statistics(values):
    return _compute_statistics(values, False)[:2]


def _compute_statistics(values, with_histogram):
    # Compared in the tensor's own dtype (no float32 copy of a large tensor);
    # both thresholds are exact in float16 and bfloat16.
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
        self.record_many([row], [tensor])

    def record_many(self, rows: list[int], tensors: list[tf.Tensor]) -> None:
        """Adds the statistics of `tensors[i]` into row `rows[i]`, in one update."""
        if not tensors:
            return
        statistics = [tensor_statistics(t, self.with_histogram) for t in tensors]
        sums = tf.stack([
            counts if histogram is None else tf.concat([counts, histogram], 0)
            for counts, _, histogram in statistics
        ])
        abs_max = tf.stack([m for _, m, _ in statistics])
        context = tf.distribute.get_replica_context()
        if context is not None and context.num_replicas_in_sync > 1:
            # MirroredStrategy all-reduces only SUM and MEAN: the maximum is
            # taken from a sum of one-hot vectors, one slot per replica.
            per_replica_max = abs_max[:, None] * tf.one_hot(
                context.replica_id_in_sync_group, context.num_replicas_in_sync
            )
            sums, per_replica_max = context.all_reduce(
                tf.distribute.ReduceOp.SUM, [sums, per_replica_max]
            )
            abs_max = tf.reduce_max(per_replica_max, axis=1)
        # One-hot updates instead of scatter ops: XLA has no ResourceScatterNdMax.
        one_hot = tf.one_hot(rows, self.rows, axis=0)  # [table rows, len(rows)]
        added = tf.matmul(one_hot, sums)
        row_max = tf.reduce_max(one_hot * abs_max[None, :], axis=1, keepdims=True)
        count_columns = len(schema.NUMERICS_COUNT_COLUMNS)
        table = self.table
        self.table.assign(tf.concat([
            table[:, :count_columns] + added[:, :count_columns],
            tf.maximum(table[:, count_columns:count_columns + 1], row_max),
            table[:, count_columns + 1:] + added[:, count_columns:],
        ], axis=1))

    def split(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """A read table as ([rows, NUMERICS_STAT_COLUMNS], [rows, bins] or None)."""
        stats_columns = len(schema.NUMERICS_STAT_COLUMNS)
        histogram = values[:, stats_columns:] if self.with_histogram else None
        return values[:, :stats_columns], histogram


class NumericsCollector:
    """Per-layer forward/backward and per-variable gradient statistics.

    Every leaf layer is measured; a layer with sublayers only when it is the
    boundary of a skipped one (see the module docstring). Each nested layer
    gets a table row up front: which ones are measured is known only once the
    instrumented step has been traced.

    Args:
        model: the built model.
        strategy: the model's distribution strategy (tables live in its scope).
    """

    def __init__(self, model, strategy):
        self.instrumenting = False
        self._model = model
        entries = walk_layers(model)
        self.layer_names = [name for name, _, _ in entries]
        self._rows = {id(layer): row for row, (_, layer, _) in enumerate(entries)}
        row_of_name = {name: row for row, (name, _, _) in enumerate(entries)}
        self._parent_rows = {
            row: row_of_name[parent] for row, (_, _, parent) in enumerate(entries)
            if parent is not None
        }
        self._call_order: list[int] = []
        # Rows whose call could not be measured: row -> reason.
        self._skipped: dict[int, str] = {}
        # Skipped row -> the row measured at its boundary instead.
        self._measured_at: dict[int, int] = {}
        # Rows measured whenever called: leaves, and recurrent layers in
        # place of everything inside them.
        self._measured_rows: set[int] = set()
        for row, (_, layer, _) in enumerate(entries):
            recurrent = self._recurrent_ancestor(row, entries)
            if recurrent is not None:
                self._skipped[row] = (
                    f"runs inside the recurrent layer {entries[recurrent][0]!r} (its time "
                    "loop or fused kernel)"
                )
                self._measured_at[row] = recurrent
            elif _is_recurrent(layer) or not _sublayers(layer):
                self._measured_rows.add(row)
        # Skipped rows of the trace under way that no enclosing layer
        # measures yet: the next enclosing layer called outside control flow
        # is measured at their boundary.
        self._uncovered: set[int] = set()
        self._variables = list(model.trainable_variables)
        self.variable_names = [variable_path(v) for v in self._variables]
        self._variable_rows = {id(v): row for row, v in enumerate(self._variables)}
        self._optimizers: list = []
        with strategy.scope():
            self.forward = StatisticsTable(len(entries), "forward")
            self.backward = StatisticsTable(len(entries), "backward")
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
        """Rows of the measured layers: in the order the instrumented step
        called them, then leaves it never called (zeros).

        A layer skipped at one call site is left out even where another call
        was measured: an RNN calls its cell once before the loop to learn the
        output's shape, and that call alone is not the cell's numerics.
        """
        seen = [row for row in dict.fromkeys(self._call_order) if row not in self._skipped]
        unseen = sorted(self._measured_rows - set(self._call_order) - set(self._skipped))
        return seen + unseen

    def on_call(self, layer, args, kwargs, outputs):
        row = self._rows.get(id(layer))
        if not self.instrumenting or row is None:
            return outputs
        if row not in self._measured_rows and not self._uncovered_below(row):
            return outputs
        body = control_flow_inside_caller()
        if body is not None:
            self._skip(row, f"called inside {body}, where a gradient tap cannot "
                            "capture mpprof's tables")
            return outputs
        flat = tf.nest.flatten(outputs)
        position = next(
            (i for i, t in enumerate(flat) if isinstance(t, tf.Tensor) and t.dtype.is_floating),
            None,
        )
        if position is None:
            return outputs
        try:
            tapped = self._gradient_tap(flat[position], row)
            self.forward.record(row, flat[position])
        except Exception as e:  # noqa: BLE001 - a layer unmeasured, never a failed fit
            self._skip(row, f"its taps could not be built ({type(e).__name__}: {e})")
            return outputs
        self._call_order.append(row)
        self._boundary_found(row)
        flat[position] = tapped
        return tf.nest.pack_sequence_as(outputs, flat)

    def _recurrent_ancestor(self, row: int, entries) -> int | None:
        parent = self._parent_rows.get(row)
        while parent is not None:
            if _is_recurrent(entries[parent][1]):
                return parent
            parent = self._parent_rows.get(parent)
        return None

    def _skip(self, row: int, reason: str) -> None:
        """Leaves `row` unmeasured; its nearest enclosing layer measured
        outside control flow stands in for it."""
        self._skipped.setdefault(row, reason)
        self._uncovered.add(row)

    def _uncovered_below(self, row: int) -> list[int]:
        return [s for s in self._uncovered if self._is_ancestor(row, s)]

    def _boundary_found(self, row: int) -> None:
        """`row` is measured: so are, at its boundary, the skipped layers below it."""
        for skipped in self._uncovered_below(row):
            self._measured_at[skipped] = row
            self._uncovered.discard(skipped)

    def _is_ancestor(self, ancestor: int, row: int) -> bool:
        parent = self._parent_rows.get(row)
        while parent is not None:
            if parent == ancestor:
                return True
            parent = self._parent_rows.get(parent)
        return False

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

        May be called for each optimizer the train step uses (a GAN's two);
        None (a model whose own `optimizer` is never built) wraps nothing.
        The step's loss comes from `LossHealthCollector`, which watches
        `scale_loss` on every step.
        """
        if optimizer is None or any(optimizer is o for o in self._optimizers):
            return
        apply = optimizer.apply

        def instrumented_apply(grads, trainable_variables=None):
            if self.instrumenting:
                scale = tf.cast(loss_scale_getter(), tf.float32)
                rows, grads_seen = self._gradient_rows(grads, trainable_variables)
                self.gradients.record_many(rows, grads_seen)
                self.unscaled_gradients.record_many(
                    rows, [tf.cast(g, tf.float32) / scale for g in grads_seen]
                )
            return apply(grads, trainable_variables)

        optimizer.apply = instrumented_apply
        self._optimizers.append(optimizer)

    def _gradient_rows(self, grads, variables) -> tuple[list[int], list[tf.Tensor]]:
        """(table rows, gradients) of the tracked variables' gradients; of a
        sparse gradient (an Embedding's), the rows it updates."""
        rows, found = [], []
        for grad, variable in zip(grads, variables or self._variables, strict=True):
            row = self._variable_rows.get(id(variable))
            if grad is None or row is None:
                continue
            rows.append(row)
            found.append(grad.values if isinstance(grad, tf.IndexedSlices) else grad)
        return rows, found

    def remove(self) -> None:
        for optimizer in self._optimizers:
            if "apply" in vars(optimizer):
                del optimizer.apply
        self._optimizers.clear()

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
            tables[table] = table.split(
                values[offset:offset + size].reshape(table.rows, table.columns)
            )
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
        """The JSON record naming the rows of every sample.

        "skipped" lists the layers left unmeasured: {"layer", "reason",
        "measured_at"} (the enclosing layer measured instead, or None).
        """
        return {
            "layers": [self.layer_names[row] for row in self.call_order],
            "variables": self.variable_names,
            "hist_edges": schema.NUMERICS_HIST_EDGES,
            "policy_max": policy_max,
            "aggregation": (
                "per layer, summed over its call sites in the step and over the "
                "steps of one execution (abs_max: maximum)"
            ),
            "skipped": [
                {
                    "layer": self.layer_names[row],
                    "reason": reason,
                    "measured_at": (
                        self.layer_names[self._measured_at[row]]
                        if row in self._measured_at else None
                    ),
                }
                for row, reason in self._skipped.items()
            ],
        }


def _sublayers(layer) -> list:
    # list(): tf-keras returns a generator, Keras 3 a list.
    return list(layer._flatten_layers(include_self=False, recursive=False))


def _is_recurrent(layer) -> bool:
    """Whether `layer` is a Keras 3 or tf-keras `RNN` (GRU, LSTM, ConvLSTM...)."""
    return any(cls.__name__ == "RNN" for cls in type(layer).__mro__)
