"""The `MixedPrecisionProfiler` Keras callback."""

from __future__ import annotations

import numbers
import os
import posixpath

import keras
import tensorflow as tf

from mpprof import schema
from mpprof.collectors.layer_calls import LayerCallPatch
from mpprof.collectors.loss_scale import LossScaleCollector, is_loss_scale_optimizer
from mpprof.collectors.precision import PrecisionCollector
from mpprof.context import run_context
from mpprof.writer import RecordWriter


class MixedPrecisionProfiler(keras.callbacks.Callback):
    """Records what mixed precision does to a training run, for TensorBoard.

    Add it to `model.fit`. It records, into `log_dir/train/`:

    - the precision inventory: every layer's policy, compute/variable dtype,
      the dtypes it actually outputs, float32 islands, casts between layers
      and Tensor Core shape alignment (once per fit, at trace time);
    - the dynamic loss scale and every overflow (skipped step) and growth,
      exact to the step, counted inside the traced train step and read by the
      host only every `flush_every_steps` steps;
    - the run context: versions, policies, optimizer, strategy, devices.

    Read them with `tensorboard --logdir LOG_DIR` (the "mpprof" tab),
    `mpprof diagnose LOG_DIR`, or `mpprof.reader.read_logdir(LOG_DIR)`.

    The model is left as found: every patch is removed when `fit` ends or
    raises, and `model.save()` works after `fit`.

    Args:
        log_dir: directory to write into (local or any `tf.io.gfile` path);
            the same `log_dir` as `keras.callbacks.TensorBoard` is fine.
        flush_every_steps: how often, in train steps, the host reads the
            in-graph counters and queues records. Records are also written
            at every epoch end, at the end of `fit` and when `fit` raises.

    Example:

    ```python
    import keras, numpy as np, mpprof
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    model = keras.Sequential([
        keras.layers.Input((784,)),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(10, dtype="float32"),
    ])
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x = np.random.rand(512, 784).astype("float32")
    y = np.random.randint(0, 10, 512)
    model.fit(x, y, epochs=1,
              callbacks=[mpprof.MixedPrecisionProfiler(log_dir="logs/run1")])
    ```
    """

    def __init__(self, log_dir: str | os.PathLike = "logs", *, flush_every_steps: int = 500):
        super().__init__()
        self.log_dir = _validated_log_dir(log_dir)
        self.flush_every_steps = _positive_int("flush_every_steps", flush_every_steps)
        self._writer: RecordWriter | None = None
        self._loss_scale: LossScaleCollector | None = None
        self._precision: PrecisionCollector | None = None
        self._layer_patch: LayerCallPatch | None = None
        self._guarded_function = None
        self._fit_count = 0
        self._steps_since_flush = 0
        self._inventory_written = False

    @property
    def run_dir(self) -> str:
        return posixpath.join(self.log_dir, schema.TRAIN_RUN)

    def on_train_begin(self, logs=None):
        self._writer = _open_writer(self.run_dir)
        self._fit_count += 1
        model = self.model
        self._precision = PrecisionCollector(model)
        self._layer_patch = LayerCallPatch(model, [self._precision])
        self._layer_patch.install()
        self._inventory_written = False
        self._loss_scale = self._loss_scale_collector(model)
        if self._loss_scale is not None:
            self._loss_scale.install()
        # Retrace so the patches are in the graph even if fit traced before.
        model.make_train_function(force=True)
        self._guarded_function = _GuardedTrainFunction(model.train_function, self._abort)
        model.train_function = self._guarded_function
        self._writer.write_json(schema.RUN_CONTEXT, self._context(), self._current_step())
        self._read_loss_scale()
        self._steps_since_flush = 0

    def on_train_batch_end(self, batch, logs=None):
        if not self._inventory_written and self._precision.traced:
            self._writer.write_json(
                schema.INVENTORY, self._precision.inventory(), self._current_step()
            )
            self._inventory_written = True
        if self._loss_scale is not None:
            self._loss_scale.poll_if_host_mode()
        self._steps_since_flush += self._steps_per_execution()
        if self._steps_since_flush >= self.flush_every_steps:
            self._read_loss_scale()
            self._steps_since_flush = 0

    def on_epoch_end(self, epoch, logs=None):
        self._read_loss_scale()
        self._writer.flush()

    def on_train_end(self, logs=None):
        self._finish()

    def _abort(self) -> None:
        """`fit` is raising from inside a train step: keep what was recorded."""
        try:
            self._finish()
        except Exception as e:  # noqa: BLE001 - the original error matters more
            print(f"mpprof: could not save the last records ({e})")

    def _finish(self) -> None:
        if self._writer is None:
            return
        try:
            self._read_loss_scale()
            self._writer.write_json(schema.RUN_CONTEXT, self._context(), self._current_step())
        finally:
            self._restore_model()
            self._writer.close()
            self._writer = None

    def _restore_model(self) -> None:
        self._layer_patch.remove()
        if self._loss_scale is not None:
            self._loss_scale.remove()
        if self.model.train_function is self._guarded_function:
            # The traced function holds the patches: let the next fit trace anew.
            self.model.train_function = None
        self._guarded_function = None

    def _loss_scale_collector(self, model) -> LossScaleCollector | None:
        optimizer = model.optimizer
        if not is_loss_scale_optimizer(optimizer):
            return None
        if self._loss_scale is not None and self._loss_scale.optimizer is optimizer:
            return self._loss_scale  # keeps counting skipped steps across fits
        capacity = max(1024, 2 * (self.flush_every_steps + self._steps_per_execution()))
        return LossScaleCollector(optimizer, model.distribute_strategy, capacity)

    def _read_loss_scale(self) -> None:
        if self._loss_scale is None:
            return
        events, progress = self._loss_scale.read()
        step = int(progress[0])
        if len(events):
            self._writer.write_array(schema.LOSS_SCALE_EVENTS, events, step)
        self._writer.write_array(schema.LOSS_SCALE_PROGRESS, progress, step)

    def _current_step(self) -> int:
        if self._loss_scale is not None:
            return self._loss_scale.current_step()
        optimizer = self.model.optimizer
        return int(optimizer.iterations.numpy()) if optimizer is not None else 0

    def _steps_per_execution(self) -> int:
        return int(getattr(self.model, "steps_per_execution", 1) or 1)

    def _context(self) -> dict:
        if self._loss_scale is not None:
            loss_scale = {"state": "ok", **self._loss_scale.settings()}
        else:
            loss_scale = {
                "state": "absent",
                "reason": (
                    f"the optimizer is a {type(self.model.optimizer).__name__}, not a "
                    "LossScaleOptimizer: no dynamic loss scale to record"
                ),
            }
        precision = {"state": "ok", "traced": self._precision.traced}
        return run_context(
            self.model,
            collectors={"precision": precision, "loss_scale": loss_scale},
            step=self._current_step(),
            fit_count=self._fit_count,
        )


class _GuardedTrainFunction:
    """Calls the traced train function; on any exception runs `on_error` first."""

    def __init__(self, function, on_error):
        self._function = function
        self._on_error = on_error

    def __call__(self, *args, **kwargs):
        try:
            return self._function(*args, **kwargs)
        except BaseException:
            self._on_error()
            raise


def _open_writer(run_dir: str) -> RecordWriter:
    try:
        return RecordWriter(run_dir)
    except (OSError, tf.errors.OpError) as e:
        message = getattr(e, "message", None) or str(e)
        raise OSError(
            f"mpprof cannot write its records to {run_dir!r}: {message}. Pass "
            "MixedPrecisionProfiler(log_dir=...) a directory you can write to."
        ) from e


def _validated_log_dir(log_dir) -> str:
    if not isinstance(log_dir, (str, os.PathLike)):
        raise ValueError(
            f"log_dir must be a path (str or os.PathLike), got {type(log_dir).__name__}"
        )
    log_dir = os.fspath(log_dir)
    if not log_dir.strip():
        raise ValueError("log_dir must not be empty: pass a directory such as 'logs/run1'")
    return log_dir


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)
