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

from typing import Any

import numpy as np
import tensorflow as tf

from mpprof.backends.numerics_layers import LayerRows
from mpprof.backends.patching import Patches
from mpprof.backends.tensorflow.layer_calls import control_flow_inside_caller
from mpprof.backends.tensorflow.tensor_statistics import StatisticsTable
from mpprof.records import schema


class NumericsTaps(LayerRows):
    """Per-layer forward/backward and per-variable gradient statistics.

    Every leaf layer is measured; a layer with sublayers only when it is the
    boundary of a skipped one (see the module docstring). Each nested layer
    gets a table row up front: which ones are measured is known only once the
    instrumented step has been traced.

    Args:
        model: the built model.
        strategy: the model's distribution strategy (tables live in its scope).
    """

    aggregation = ("per layer, summed over its call sites in the step and over the "
                   "steps of one execution (abs_max: maximum)")

    def __init__(self, model, strategy):
        super().__init__(model, recurrent_loop="its time loop or fused kernel")
        self.instrumenting = False
        self._model = model
        # Skipped rows of the trace under way that no enclosing layer
        # measures yet: the next enclosing layer called outside control flow
        # is measured at their boundary.
        self._uncovered: set[int] = set()
        self._variable_rows = {id(v): row for row, v in enumerate(self._variables)}
        self._optimizers: list = []
        with strategy.scope():
            self.forward = StatisticsTable(len(self.layer_names), "forward")
            self.backward = StatisticsTable(len(self.layer_names), "backward")
            self.gradients = StatisticsTable(
                len(self._variables), "gradients", with_histogram=False
            )
            self.unscaled_gradients = StatisticsTable(
                len(self._variables), "unscaled_gradients", with_histogram=False
            )
            # Filled by collectors whose optimizer has no `scale_loss` for
            # LossWatch to watch (tf-keras).
            self._loss = tf.Variable(0.0, trainable=False, name="mpprof_sampled_loss")

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

    def wrap_optimizer(self, optimizer, loss_scale_getter, patches: Patches) -> None:
        """An instance-level wrapper of `optimizer.apply`, through `patches`.

        May be called for each optimizer the train step uses (a GAN's two);
        None (a model whose own `optimizer` is never built) wraps nothing.
        The step's loss comes from `LossWatch`, which watches
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

        patches.set(optimizer, "apply", instrumented_apply)
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
        sample: dict[str, Any] = {
            schema.NUMERICS_FORWARD: forward[order],
            schema.NUMERICS_BACKWARD: backward[order],
            schema.NUMERICS_FORWARD_HIST: forward_hist[order],
            schema.NUMERICS_BACKWARD_HIST: backward_hist[order],
            schema.NUMERICS_GRADIENTS: tables[self.gradients][0],
            schema.NUMERICS_UNSCALED_GRADIENTS: tables[self.unscaled_gradients][0],
            "loss": float(values[-1]),
        }
        return sample
