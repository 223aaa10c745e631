"""Float8 saturation and underflow shares, measured in-graph on sampled steps,
on TensorFlow (what is measured, and how the layers are wrapped:
`mpprof.backends.float8_shares`).

The scales are read in the step, before its update: TensorFlow orders the
reads and writes of one variable as the step's code makes them, and Keras
overwrites them only when the optimizer applies the step's gradients.

The statistics add into one device-side table, read and zeroed once per
sampled call. The plain train function carries none of this. Whatever fails
while the taps are built switches this collector off (the run context says
why), never the user's step.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from mpprof.backends.float8_shares import (
    COUNTS,
    TENSOR,
    Float8SharesCollector,
    quantization_limits,
)
from mpprof.backends.patching import Patches
from mpprof.records import schema


def quantization_counts(values: tf.Tensor, scale: tf.Tensor, fmt: str) -> tf.Tensor:
    """`schema.FLOAT8_SHARE_COLUMNS` of one tensor quantized as Keras does
    (`mpprof.backends.float8_shares`). Compared, not cast: the same verdict
    for one pass less.

    Args:
        values: the tensor Keras quantizes, in the layer's compute dtype.
        scale: the scale it quantizes with (Keras: `x / scale`).
        fmt: the float8 format, a key of `mpprof.dtypes.FLOAT8_RANGES`.

    Returns:
        float32 [len(FLOAT8_SHARE_COLUMNS)].
    """
    # Flattened, and the limits passed as tensors: one trace per dtype.
    x = tf.reshape(values, [-1])
    fmax, half_smallest = quantization_limits(fmt)
    return _counts(x, tf.cast(scale, x.dtype), tf.constant(fmax, x.dtype),
                   tf.constant(half_smallest, x.dtype), tf.cast(scale, tf.float32))


# XLA fuses the element-wise passes into one (without it they cost more than
# the float8 layer's own quantization); each length compiles once.
@tf.function(jit_compile=True, autograph=False, reduce_retracing=True)
def _counts(x, scale, fmax, half_smallest, scale_float32):
    quotient = tf.abs(x / scale)
    nonzero = tf.not_equal(x, 0)
    magnitude = tf.abs(x)
    return tf.stack([
        tf.cast(tf.size(x), tf.float32),
        _count(nonzero),
        _count(quotient > fmax),
        _count(tf.logical_and(nonzero, quotient <= half_smallest)),
        scale_float32,
        tf.cast(tf.reduce_max(tf.where(tf.math.is_finite(x), magnitude,
                                       tf.zeros_like(magnitude))), tf.float32),
    ])


def _count(mask: tf.Tensor) -> tf.Tensor:
    return tf.reduce_sum(tf.cast(mask, tf.float32))


class Float8Shares(Float8SharesCollector):
    """FLOAT8_SHARES on TensorFlow: the taps add into a table variable.

    While the instrumented train step is traced (`instrument(True)`: the
    flag is read as `tf.function` traces, lazily), the wrapped
    `quantized_call`s measure into the table.

    Args:
        model: the model being fit.
        sampling: whether the fit samples steps at all (`numerics_every`).
    """

    def __init__(self, model, sampling: bool):
        super().__init__(model, sampling)
        self._strategy = model.distribute_strategy
        self.instrumenting = False
        self._table: tf.Variable | None = None

    def install(self, fit, patches: Patches) -> None:
        if not self._layers or not self._sampling:
            return
        shape = (len(self._layers), len(schema.FLOAT8_TENSORS), len(schema.FLOAT8_SHARE_COLUMNS))
        with self._strategy.scope():
            self._table = tf.Variable(tf.zeros(shape), trainable=False,
                                      name="mpprof_float8_shares")
        self._guard(fit)
        for row, layer in enumerate(self._layers):
            patches.set(layer, "quantized_call", self.wrap(layer, row, layer.quantized_call))

    def instrument(self, on: bool) -> None:
        """Switches the taps on for the sampled call about to run, or off after it."""
        self.instrumenting = on and self._table is not None

    def _begin_call(self, row: int, inputs) -> bool:
        return self.instrumenting

    def _measure_forward(self, row: int, layer, inputs) -> None:
        self._record(row, [
            ("inputs", inputs, layer.inputs_scale),
            ("kernel", tf.cast(layer._kernel, layer.compute_dtype), layer.kernel_scale),
        ])

    def _gradient_tap(self, tensor: tf.Tensor, row: int, layer) -> tf.Tensor:
        """`tensor`, whose gradient is measured against `outputs_grad_scale`
        as it is before the step's update."""
        scale = tf.convert_to_tensor(layer.outputs_grad_scale)

        @tf.custom_gradient
        def identity(x):
            def grad(upstream):
                self.traced(lambda: self._record(row, [("outputs_grad", upstream, scale)]))
                return tf.identity(upstream)

            return tf.identity(x), grad

        return identity(tensor)

    def _record(self, row: int, tensors: list) -> None:
        """Adds the counts of (tensor name, values, scale) into the table."""
        positions = [(row, TENSOR[name]) for name, _, _ in tensors]
        rows = tf.stack([
            quantization_counts(values, scale, schema.FLOAT8_FORMATS[name])
            for name, values, scale in tensors
        ])
        counts, maxima = rows[:, :COUNTS], rows[:, COUNTS:]
        context = tf.distribute.get_replica_context()
        if context is not None and context.num_replicas_in_sync > 1:
            # MirroredStrategy all-reduces only SUM and MEAN: the maxima come
            # from a sum of one-hot slots, one per replica.
            replicas = context.num_replicas_in_sync
            slots = maxima[:, :, None] * tf.one_hot(context.replica_id_in_sync_group, replicas)
            counts, slots = context.all_reduce(tf.distribute.ReduceOp.SUM, [counts, slots])
            maxima = tf.reduce_max(slots, axis=2)
        # One-hot updates instead of scatter ops: XLA has no scatter-max.
        cells = self._table.shape[0] * self._table.shape[1]
        one_hot = tf.one_hot([r * self._table.shape[1] + t for r, t in positions], cells, axis=0)
        table = tf.reshape(self._table, [cells, -1])
        added = tf.matmul(one_hot, counts)
        largest = tf.reduce_max(one_hot[:, :, None] * maxima[None, :, :], axis=1)
        updated = tf.concat([table[:, :COUNTS] + added,
                             tf.maximum(table[:, COUNTS:], largest)], axis=1)
        self._table.assign(tf.reshape(updated, self._table.shape))

    # After each call.

    @tf.function(autograph=False)
    def _read_and_reset(self) -> tf.Tensor:
        values = tf.identity(self._table)
        with tf.control_dependencies([values]):
            self._table.assign(tf.zeros_like(self._table))
        return tf.identity(values)

    def after_sample(self, fit) -> None:
        """Writes the shares of the call just sampled."""
        if self._table is None:
            return
        self.write(fit, self._read_and_reset().numpy().astype(np.float64))
