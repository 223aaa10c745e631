"""The `MixedPrecisionProfiler` Keras callback."""

from __future__ import annotations

import atexit
import os
import posixpath
import weakref

import keras

from mpprof import arguments, schema, tf_keras_support
from mpprof.collectors import gpu as gpu_collector
from mpprof.collectors import kernels as kernel_collector
from mpprof.collectors.base import Collector
from mpprof.collectors.float8 import Float8State
from mpprof.collectors.float8_shares import Float8Shares
from mpprof.collectors.host import HostRecorder
from mpprof.collectors.inventory import Inventory
from mpprof.collectors.loss_scales import LossScales
from mpprof.collectors.numerics_samples import NumericsSamples
from mpprof.collectors.optimizers import OptimizerUsage
from mpprof.collectors.run_health import RunHealth
from mpprof.context import run_context
from mpprof.distributed import (
    announce_keras_3_multi_worker,
    warn_if_keras_3_multi_worker,
    worker_role,
)
from mpprof.fit_state import FitState
from mpprof.guard import Guard
from mpprof.hard_stop import FlushClock, SigtermFlush
from mpprof.keras_api import check_backend, keras_api_for
from mpprof.patching import Patches
from mpprof.routing import RecordRouting
from mpprof.sampling import SampleSchedule
from mpprof.train_functions import TrainFunctions

# The key under which the plain train step reports the skipped-step count in
# its logs (taken out before Keras sees them): reading a tensor the step
# already returns is far cheaper than a variable read per step.
_SKIPPED_LOG = "_mpprof_skipped_steps"

# The loss-scale ring holds 2x the steps between two reads: more than this
# many steps between reads would make it large for nothing.
MAX_FLUSH_EVERY_STEPS = 100_000

