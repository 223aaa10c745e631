"""Float8 saturation and underflow shares, measured in-graph on sampled steps.

On the steps the numerics schedule samples, each float8 layer's three
quantized tensors are measured as Keras quantizes them
(`keras.quantizers.quantize_and_dequantize`: `x / scale` in the compute
dtype, clipped to the format's max, cast to float8, rounding to nearest
even), with the scale the step quantizes with:

- inputs (e4m3): the `inputs` its `quantized_call` receives (already in the
  compute dtype), with `inputs_scale`;
- kernel (e4m3): the kernel, with `kernel_scale`;
- output gradient (e5m2): the gradient flowing into the layer's activation,
  with `outputs_grad_scale`. Keras quantizes the gradient of the matmul's
  output; the bias add between the two passes it through unchanged.

The scales are read in the step, before its update: TensorFlow orders the
reads and writes of one variable as the step's code makes them, and Keras
overwrites them only when the optimizer applies the step's gradients.

The statistics add into one device-side table, read and zeroed once per
sampled call. The plain train function carries none of this. Whatever fails
while the taps are built switches this collector off (the run context says
why), never the user's step.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import tensorflow as tf

from mpprof.backends.float8_replay import float8_layers
from mpprof.dtypes import FLOAT8_RANGES
from mpprof.recording.collectors.base import Collector
from mpprof.recording.guard import TracedGuard
from mpprof.recording.patching import Patches
from mpprof.records import schema

_COLUMN = schema.FLOAT8_SHARE_COLUMN
_COUNTS = len(schema.FLOAT8_SHARE_COUNT_COLUMNS)
_TENSOR = {name: index for index, name in enumerate(schema.FLOAT8_TENSORS)}


def quantization_counts(values: tf.Tensor, scale: tf.Tensor, fmt: str) -> tf.Tensor:
    """`schema.FLOAT8_SHARE_COLUMNS` of one tensor quantized as Keras does.

    Keras divides in the compute dtype, clips to the format's max and casts
    to float8, rounding to nearest even: a value saturates where its quotient
    is beyond the max, and a non-zero value quantizes to zero where its
    quotient is at most half the smallest subnormal (a float16 quotient that
    underflows float16 itself included). Compared, not cast: the same verdict
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
    limits = FLOAT8_RANGES[fmt]
    return _counts(x, tf.cast(scale, x.dtype), tf.constant(limits.max, x.dtype),
                   tf.constant(limits.smallest_subnormal / 2, x.dtype), tf.cast(scale, tf.float32))


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


