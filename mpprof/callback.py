"""The `MixedPrecisionProfiler` Keras callback."""

from __future__ import annotations

import atexit
import numbers
import os
import posixpath

import keras
import numpy as np
import tensorflow as tf

from mpprof import schema, tf_keras_support
from mpprof.collectors import gpu as gpu_collector
from mpprof.collectors import kernels as kernel_collector
from mpprof.collectors.health import LossHealthCollector
from mpprof.collectors.layer_calls import LayerCallPatch
from mpprof.collectors.loss_scale import LossScaleCollector, is_loss_scale_optimizer
from mpprof.collectors.numerics import NumericsCollector
from mpprof.collectors.precision import PrecisionCollector
from mpprof.collectors.tf_keras_health import TfKerasLossHealthCollector
from mpprof.collectors.tf_keras_loss_scale import TfKerasLossScaleCollector
from mpprof.collectors.tf_keras_numerics import TfKerasNumericsCollector
from mpprof.context import run_context
from mpprof.distributed import (
    DiscardingWriter,
    WorkerRole,
    announce_keras_3_multi_worker,
    keras_3_skip_decided_by,
    warn_if_keras_3_multi_worker,
    worker_role,
)
from mpprof.hardware import hardware_facts
from mpprof.writer import RecordWriter

# The key under which the plain train step reports the skipped-step count in
# its logs (taken out before Keras sees them): reading a tensor the step
# already returns is far cheaper than a variable read per step.
_SKIPPED_LOG = "_mpprof_skipped_steps"

# Numerics samples wait on the host for the next flush, at most this many
# (one write per record for all of them, instead of one per sample).
_MAX_PENDING_SAMPLES = 64

_POLICY_MAX = {
    "float16": schema.FLOAT16_MAX,
    "bfloat16": schema.BFLOAT16_MAX,
    "float32": float(np.finfo(np.float32).max),
}