# The profiler running a fit on each model, to refuse a second one in the
# same fit and to finish one whose fit was ended by another's exception.
_ACTIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class MixedPrecisionProfiler(keras.callbacks.Callback):
    """Records what mixed precision does to a training run, for TensorBoard.

    Add it to `model.fit`. It records, into `log_dir/train/`:

    - the precision inventory: every layer's policy, compute/variable dtype,
      the dtypes it actually outputs, float32 islands, casts between layers
      and Tensor Core shape alignment (once per fit, at trace time);
    - the dynamic loss scale of every LossScaleOptimizer the train step uses
      (a GAN's own optimizers included) and every overflow (skipped step) and
      growth, exact to the step, counted inside the traced train step;
    - per-layer numerics on sampled steps: for each leaf layer's output and
      the gradient flowing into it, the abs-max, non-finite, zero and
      underflow shares and a log2 histogram; for each variable its gradient,
      scaled and unscaled. Steps right after an overflow are sampled too
      (forensic samples), up to `forensic_budget`;
    - the loss and weights health, and the run context: versions, policies,
      the optimizers the step used, strategy, devices, and each collector's
      state.

    Steps that are not sampled run the model's own train function, untouched.

    mpprof never stops training: whatever one of its collectors raises while
    recording switches that collector off for the rest of the fit (the run
    context names it and the reason, one warning says so), and a failed
    write (a full disk) stops the recording, not the training. The user's
    own errors reach `fit`'s caller unchanged.

    Records reach the disk every `flush_every_steps` steps or
    `flush_every_seconds` seconds, whichever comes first, at every epoch end,
    when `fit` ends or raises and on SIGTERM: a process killed outright
    (SIGKILL, the OOM killer) loses at most that much.

    The same class profiles Keras 3 (TensorFlow backend) and tf-keras
    (Keras 2) models, under any `tf.distribute` strategy their `fit`
    supports. Under a multi-worker `MultiWorkerMirroredStrategy` (tf-keras)
    the chief writes the model-level records into `log_dir/train` and every
    worker its own host's records into `log_dir/train/worker_<i>`. Read the
    records with `tensorboard --logdir LOG_DIR` (the "mpprof" tab),
    `mpprof diagnose LOG_DIR`, or `mpprof.reader.read_logdir(LOG_DIR)`.

    The model is left as found: every patch is removed when `fit` ends or
    raises inside a train step, and `model.save()` works after `fit`.

    Args:
        log_dir: directory to write into (local or any `tf.io.gfile` path);
            the same `log_dir` as `keras.callbacks.TensorBoard` is fine.
        numerics_every: sample per-layer numerics every this many train
            steps; None turns sampling off (forensic samples too).
        forensic_budget: how many overflow-triggered samples a fit may take.
        forensic_spacing: least train steps between two forensic samples, so
            that a run overflowing on many early steps is not mostly
            instrumented.
        flush_every_steps: how often, in train steps, the host reads the
            in-graph loss-scale counters and writes the pending records; at
            most `MAX_FLUSH_EVERY_STEPS`.
        flush_every_seconds: the same, in seconds (checked after each train
            call); None: by steps only.
        gpu_interval: seconds between NVML samples of every visible GPU
            (Tensor Core utilization on Hopper+ via GPM, otherwise kernel
            utilization, memory, power, clocks); >= 0.1, or None to turn
            the sampler off. Without NVML or a GPU the run context says so.
        profile_steps: (start, stop) train steps to capture an XProf trace
            of, inclusive; after the window mpprof records the share of GPU
            kernel time spent in Tensor Core kernels. None (default) traces
            nothing. A `keras.callbacks.TensorBoard(profile_batch=...)` in the
            same fit owns the profiler: mpprof reads its trace instead.

    Raises:
        ValueError: an argument is out of range.
        mpprof.keras_api.UnsupportedBackendError: Keras runs on another
            backend than TensorFlow.

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
        forensic_spacing: int = 50,
        flush_every_steps: int = 500,
        flush_every_seconds: float | None = 30.0,
        gpu_interval: float | None = gpu_collector.DEFAULT_INTERVAL_S,
        profile_steps: tuple[int, int] | None = None,
    ):
        super().__init__()
        check_backend()
        self.log_dir = arguments.log_dir(log_dir)
        self.numerics_every = (
            None if numerics_every is None
            else arguments.positive_int("numerics_every", numerics_every)
        )
        self.forensic_budget = arguments.non_negative_int("forensic_budget", forensic_budget)
        self.forensic_spacing = arguments.positive_int("forensic_spacing", forensic_spacing)
        self.flush_every_steps = arguments.positive_int(
            "flush_every_steps", flush_every_steps, at_most=MAX_FLUSH_EVERY_STEPS
        )
        self.flush_every_seconds = (
            None if flush_every_seconds is None
            else arguments.seconds("flush_every_seconds", flush_every_seconds,
                                   at_least=0.1, what=", or None")
        )
        self.gpu_interval = (
            None if gpu_interval is None else gpu_collector.validate_interval(gpu_interval)
        )
        self.profile_steps = kernel_collector.validate_profile_steps(profile_steps)
        self._schedule = SampleSchedule(
            self.numerics_every, self.forensic_budget, self.forensic_spacing
        )
        self._profile_window = (
            kernel_collector.ProfileWindow(*self.profile_steps, self.run_dir)
            if self.profile_steps else None
        )
        self._routing: RecordRouting | None = None
        self._fit_count = 0
        self._last_step: int | None = None
        # Collectors of earlier fits, by optimizer: their counters go on.
        self._earlier_loss_scales: dict[int, object] = {}
        self._earlier_health: dict[int, object] = {}
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
        api = keras_api_for(model)
        self._take_over(model, api)
        self._role = worker_role(model.distribute_strategy)
        self._distribution_note = (
            announce_keras_3_multi_worker()
            if self._role.multi_worker and not api.fits_across_workers else None
        )
        self._guard = Guard()
        self._routing = RecordRouting(self.run_dir, self._role, self._guard)
        self._patches = Patches()
        self._fit_state = schema.FIT_RUNNING
        self._fit_count += 1
        self._fit: FitState | None = None
        self._collectors: list[Collector] = []
        self._sigterm = SigtermFlush(self._flush)
        atexit.register(self._finish_unended)
        try:
            self._begin(model, api)
        except Exception as e:  # noqa: BLE001 - mpprof's failure must not stop fit
            self._guard.fail("profiler", e)
            self._fit_state = schema.FIT_FAILED
            self._finish()

    def _begin(self, model, api) -> None:
        strategy = model.distribute_strategy
        usage = OptimizerUsage(api, model)
        self._schedule.start_fit()
        fit = FitState(
            model=model, guard=self._guard, writer=self._routing.model,
            host_writer=self._routing.host, usage=usage,
            schedule=self._schedule,
        )
        capacity = 2 * (self.flush_every_steps + _steps_per_execution(model))
        self._inventory = Inventory(model, self._guard)
        self._loss_scales = LossScales(api, usage, strategy, capacity, self._earlier_loss_scales)
        self._health = RunHealth(api, usage, strategy, self._loss_scales.graph_step_of,
                                 self._earlier_health)
        self._numerics = NumericsSamples(
            api.numerics_collector, self._inventory, self._loss_scales, self._health,
            {"every": self.numerics_every, "forensic_budget": self.forensic_budget,
             "forensic_spacing": self.forensic_spacing},
        )
        if self._profile_window is not None and self._role.worker_run is not None:
            # Each worker traces its own host, into its own run.
            self._profile_window.run_dir = posixpath.join(self.run_dir, self._role.worker_run)
        self._host = HostRecorder(self.gpu_interval, self._profile_window, self, api)
        self._float8_shares = Float8Shares(model, self.numerics_every is not None)
        self._collectors = [
            self._inventory, self._loss_scales, self._health, self._numerics, self._host,
            Float8State(model, self._loss_scales), self._float8_shares,
        ]
        fit.step = self._start_step(usage)
        self._fit_start_step = fit.step
        self._steps_since_flush = 0
        self._flush_clock = FlushClock(self.flush_every_seconds)
        self._batch_pending = False
        usage.install(self._patches)
        self._report_skips_in_logs(fit)
        self._functions = TrainFunctions(model, api, self.numerics_every is not None)
        self._functions.install(self._run_train_function, self._patches)
        self._fit = fit
        for collector in self._collectors:
            self._guard.run(collector.name, collector.install, fit, self._patches)
        self._sigterm.install()
        self._write_context()

    # No on_train_batch_end: overriding it makes Keras wait for every step's
    # logs. The work after a step is done in _run_train_function instead.
    def on_train_batch_begin(self, batch, logs=None):
        self._batch_pending = True

    def on_epoch_end(self, epoch, logs=None):
        if self._fit is None:
            return
        self._guard.run(self._health.name, self._health.check_weights, self.model)
        self._flush()

    def on_train_end(self, logs=None):
        self._fit_state = schema.FIT_ENDED
        self._finish()

    # The train function fit calls while this profiler runs.

    def _run_train_function(self, iterator):
        fit = self._fit
        if not self._batch_pending or fit is None:
            # Called outside a profiled batch: a later fit or train_on_batch
            # after this fit was stopped by someone else's exception.
            self._fit_state = schema.FIT_FAILED
            self._finish()
            return self.model.train_function(iterator)
        self._batch_pending = False
        numerics = self._numerics
        sampling = (self._functions.instrumented is not None
                    and self._schedule.due(fit.calls)
                    and bool(self._guard.run(numerics.name, numerics.prepare, fit)))
        fit.forensic = self._schedule.sampled() if sampling else False
        fit.sample_step = self._measured_step() if sampling else None
        numerics.instrument(sampling)
        shares = self._float8_shares
        self._guard.run(shares.name, shares.instrument, sampling)
        try:
            logs = self._functions.run(
                iterator, sampling, on_abort=self._abort,
                on_instrumented_failure=lambda reason: self._guard.fail(numerics.name, reason),
            )
        finally:
            numerics.instrument(False)
            shares.instrument(False)  # puts the layers' activations back, also after a failure
        fit.reported_skips = logs.pop(_SKIPPED_LOG, None) if isinstance(logs, dict) else None
        self._guard.run("profiler", self._after_call, fit)
        return logs

    def _report_skips_in_logs(self, fit) -> None:
        """Makes the train step return the skipped-step count in its logs
        (Keras 3, while forensic samples can still be taken)."""
        skipped = self._loss_scales.skipped_total
        if (not fit.usage.watched or not self._loss_scales.by_name
                or not self._schedule.watching_overflows):
            return
        train_step = self.model.train_step

        def train_step_reporting_skips(data):
            logs = train_step(data)
            if not isinstance(logs, dict):
                return logs
            return {**logs, _SKIPPED_LOG: skipped()}

        self._patches.set(self.model, "train_step", train_step_reporting_skips)

    def _after_call(self, fit: FitState) -> None:
        """Bookkeeping after each call; reads the device only when it must."""
        first_call = fit.calls == 0
        fit.calls += 1
        steps = _steps_per_execution(self.model)  # exact but for an epoch's last call
        fit.step += steps
        self._steps_since_flush += steps
        self._schedule.after_call(steps)
        if first_call:
            # Tracing showed which optimizers the step uses: say so at once,
            # with where their loss scales start.
            fit.usage.mark_traced()
            fit.step = self._measured_step()
            self._guard.run(self._loss_scales.name, self._loss_scales.flush, fit)
            self._write_context()
        elif fit.sample_step is not None:
            fit.step = self._measured_step()
        for collector in self._collectors:
            self._guard.run(collector.name, collector.after_call, fit)
        if self._steps_since_flush >= self.flush_every_steps or self._flush_clock.due():
            self._flush()

    # Steps.

    def _start_step(self, usage) -> int:
        if self._last_step is not None:
            return self._last_step
        return self._loss_scales.step_of(usage.uses[0]) if usage.uses else 0

    def _measured_step(self) -> int:
        """Steps run so far: the primary optimizer's (iterations, plus skipped
        steps under loss scaling) or, when the step applies no optimizer,
        the host's count of steps run."""
        fit = self._fit
        primary = fit.usage.primary() if fit.usage.traced else None
        if primary is None or (primary.loss_scale and not self._guard.ok("loss_scale")):
            return fit.step
        return self._loss_scales.step_of(primary)

    # Writing.

    def _flush(self) -> None:
        """Reads the in-graph counters and writes every pending record."""
        fit = self._fit
        if fit is None or self._routing is None:
            return
        fit.step = self._guard.run("profiler", self._measured_step) or fit.step
        for collector in self._collectors:
            self._guard.run(collector.name, collector.flush, fit)
        self._write_context()
        self._routing.flush()
        self._steps_since_flush = 0
        self._flush_clock.reset()

    # Ending a fit.

    def _abort(self) -> None:
        """`fit` is raising from inside a train step: keep what was recorded."""
        self._fit_state = schema.FIT_FAILED
        self._finish()

    def _finish_unended(self) -> None:
        """At interpreter exit, for a fit that never reached its end."""
        self._fit_state = schema.FIT_FAILED
        self._finish()

    def _finish(self) -> None:
        if self._routing is None:
            return
        atexit.unregister(self._finish_unended)
        self._sigterm.remove()
        fit = self._fit
        try:
            if fit is not None:
                for collector in self._collectors:
                    self._guard.run(collector.name, collector.end, fit)
                self._flush()
                self._last_step = fit.step
                self._earlier_loss_scales = {
                    id(c.optimizer): c for c in self._loss_scales.by_name.values()
                }
                self._earlier_health = self._health.by_optimizer()
            else:
                self._write_context()
        finally:
            if fit is not None:
                self._host.release()
                self._inventory.remove()
                self._numerics.remove()
                self._functions.release()
            for failure in self._patches.restore():
                print(f"mpprof: could not undo a patch ({failure})")
            self._fit = None
            self._routing.close()
            self._routing = None
            if _ACTIVE.get(self.model) is self:
                del _ACTIVE[self.model]

    def _take_over(self, model, keras_api) -> None:
        """Refuses a second profiler in the same fit; finishes one left behind
        by a fit that another callback's exception ended."""
        other = _ACTIVE.get(model)
        if other is not None and other is not self:
            siblings = kernel_collector.sibling_callbacks(self, keras_api.callback_list_class)
            if any(c is other for c in siblings):
                raise ValueError(
                    "Two mpprof.MixedPrecisionProfiler callbacks in one fit: they would "
                    "patch the same train step. Pass one (it records everything)."
                )
            other._fit_state = schema.FIT_FAILED
            other._finish()
        elif other is self:
            self._fit_state = schema.FIT_FAILED
            self._finish()
        _ACTIVE[model] = self

    # The run context.

    def _context(self) -> dict:
        fit = self._fit
        collectors = {c.name: self._guard.context(c.name, c.context()) for c in self._collectors}
        if fit is not None:
            collectors[self._numerics.name].setdefault(
                "forensic_used", self._schedule.forensic_used
            )
            kernels = self._host.kernels_context()
            if kernels is not None:
                collectors["kernels"] = self._guard.context(self._host.name, kernels)
        for name in ("recording", "profiler", "run_context"):
            if not self._guard.ok(name):
                collectors[name] = self._guard.context(name, {})
        step = fit.step if fit is not None else self._last_step or 0
        context = run_context(
            self.model, collectors=collectors,
            hardware=self._host.hardware if fit is not None else None,
            step=self._fit_start_step if fit is not None else step,
            fit_count=self._fit_count,
        )
        if fit is not None:
            context["optimizers"] = fit.usage.describe()
            primary = fit.usage.primary() if fit.usage.traced else None
            if primary is not None:
                context["optimizer"] = type(primary.optimizer).__name__
        context["fit_state"] = self._fit_state
        context["records_reach_disk"] = {
            "every_steps": self.flush_every_steps,
            "every_seconds": self.flush_every_seconds,
            "on_sigterm": self._sigterm.state,
        }
        context["distributed"] = self._role.describe(schema.TRAIN_RUN)
        if self._distribution_note is not None:
            context["distributed"]["note"] = self._distribution_note
        return context

    def _write_context(self) -> None:
        self._guard.run("run_context", self._write_contexts)

    def _write_contexts(self) -> None:
        fit = self._fit
        step = fit.step if fit is not None else self._last_step or 0
        evidence = None
        if fit is not None and self._routing.worker is not None:
            health = self._guard.run(self._health.name, self._health.record, step) or {}
            evidence = {"steps_run": step, "skipped_steps": self._loss_scales.skipped_steps(),
                        **health}
        self._routing.write_context(self._context(), step, evidence)


def _steps_per_execution(model) -> int:
    return tf_keras_support.steps_per_execution(model)