class Float8Shares(Collector):
    """Writes a FLOAT8_SHARES record for each sampled step of a float8 model.

    Keras calls a quantized layer through its `quantized_call`, not its
    `call` (so mpprof's layer-call hooks never see it): each float8 layer's
    `quantized_call` is wrapped at instance level for the fit. While the
    instrumented train step is traced (`instrument(True)`), the wrapper
    measures the layer's inputs and kernel, and wraps the layer's activation
    for the length of that call so that the gradient Keras quantizes is
    measured on its way back.

    Args:
        model: the model being fit.
        sampling: whether the fit samples steps at all (`numerics_every`).
    """

    name = "float8_shares"

    def __init__(self, model, sampling: bool):
        self._layers = float8_layers(model)
        self._sampling = sampling
        self._strategy = model.distribute_strategy
        self.instrumenting = False
        self.traced = TracedGuard()
        self._ok = lambda: True
        self._table = None
        self._samples = 0
        self._tapping_lock = threading.Lock()
        self._tapping_calls: dict[int, int] = {}

    def install(self, fit, patches: Patches) -> None:
        if not self._layers or not self._sampling:
            return
        shape = (len(self._layers), len(schema.FLOAT8_TENSORS), len(schema.FLOAT8_SHARE_COLUMNS))
        with self._strategy.scope():
            self._table = tf.Variable(tf.zeros(shape), trainable=False,
                                      name="mpprof_float8_shares")
        self.traced.on_error = lambda error: fit.guard.fail(self.name, error)
        self._ok = lambda: fit.guard.ok(self.name)
        for row, layer in enumerate(self._layers):
            patches.set(layer, "quantized_call", self._wrap(layer, row, layer.quantized_call))

    def instrument(self, on: bool) -> None:
        """Switches the taps on for the sampled call about to run, or off after it."""
        self.instrumenting = on and self._table is not None

    def _wrap(self, layer, row: int, quantized_call):
        activation = getattr(layer, "activation", None)
        tapped_activation = None
        if callable(activation):
            # One tapped activation per layer, whichever replica calls it: the
            # tap reads the scale and the replica context where it runs.
            def tapped_activation(x):
                tapped = self.traced(lambda: self._gradient_tap(x, row, layer.outputs_grad_scale))
                return activation(x if tapped is None else tapped)

        def measured_quantized_call(*args, **kwargs):
            if not self.instrumenting or not self._ok():
                return quantized_call(*args, **kwargs)
            self.traced(lambda: self._record(row, [
                ("inputs", args[0] if args else kwargs["inputs"], layer.inputs_scale),
                ("kernel", tf.cast(layer._kernel, layer.compute_dtype), layer.kernel_scale),
            ]))
            if tapped_activation is None:
                # No activation to wrap: the output is the matmul's (plus the bias).
                outputs = quantized_call(*args, **kwargs)
                tapped = self.traced(
                    lambda: self._gradient_tap(outputs, row, layer.outputs_grad_scale))
                return outputs if tapped is None else tapped
            with self._tapping(layer, row, activation, tapped_activation):
                return quantized_call(*args, **kwargs)

        return measured_quantized_call

    @contextlib.contextmanager
    def _tapping(self, layer, row: int, activation, tapped_activation):
        """`layer.activation` is `tapped_activation` for the length of the call.

        Set for the call alone, so that a checkpoint saving the layer's config
        never sees the wrapper. MirroredStrategy traces each replica in its
        own thread, and an all-reduce in a hook inside the call (the layer's
        numerics) hands over to the next replica mid-call: the layer's own
        activation is put back only when the last replica's call ends, and
        never read back from the layer (where it may be the tapped one).
        """
        with self._tapping_lock:
            self._tapping_calls[row] = self._tapping_calls.get(row, 0) + 1
            layer.activation = tapped_activation
        try:
            yield
        finally:
            with self._tapping_lock:
                self._tapping_calls[row] -= 1
                if not self._tapping_calls[row]:
                    layer.activation = activation

    def _gradient_tap(self, tensor: tf.Tensor, row: int, scale_variable) -> tf.Tensor:
        """`tensor`, whose gradient is measured against `scale_variable` as it
        is before the step's update."""
        scale = tf.convert_to_tensor(scale_variable)

        @tf.custom_gradient
        def identity(x):
            def grad(upstream):
                self.traced(lambda: self._record(row, [("outputs_grad", upstream, scale)]))
                return tf.identity(upstream)

            return tf.identity(x), grad

        return identity(tensor)

    def _record(self, row: int, tensors: list) -> None:
        """Adds the counts of (tensor name, values, scale) into the table."""
        positions = [(row, _TENSOR[name]) for name, _, _ in tensors]
        rows = tf.stack([
            quantization_counts(values, scale, schema.FLOAT8_FORMATS[name])
            for name, values, scale in tensors
        ])
        counts, maxima = rows[:, :_COUNTS], rows[:, _COUNTS:]
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
        updated = tf.concat([table[:, :_COUNTS] + added,
                             tf.maximum(table[:, _COUNTS:], largest)], axis=1)
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
        rows = self._read_and_reset().numpy().astype(np.float64)
        if not rows[..., _COLUMN.count].any():
            return  # no float8 layer was measured in this call
        fit.writer.write_array(schema.FLOAT8_SHARES, rows, fit.sample_step)
        self._samples += 1

    def context(self) -> dict:
        if not self._layers:
            return {"state": "absent", "reason": "no float8 layers (model.quantize('float8'))"}
        if not self._sampling:
            return {"state": "off", "reason": "numerics_every=None: no step is sampled"}
        return {"state": "ok", "samples": self._samples}