class MixedPrecisionProfiler(keras.callbacks.Callback):
    """Records what mixed precision does to a training run, for TensorBoard.

    Add it to `model.fit`. It records, into `log_dir/train/`:

    - the precision inventory: every layer's policy, compute/variable dtype,
      the dtypes it actually outputs, float32 islands, casts between layers
      and Tensor Core shape alignment (once per fit, at trace time);
    - the dynamic loss scale and every overflow (skipped step) and growth,
      exact to the step, counted inside the traced train step and read by the
      host only every `flush_every_steps` steps;
    - per-layer numerics on sampled steps: for each leaf layer's output and
      the gradient flowing into it, the abs-max (headroom to the float16
      max), non-finite, zero and underflow shares and a log2 histogram; for
      each variable its gradient, scaled and unscaled. Steps right after an
      overflow are sampled too (forensic captures), up to `forensic_budget`;
    - the run context: versions, policies, optimizer, strategy, devices.

    Steps that are not sampled run the model's own train function, untouched.

    The same class profiles Keras 3 and tf-keras (Keras 2) models, under any
    `tf.distribute` strategy their `fit` supports. Under a multi-worker
    `MultiWorkerMirroredStrategy` (tf-keras) the chief writes the model-level
    records into `log_dir/train` and every worker its own host's records (GPU
    samples, XProf window, its run context) into `log_dir/train/worker_<i>`.
    Read the records with `tensorboard --logdir LOG_DIR` (the "mpprof" tab),
    `mpprof diagnose LOG_DIR`, or `mpprof.reader.read_logdir(LOG_DIR)`.

    The model is left as found: every patch is removed when `fit` ends or
    raises inside a train step, and `model.save()` works after `fit`.

    Args:
        log_dir: directory to write into (local or any `tf.io.gfile` path);
            the same `log_dir` as `keras.callbacks.TensorBoard` is fine.
        numerics_every: sample per-layer numerics every this many train
            steps; None turns sampling off (forensic captures too).
        forensic_budget: how many overflow-triggered samples a fit may take.
        flush_every_steps: how often, in train steps, the host reads the
            in-graph loss-scale counters and queues records. Records are also
            written at every epoch end, at the end of `fit` and when `fit`
            raises.
        gpu_interval: seconds between NVML samples of every visible GPU
            (Tensor Core utilization on Hopper+ via GPM, otherwise kernel
            utilization, memory, power, clocks); >= 0.1, or None to turn
            the sampler off. Without NVML or a GPU the run context says so.
        profile_steps: (start, stop) train steps to capture an XProf trace
            of, inclusive; after the window mpprof records the share of GPU
            kernel time spent in Tensor Core kernels. None (default) traces
            nothing. A `keras.callbacks.TensorBoard(profile_batch=...)` in the
            same fit owns the profiler: mpprof reads its trace instead.

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

    def __init__(
        self,
        log_dir: str | os.PathLike = "logs",
        *,
        numerics_every: int | None = 500,
        forensic_budget: int = 20,
        flush_every_steps: int = 500,
        gpu_interval: float | None = gpu_collector.DEFAULT_INTERVAL_S,
        profile_steps: tuple[int, int] | None = None,
    ):
        super().__init__()
        self.log_dir = _validated_log_dir(log_dir)
        self.numerics_every = (
            None if numerics_every is None else _positive_int("numerics_every", numerics_every)
        )
        self.forensic_budget = _non_negative_int("forensic_budget", forensic_budget)
        self.flush_every_steps = _positive_int("flush_every_steps", flush_every_steps)
        self.gpu_interval = (
            None if gpu_interval is None
            else gpu_collector.validate_interval(gpu_interval)
        )
        self.profile_steps = kernel_collector.validate_profile_steps(profile_steps)
        self._gpu: gpu_collector.GpuSampler | None = None
        self._hardware: dict | None = None
        self._profile_window = (
            kernel_collector.ProfileWindow(*self.profile_steps, self.run_dir)
            if self.profile_steps else None
        )
        self._writer: RecordWriter | None = None
        self._worker_writer: RecordWriter | None = None
        self._role = WorkerRole()
        self._loss_scale: LossScaleCollector | None = None
        self._loss_health: LossHealthCollector | None = None
        self._precision: PrecisionCollector | None = None
        self._numerics: NumericsCollector | None = None
        self._layer_patch: LayerCallPatch | None = None
        self._fit_count = 0
        # Keras 3's fit fails across workers before any hook runs: say it now.
        warn_if_keras_3_multi_worker()

    @property
    def run_dir(self) -> str:
        return posixpath.join(self.log_dir, schema.TRAIN_RUN)

    # tf-keras's CallbackList asks every callback these (Keras 3 callbacks do
    # not have them), so the one class serves models of either Keras.
    _supports_tf_logs = True  # batch logs are not read: tf-keras need not sync them
    _chief_worker_only = None  # every worker runs it: see mpprof.distributed

    def _implements_train_batch_hooks(self) -> bool:
        return True

    def _implements_test_batch_hooks(self) -> bool:
        return False

    def _implements_predict_batch_hooks(self) -> bool:
        return False

    # Keras hooks.

    def on_train_begin(self, logs=None):
        model = self.model
        self._tf_keras = tf_keras_support.is_tf_keras(model)
        self._role = worker_role(model.distribute_strategy)
        self._distribution_note = self._check_distribution()
        self._writer, self._worker_writer = self._open_writers(self._role)
        if self._profile_window is not None and self._role.worker_run is not None:
            # Each worker traces its own host, into its own run.
            self._profile_window.run_dir = posixpath.join(self.run_dir, self._role.worker_run)
        self._fit_count += 1
        self._precision = PrecisionCollector(model)
        self._layer_patch = LayerCallPatch(model, [self._precision])
        self._numerics = None
        self._loss_scale = self._loss_scale_collector(model)
        self._inventory_written = False
        self._layout_written = None
        self._loss_health = self._loss_health_collector(model)
        self._nonfinite_weights: list[str] = []
        self._step = self._optimizer_step()
        self._fit_start_step = self._step
        self._steps_since_flush = 0
        self._steps_since_sample = 0
        self._calls = 0
        self._forensic_used = 0
        self._forensic_due = False
        self._pending_samples: list[dict[str, np.ndarray]] = []
        self._overflows_seen = self._skipped_steps()
        self._batch_pending = False

        # fit made its train function just before this hook; keep it to put
        # back, and make our own two so the patches are in their graphs.
        self._original_function = model.train_function
        self._report_skips_in_logs()
        model.make_train_function(force=True)
        self._plain_function = model.train_function
        self._instrumented_function = None
        if self.numerics_every is not None:
            model.make_train_function(force=True)
            self._instrumented_function = model.train_function
        model.train_function = self._run_train_function

        self._layer_patch.install()
        if self._loss_scale is not None:
            self._loss_scale.install()
        if self._loss_health is not None:
            self._loss_health.install()
        self._start_gpu()
        atexit.register(self._finish)
        self._write_context()
        self._read_loss_scale()

    # No on_train_batch_end: overriding it makes Keras wait for every step's
    # logs. The work after a step is done in _run_train_function instead.
    def on_train_batch_begin(self, batch, logs=None):
        self._batch_pending = True

    def on_epoch_end(self, epoch, logs=None):
        self._read_loss_scale()
        self._write_numerics()
        self._write_gpu_samples()
        self._check_weights()
        self._writer.flush()
        if self._worker_writer is not None:
            self._worker_writer.flush()

    def on_train_end(self, logs=None):
        self._finish()

    # The train function fit calls while this profiler runs.

    def _run_train_function(self, iterator):
        if not self._batch_pending:
            # Called outside a profiled batch: a later fit or train_on_batch
            # after this fit was stopped by someone else's exception.
            self._finish()
            return self.model.train_function(iterator)
        self._batch_pending = False
        sampling = self._sample_due() and self._prepare_numerics()
        sample_step = self._start_sample() if sampling else None
        function = self._instrumented_function if sampling else self._plain_function
        if self._numerics is not None:
            self._numerics.instrumenting = sampling
        try:
            logs = function(iterator)
        except BaseException:
            self._abort()
            raise
        finally:
            if self._numerics is not None:
                self._numerics.instrumenting = False
        skipped = logs.pop(_SKIPPED_LOG, None) if isinstance(logs, dict) else None
        self._after_train_call(sample_step, skipped)
        return logs

    def _report_skips_in_logs(self) -> None:
        """Makes the train step return the skipped-step count in its logs
        (Keras 3, while forensic samples can still be taken)."""
        if (self._tf_keras or self._loss_scale is None or self.numerics_every is None
                or self.forensic_budget == 0):
            return
        model = self.model
        train_step = model.train_step
        counter = self._loss_scale.skipped_counter

        def train_step_reporting_skips(data):
            logs = train_step(data)
            if not isinstance(logs, dict):
                return logs
            return {**logs, _SKIPPED_LOG: tf.identity(counter)}

        model.train_step = train_step_reporting_skips

    def _after_train_call(self, sample_step: int | None, skipped) -> None:
        """Bookkeeping after each call; reads the device only when it must."""
        self._calls += 1
        steps = self._steps_per_execution()  # exact but for an epoch's last call
        self._step += steps
        self._steps_since_flush += steps
        self._steps_since_sample += steps
        self._after_step_gpu()
        if not self._inventory_written and self._precision.traced:
            self._writer.write_json(schema.INVENTORY, self._precision.inventory(), self._step)
            self._inventory_written = True
        if sample_step is not None:
            self._step = self._optimizer_step()
            self._write_numerics_sample(sample_step, self._step - sample_step)
        if self._loss_scale is not None:
            self._loss_scale.poll_if_host_mode()
            self._watch_for_overflows(skipped)
        if self._steps_since_flush >= self.flush_every_steps:
            self._step = self._optimizer_step()
            self._read_loss_scale()
            self._write_numerics()
            self._write_gpu_samples()
            self._steps_since_flush = 0

    # Numerics sampling.

    def _sample_due(self) -> bool:
        if self.numerics_every is None or self._calls == 0:
            return False  # the first call builds the model: run it plain
        if self._forensic_due:
            return True
        return self._steps_since_sample >= self.numerics_every

    def _prepare_numerics(self) -> bool:
        if self._numerics is None:
            model = self.model
            collector = TfKerasNumericsCollector if self._tf_keras else NumericsCollector
            self._numerics = collector(model, model.distribute_strategy)
            self._numerics.wrap_optimizer(model.optimizer, self._loss_scale_tensor)
            self._layer_patch.add_hook(self._numerics)
        return True

    def _start_sample(self) -> int:
        """Returns the exact step the sampled call starts at."""
        if not self._forensic_due:
            self._steps_since_sample = 0
        return self._optimizer_step()

    def _loss_scale_tensor(self):
        if self._loss_scale is None:
            return tf.constant(1.0)
        if self._tf_keras:
            return tf.convert_to_tensor(self.model.optimizer.loss_scale)
        return tf.convert_to_tensor(self.model.optimizer.dynamic_scale)

    def _write_numerics_sample(self, step: int, steps: int) -> None:
        """Reads one sample; it is written with the next batch of records."""
        sample = self._numerics.read()
        loss = sample.pop("loss")
        if self._loss_health is not None and self._loss_health.available:
            loss = self._loss_health.last_loss()
        forensic = self._forensic_due
        if forensic:
            self._forensic_used += 1
            self._forensic_due = False
        layout = self._numerics.layout(self._policy_max())
        if layout != self._layout_written:
            self._write_numerics()  # samples of the old layout go first
            self._writer.write_json(schema.NUMERICS_LAYOUT, layout, step)
            self._layout_written = layout
        scale = float(self._loss_scale_tensor().numpy())
        sample[schema.NUMERICS_STEP] = np.array([step, loss, scale, float(forensic), steps])
        self._pending_samples.append(sample)
        if len(self._pending_samples) >= _MAX_PENDING_SAMPLES:
            self._write_numerics()

    def _write_numerics(self) -> None:
        """Writes the pending samples, each record as one [samples, ...] array."""
        if not self._pending_samples:
            return
        samples, self._pending_samples = self._pending_samples, []
        step = int(samples[0][schema.NUMERICS_STEP][0])
        for record in samples[0]:
            self._writer.write_array(record, np.stack([s[record] for s in samples]), step)

    def _watch_for_overflows(self, reported) -> None:
        """Arms a forensic sample for the next step after a new overflow.

        `reported`: the count the step returned in its logs, if it did.
        """
        if self.numerics_every is None or self._forensic_used >= self.forensic_budget:
            return
        skipped = int(reported) if reported is not None else self._skipped_steps()
        if skipped > self._overflows_seen:
            self._forensic_due = True
        self._overflows_seen = skipped

    def _policy_max(self) -> float:
        return _POLICY_MAX.get(self.model.dtype_policy.compute_dtype, _POLICY_MAX["float32"])

    # Health: the loss and the weights.

    def _check_weights(self) -> None:
        self._nonfinite_weights = [
            tf_keras_support.variable_path(w) for w in self.model.weights
            if tf_keras_support.is_float_variable(w)
            and not bool(tf.reduce_all(tf.math.is_finite(tf.convert_to_tensor(w))))
        ]
        self._writer.write_json(schema.HEALTH, self._health(), self._step)

    def _health(self) -> dict:
        """The HEALTH record: the loss (in-graph counters) and the weights."""
        if self._loss_health is not None and self._loss_health.available:
            loss = self._loss_health.read()
        else:
            loss = {"first_nonfinite_loss_step": None, "nonfinite_loss_steps": None}
        return {**loss, "nonfinite_weights": self._nonfinite_weights, "checked_step": self._step}

    def _loss_health_collector(self, model) -> LossHealthCollector | None:
        if model.optimizer is None:
            return None
        if self._loss_health is not None and self._loss_health.optimizer is model.optimizer:
            return self._loss_health
        step = self._loss_scale.graph_step if self._loss_scale is not None else (
            lambda: tf.convert_to_tensor(model.optimizer.iterations)
        )
        # tf-keras optimizers have no scale_loss: its train step calls minimize.
        collector = TfKerasLossHealthCollector if self._tf_keras else LossHealthCollector
        return collector(model.optimizer, model.distribute_strategy, step)

    # Loss scale.

    def _loss_scale_collector(self, model) -> LossScaleCollector | None:
        optimizer = model.optimizer
        if self._tf_keras:
            is_lso = tf_keras_support.is_loss_scale_optimizer(optimizer)
            collector = TfKerasLossScaleCollector
        else:
            is_lso = is_loss_scale_optimizer(optimizer)
            collector = LossScaleCollector
        if not is_lso:
            return None
        if self._loss_scale is not None and self._loss_scale.optimizer is optimizer:
            return self._loss_scale  # keeps counting skipped steps across fits
        capacity = max(1024, 2 * (self.flush_every_steps + self._steps_per_execution()))
        return collector(optimizer, model.distribute_strategy, capacity)

    def _read_loss_scale(self) -> None:
        if self._loss_scale is None:
            return
        events, progress = self._loss_scale.read()
        step = int(progress[0])
        if len(events):
            self._writer.write_array(schema.LOSS_SCALE_EVENTS, events, step)
        self._writer.write_array(schema.LOSS_SCALE_PROGRESS, progress, step)

    def _skipped_steps(self) -> int:
        return self._loss_scale.skipped_steps() if self._loss_scale is not None else 0

    def _optimizer_step(self) -> int:
        """Steps run so far: iterations, plus skipped steps under loss scaling."""
        if self._loss_scale is not None:
            return self._loss_scale.current_step()
        optimizer = self.model.optimizer
        return int(optimizer.iterations.numpy()) if optimizer is not None else 0

    def _steps_per_execution(self) -> int:
        return tf_keras_support.steps_per_execution(self.model)

    # Ending a fit.

    def _abort(self) -> None:
        """`fit` is raising from inside a train step: keep what was recorded."""
        try:
            self._finish()
        except Exception as e:  # noqa: BLE001 - the original error matters more
            print(f"mpprof: could not save the last records ({e})")

    def _finish(self) -> None:
        if self._writer is None:
            return
        atexit.unregister(self._finish)
        try:
            self._finish_gpu()
            self._read_loss_scale()
            self._write_numerics()
            self._check_weights()
            self._write_context()
        finally:
            self._release_gpu()
            self._restore_model()
            self._writer.close()
            self._writer = None
            if self._worker_writer is not None:
                self._worker_writer.close()
                self._worker_writer = None

    def _restore_model(self) -> None:
        self._layer_patch.remove()
        if self._loss_scale is not None:
            self._loss_scale.remove()
        if self._numerics is not None:
            self._numerics.remove()
        if self._loss_health is not None:
            self._loss_health.remove()
        if "train_step" in vars(self.model):
            del self.model.train_step
        if self.model.train_function == self._run_train_function:
            self.model.train_function = self._original_function
        self._plain_function = self._instrumented_function = None

    def _context(self) -> dict:
        if self._loss_scale is not None:
            loss_scale = {"state": "ok", **self._loss_scale.settings()}
            replicas = int(self.model.distribute_strategy.num_replicas_in_sync)
            loss_scale.setdefault("skip_decided_by", keras_3_skip_decided_by(replicas))
        else:
            loss_scale = {
                "state": "absent",
                "reason": (
                    f"the optimizer is a {type(self.model.optimizer).__name__}, not a "
                    "LossScaleOptimizer: no dynamic loss scale to record"
                ),
            }
        if self.numerics_every is None:
            numerics = {"state": "off", "reason": "numerics_every=None"}
        else:
            numerics = {
                "state": "ok",
                "every": self.numerics_every,
                "forensic_budget": self.forensic_budget,
                "forensic_used": self._forensic_used,
            }
        context = run_context(
            self.model,
            collectors={
                "precision": {"state": "ok", "traced": self._precision.traced},
                "loss_scale": loss_scale,
                "numerics": numerics,
                **self._gpu_context(),
            },
            hardware=self._hardware,
            step=self._fit_start_step,
            fit_count=self._fit_count,
        )
        context["distributed"] = self._role.describe(schema.TRAIN_RUN)
        if self._distribution_note is not None:
            context["distributed"]["note"] = self._distribution_note
        return context

    # Distribution: which process writes what (mpprof.distributed).

    def _check_distribution(self) -> str | None:
        """Says once, at train begin, what cannot work under this strategy."""
        # One local worker is fine; Keras 3's fit fails across worker processes.
        if self._tf_keras or not self._role.multi_worker:
            return None
        return announce_keras_3_multi_worker()

    def _open_writers(
        self, role: WorkerRole
    ) -> tuple[RecordWriter | DiscardingWriter, RecordWriter | None]:
        """(model-level writer, this worker's own writer or None)."""
        model_writer = _open_writer(self.run_dir) if role.is_chief else DiscardingWriter()
        if role.worker_run is None:
            return model_writer, None
        try:
            return model_writer, _open_writer(posixpath.join(self.run_dir, role.worker_run))
        except BaseException:
            model_writer.close()
            raise

    @property
    def _host_writer(self):
        """Where this host's own records (GPU samples, kernel share) go."""
        return self._worker_writer if self._worker_writer is not None else self._writer

    def _write_context(self) -> None:
        context = self._context()
        gpu = context["collectors"]["gpu"]
        if self._worker_writer is not None:
            # GPU samples belong to hosts: point the model run at every worker's.
            gpu["samples_in_runs"] = context["distributed"]["worker_runs"]
        self._writer.write_json(schema.RUN_CONTEXT, context, self._step)
        if self._worker_writer is not None:
            gpu["samples_in_runs"] = [context["distributed"]["worker_run"]]
            context["run_role"] = "worker"
            context["worker_evidence"] = {
                "steps_run": self._step,
                "skipped_steps": self._skipped_steps(),
                **self._health(),
            }
            self._worker_writer.write_json(schema.RUN_CONTEXT, context, self._step)

    # GPU sampler and XProf window (mpprof.collectors.gpu / .kernels). The
    # sampler thread only queues rows: this thread writes them.

    def _start_gpu(self) -> None:
        self._gpu = None
        if self.gpu_interval is not None:
            self._gpu = gpu_collector.GpuSampler(self.gpu_interval)
            self._gpu.step = self._step
            self._gpu.start()
        self._hardware = hardware_facts(self._gpu)
        if self._profile_window is not None:
            siblings = kernel_collector.sibling_callbacks(self)
            self._profile_window.begin(self._step, siblings)

    def _after_step_gpu(self) -> None:
        if self._gpu is not None:
            self._gpu.step = self._step
            # Write before the ring buffer would overwrite unwritten rows.
            if self._gpu.pending_rows >= self._gpu.capacity_rows // 2:
                self._write_gpu_samples()
        if self._profile_window is not None:
            self._write_kernel_stats(self._profile_window.after_steps(self._step))

    def _write_gpu_samples(self) -> None:
        if self._gpu is None:
            return
        rows = self._gpu.drain()
        if len(rows):
            self._host_writer.write_array(schema.GPU_SAMPLES, rows, int(rows[-1, 1]))

    def _write_kernel_stats(self, result: dict | None) -> None:
        if result is not None:
            self._host_writer.write_json(schema.KERNEL_STATS, result, self._step)

    def _finish_gpu(self) -> None:
        try:
            if self._gpu is not None:
                self._gpu.stop()
                self._write_gpu_samples()
            if self._profile_window is not None:
                self._write_kernel_stats(self._profile_window.finish())
        except Exception as e:  # noqa: BLE001 - GPU records must not cost the others
            print(f"mpprof: could not save the GPU records ({e})")

    def _release_gpu(self) -> None:
        if self._gpu is not None:
            self._gpu.stop()  # idempotent: the thread never outlives fit

    def _gpu_context(self) -> dict:
        if self._gpu is not None:
            collectors = {"gpu": self._gpu.context()}
        else:
            collectors = {"gpu": {
                "state": "unavailable", "mode": gpu_collector.MODE_UNAVAILABLE,
                "reason": "the GPU sampler is off (gpu_interval=None)",
                "interval_s": None,
            }}
        if self._profile_window is not None:
            collectors["kernels"] = self._profile_window.context()
        return collectors


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


def _non_negative_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)
