"""The `MixedPrecisionProfiler` Keras callback."""

from __future__ import annotations

import os

import keras

from mpprof.backends import check_backend
from mpprof.recording import profiled_fit
from mpprof.recording.across_fits import AcrossFits
from mpprof.recording.distributed import warn_if_keras_3_multi_worker
from mpprof.recording.nvml import sampler
from mpprof.recording.sampling import DEFAULT_NUMERICS_EVERY, SampleSchedule
from mpprof.recording.settings import Settings
from mpprof.records import run_context


class MixedPrecisionProfiler(keras.callbacks.Callback):
    """Records what mixed precision does to a training run, for TensorBoard.

    Add it to `model.fit`. It records, into `log_dir/train/`:

    - the precision inventory: every layer's policy, compute/variable dtype,
      the dtypes it actually outputs, float32 islands, casts between layers
      and Tensor Core shape alignment (once per fit, at trace time);
    - the dynamic loss scale of every LossScaleOptimizer the train step uses
      (a GAN's own optimizers included) and every overflow (skipped step) and
      growth, exact to the step: overflows recorded inside the traced train
      step, growths derived from them at each read (and checked);
    - per-layer numerics on sampled steps: for each leaf layer's output and
      the gradient flowing into it, the abs-max, non-finite, zero and
      underflow shares and a log2 histogram; for each variable its gradient,
      scaled and unscaled. Steps right after an overflow are sampled too
      (forensic samples), up to `forensic_budget`;
    - the loss and weights health, and the run context: versions, policies,
      the optimizers the step used, strategy, devices, and each collector's
      state;
    - replay captures: when a sampled step overflowed or had a non-finite
      loss, its batch, the weights it ran with, the model's config and every
      layer's dtype policy go to `log_dir/train/replay/step_<N>@<writer>/` (up to
      `replay_budget` per fit), for `mpprof replay LOG_DIR` to run that step
      again offline: the first op that overflowed, float16 against float32
      per layer, and a verified per-layer float32 fix.

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

    The same class profiles Keras 3 models on TensorFlow, JAX or PyTorch and
    tf-keras (Keras 2) models, under any `tf.distribute` strategy (or, on JAX,
    `keras.distribution.DataParallel`) their `fit` supports. Under a
    multi-worker `MultiWorkerMirroredStrategy` (tf-keras) the chief writes
    the model-level records into `log_dir/train` and every worker its own
    host's records into `log_dir/train/worker_<i>`. Read the
    records with `tensorboard --logdir LOG_DIR` (the "mpprof" tab),
    `mpprof diagnose LOG_DIR`, or `mpprof.reader.read_logdir(LOG_DIR)`.

    The model is left as found: every patch is removed when `fit` ends or
    raises inside a train step, and `model.save()` works after `fit`.

    Args:
        log_dir: directory to write into (local, or any fsspec URL such as
            `s3://bucket/logs` with `mpprof[s3]` installed);
            the same `log_dir` as `keras.callbacks.TensorBoard` is fine.
        numerics_every: sample per-layer numerics every this many train
            steps; None turns sampling off (forensic samples too). Left at
            its default (500), each fit also samples its steps 1, 10 and 100,
            so that a fit shorter than the interval is not blind; an interval
            you pass is kept as given.
        forensic_budget: how many overflow-triggered samples a fit may take.
        forensic_spacing: least train steps between two forensic samples, so
            that a run overflowing on many early steps is not mostly
            instrumented.
        flush_every_steps: how often, in train steps, the host reads the
            in-graph loss-scale counters and writes the pending records; at
            most 100,000 (`mpprof.recording.settings.MAX_FLUSH_EVERY_STEPS`).
        flush_every_seconds: the same, in seconds (checked after each train
            call); None: by steps only.
        gpu_interval: seconds between NVML samples of every visible GPU
            (Tensor Core utilization on Hopper+ via GPM, otherwise kernel
            utilization, memory, power, clocks); >= 0.1, or None to turn
            the sampler off. Without NVML or a GPU the run context says so.
        replay_budget: how many replay captures a fit may write (0: none).
            Each holds one batch and one copy of the weights (Keras 3, one
            replica; only sampled steps are checked, so `numerics_every=None`
            captures nothing).
        advise_batches: how many of the run's own batches to keep, with the
            weights at that step, for the precision advisor to verify its plan
            on (`mpprof advise LOG_DIR --verify`), spread across the fit: the
            first numerics-sampled step at or after the middle of each of N
            equal parts of the fit (`log_dir/train/advise/step_<N>/`, the
            same files as a replay capture; Keras 3, one replica). 0: none.
        profile_steps: (start, stop) train steps to trace, inclusive (an
            XProf trace on TensorFlow and JAX, `torch.profiler`'s on
            PyTorch); after the window mpprof records the share of GPU
            kernel time spent in Tensor Core kernels. None (default) traces
            nothing. A `keras.callbacks.TensorBoard(profile_batch=...)` in the
            same fit owns the profiler: mpprof reads its trace instead.

    Raises:
        ValueError: an argument is out of range.
        mpprof.backends.UnsupportedBackendError: Keras runs on a backend
            mpprof has no registration for (`mpprof.backends.REGISTRY`:
            TensorFlow, JAX and PyTorch).

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
        numerics_every: int | None = DEFAULT_NUMERICS_EVERY,
        forensic_budget: int = 20,
        forensic_spacing: int = 50,
        flush_every_steps: int = 500,
        flush_every_seconds: float | None = 30.0,
        gpu_interval: float | None = sampler.DEFAULT_INTERVAL_S,
        profile_steps: tuple[int, int] | None = None,
        replay_budget: int = 2,
        advise_batches: int = 0,
    ):
        super().__init__()
        check_backend()
        self.settings = Settings.checked(
            log_dir, numerics_every=numerics_every, forensic_budget=forensic_budget,
            forensic_spacing=forensic_spacing, flush_every_steps=flush_every_steps,
            flush_every_seconds=flush_every_seconds, gpu_interval=gpu_interval,
            profile_steps=profile_steps, replay_budget=replay_budget,
            advise_batches=advise_batches,
        )
        self._across_fits = AcrossFits(
            schedule=SampleSchedule(
                self.settings.numerics_every, self.settings.forensic_budget,
                self.settings.forensic_spacing, early=self.settings.numerics_default,
            ),
        )
        # The fit being profiled (or the last one).
        self._fit: profiled_fit.ProfiledFit | None = None
        # Keras 3's fit fails across workers before any hook runs: say it now.
        warn_if_keras_3_multi_worker()

    @property
    def log_dir(self) -> str:
        return self.settings.log_dir

    @property
    def run_dir(self) -> str:
        return self.settings.run_dir

    # tf-keras's CallbackList asks every callback these (Keras 3 callbacks do
    # not have them), so the one class serves models of either Keras.
    _supports_tf_logs = True  # batch logs are not read: tf-keras need not sync them
    _chief_worker_only = None  # every worker runs it: see mpprof.recording.distributed

    def _implements_train_batch_hooks(self) -> bool:
        return True

    def _implements_test_batch_hooks(self) -> bool:
        return False

    def _implements_predict_batch_hooks(self) -> bool:
        return False

    # Keras hooks.

    def on_train_begin(self, logs=None):
        self._fit = profiled_fit.start(self, self.settings, self._across_fits)

    # No on_train_batch_end: overriding it makes Keras wait for every step's
    # logs. The work after a step is done in ProfiledFit._run_train_function.
    def on_train_batch_begin(self, batch, logs=None):
        if self._fit is not None:
            self._fit.batch_begin()

    def on_epoch_end(self, epoch, logs=None):
        if self._fit is not None:
            self._fit.epoch_end()

    def on_train_end(self, logs=None):
        if self._fit is not None:
            self._fit.finish(run_context.FIT_ENDED)
