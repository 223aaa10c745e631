"""mpprof never breaks the user's training: real fits that used to crash,
mpprof's own failures injected collector by collector, bad arguments, a full
disk, and the user's own errors passing through unchanged."""

import os
import subprocess
import sys
import textwrap
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import mpprof
from mpprof import cli
from mpprof.backends.tensorflow.loss_scale_series import LossScaleSeries
from mpprof.backends.tensorflow.loss_scales import LossScales
from mpprof.backends.tensorflow.loss_watch import LossWatch
from mpprof.backends.tensorflow.numerics_taps import NumericsTaps
from mpprof.backends.tensorflow.precision_tracer import PrecisionTracer
from mpprof.backends.tensorflow.run_health import RunHealth
from mpprof.backends.tensorflow.train_functions import TrainFunctions
from mpprof.display.run_summary import summarize_run
from mpprof.recording.collectors.gpu_host import HostRecorder
from mpprof.recording.collectors.inventory import Inventory
from mpprof.recording.collectors.numerics_samples import NumericsSamples
from mpprof.recording.profiled_fit import ProfiledFit
from mpprof.records import reader, run_context

TESTS = os.path.dirname(os.path.abspath(__file__))


class TwoOptimizerGan(keras.Model):
    """A GAN whose train_step uses its own optimizers; `model.optimizer` (what
    compile got) is never used."""

    def __init__(self, loss_scaled: bool):
        super().__init__()
        self.generator = keras.Sequential([
            keras.layers.Input((8,)), keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(4, dtype="float32"),
        ], name="generator")
        self.discriminator = keras.Sequential([
            keras.layers.Input((4,)), keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(1, dtype="float32"),
        ], name="discriminator")

        def optimizer():
            adam = keras.optimizers.Adam(1e-3)
            return keras.optimizers.LossScaleOptimizer(adam) if loss_scaled else adam

        self.g_opt = optimizer()
        self.d_opt = optimizer()
        self.bce = keras.losses.BinaryCrossentropy(from_logits=True)

    def call(self, inputs):
        return self.discriminator(self.generator(inputs))

    def _step(self, optimizer, variables, loss_fn):
        with tf.GradientTape() as tape:
            loss = loss_fn()
            scaled = optimizer.scale_loss(loss)
        optimizer.apply(tape.gradient(scaled, variables), variables)
        return loss

    def train_step(self, real):
        noise = tf.random.stateless_normal((tf.shape(real)[0], 8), seed=(1, 2))
        ones = tf.ones_like(real[:, :1])

        def d_loss():
            fake = self.generator(noise)
            return (self.bce(ones, self.discriminator(real))
                    + self.bce(tf.zeros_like(ones), self.discriminator(fake)))

        def g_loss():
            return self.bce(ones, self.discriminator(self.generator(noise)))

        d = self._step(self.d_opt, self.discriminator.trainable_variables, d_loss)
        g = self._step(self.g_opt, self.generator.trainable_variables, g_loss)
        return {"d_loss": d, "g_loss": g}


def _gan(loss_scaled: bool) -> TwoOptimizerGan:
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    model = TwoOptimizerGan(loss_scaled)
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.RMSprop()))
    return model


def test_gan_with_its_own_loss_scale_optimizers(tmp_path):
    model = _gan(loss_scaled=True)
    x = np.random.default_rng(0).random((64, 4), dtype=np.float32)
    model.fit(x, batch_size=16, epochs=2, verbose=0,
              callbacks=[mpprof.MixedPrecisionProfiler(str(tmp_path), numerics_every=2)])
    run = reader.read_run(str(tmp_path), "train")
    used = {o["name"]: o for o in run.context["optimizers"]}
    # The compiled RMSprop was never used: not reported as the run's optimizer.
    assert set(used) == {"d_opt", "g_opt"}
    assert all(o["loss_scale"] and o["apply_called"] and o["scale_loss_called"]
               for o in used.values())
    assert run.context["optimizer"] == "LossScaleOptimizer"
    loss_scale = run.context["collectors"]["loss_scale"]
    assert loss_scale["state"] == "ok" and set(loss_scale["series"]) == {"d_opt", "g_opt"}
    # The primary series is the first optimizer the step applied; each series
    # agrees with its own optimizer's state.
    assert loss_scale["primary"] == "d_opt" and run.loss_scales["d_opt"] is run.loss_scale
    assert set(run.loss_scales) == {"d_opt", "g_opt"}
    for name, series in run.loss_scales.items():
        optimizer = getattr(model, name)
        assert series.steps_run == int(optimizer.iterations.numpy()) + series.skipped_steps
        assert series.final_scale == float(optimizer.dynamic_scale.numpy())
    assert run.numerics is not None and len(run.numerics.steps) >= 2
    assert run.health["loss_watched"] is True
    assert "train_function" not in vars(model) or not _is_profiler_function(model)


def test_gan_with_plain_optimizers_reports_no_loss_scaling(tmp_path):
    model = _gan(loss_scaled=False)
    x = np.random.default_rng(0).random((32, 4), dtype=np.float32)
    model.fit(x, batch_size=16, epochs=1, verbose=0,
              callbacks=[mpprof.MixedPrecisionProfiler(str(tmp_path), numerics_every=1)])
    run = reader.read_run(str(tmp_path), "train")
    assert [(o["name"], o["class"], o["loss_scale"]) for o in run.context["optimizers"]] == [
        ("d_opt", "Adam", False), ("g_opt", "Adam", False)]
    assert run.context["optimizer"] == "Adam"
    assert run.context["collectors"]["loss_scale"]["state"] == "absent"
    assert "d_opt (Adam)" in run.context["collectors"]["loss_scale"]["reason"]


class NoisyInputs(keras.Model):
    """Adds noise to each batch in its train step: with TensorFlow's legacy
    `tf.random.normal`, or with `keras.random.normal` and a SeedGenerator."""

    def __init__(self, legacy_random: bool):
        super().__init__()
        self.legacy_random = legacy_random
        self.seeds = keras.random.SeedGenerator(7)
        self.hidden = keras.layers.Dense(32, activation="relu")
        self.head = keras.layers.Dense(1, dtype="float32")

    def call(self, inputs):
        return self.head(self.hidden(inputs))

    def train_step(self, data):
        x, y = data
        if self.legacy_random:
            noise = tf.random.normal(tf.shape(x), stddev=0.1)
        else:
            noise = keras.random.normal(tf.shape(x), stddev=0.1, seed=self.seeds)
        return super().train_step((x + noise, y))


def _fit_noisy(legacy_random: bool, callbacks: list, seeded: bool = True) -> keras.Model:
    if seeded:
        keras.utils.set_random_seed(0)
    else:
        tf.random.set_seed(None)  # an earlier test's global seed goes
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x, y = rng.random((64, 16), dtype=np.float32), rng.random((64, 1), dtype=np.float32)
    model = NoisyInputs(legacy_random)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    return model


def test_seeded_legacy_random_ops_switch_numerics_samples_off(tmp_path, capsys):
    """A second traced function has random ops of its own: samples would
    change a seeded run's noise, and so its weights."""
    plain = _fit_noisy(True, [])
    profiled = _fit_noisy(True, [mpprof.MixedPrecisionProfiler(
        str(tmp_path), numerics_every=2, gpu_interval=None)])
    for expected, got in zip(plain.get_weights(), profiled.get_weights(), strict=True):
        np.testing.assert_array_equal(got, expected)
    run = reader.read_run(tmp_path, "train")
    state = run.context["collectors"]["numerics"]
    assert state["state"] == "off"
    assert "RandomStandardNormal" in state["reason"]
    assert "enable_tf_random_generator" in state["reason"]
    assert run.numerics is None
    assert run.loss_scale.steps_run == 16  # the rest is recorded
    capsys.readouterr()
    cli.main(["diagnose", str(tmp_path)])
    assert "no step was sampled: the train step draws seeded random numbers" in (
        capsys.readouterr().out)


@pytest.mark.parametrize(("legacy_random", "seeded"), [(False, True), (True, False)],
                         ids=["keras_random_seeded", "legacy_random_unseeded"])
def test_random_ops_that_samples_cannot_change_keep_numerics_on(tmp_path, legacy_random,
                                                               seeded):
    """Look-alikes: a SeedGenerator's state is a variable both functions
    share; unseeded legacy ops draw anew in every run."""
    callbacks = [mpprof.MixedPrecisionProfiler(str(tmp_path), numerics_every=2,
                                               gpu_interval=None)]
    profiled = _fit_noisy(legacy_random, callbacks, seeded)
    run = reader.read_run(tmp_path, "train")
    assert run.context["collectors"]["numerics"]["state"] == "ok"
    assert len(run.numerics.steps) >= 4
    if seeded:
        plain = _fit_noisy(legacy_random, [])
        for expected, got in zip(plain.get_weights(), profiled.get_weights(), strict=True):
            np.testing.assert_array_equal(got, expected)


def test_custom_train_step_without_scale_loss_is_not_watched(tmp_path):
    class NoScaleLoss(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = keras.ops.mean((self(x, training=True) - y) ** 2)
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(grads, self.trainable_variables)
            return {"loss": loss}

    keras.mixed_precision.set_dtype_policy("mixed_float16")
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(1, dtype="float32")(keras.layers.Dense(8)(inputs))
    model = NoScaleLoss(inputs, outputs)
    model.compile(optimizer="adam")
    x = np.random.default_rng(0).random((32, 4), dtype=np.float32)
    model.fit(x, x[:, :1], batch_size=8, verbose=0,
              callbacks=[mpprof.MixedPrecisionProfiler(str(tmp_path), numerics_every=1)])
    run = reader.read_run(str(tmp_path), "train")
    [optimizer] = run.context["optimizers"]
    assert optimizer["apply_called"] is True and optimizer["scale_loss_called"] is False
    # No loss was watched: nothing is recorded as if it had been.
    assert run.health["loss_watched"] is False
    assert run.health["nonfinite_loss_steps"] is None
    assert np.isnan(run.numerics.loss).all()


def test_model_without_trainable_weights_counts_steps_from_calls(tmp_path):
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(2)])
    model.trainable = False
    model.compile(optimizer="adam", loss="mse")
    x = np.ones((40, 4), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras: "no trainable weights"
        model.fit(x, np.ones((40, 2), np.float32), batch_size=8, verbose=0,
                  callbacks=[mpprof.MixedPrecisionProfiler(str(tmp_path), numerics_every=1)])
    run = reader.read_run(str(tmp_path), "train")
    assert run.context["optimizers"] == []
    assert run.health["checked_step"] == 5
    assert run.context["collectors"]["loss_scale"]["state"] == "absent"


def test_keras_backend_other_than_tensorflow_jax_or_torch_is_refused_at_construction(tmp_path):
    # (Keras' numpy backend needs nothing installed.)
    script = "import mpprof; mpprof.MixedPrecisionProfiler('logs')"
    env = {**os.environ, "KERAS_BACKEND": "numpy"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=120, cwd=tmp_path)
    assert result.returncode != 0
    assert ("mpprof.MixedPrecisionProfiler profiles Keras on TensorFlow, JAX or PyTorch "
            "(KERAS_BACKEND is 'numpy')") in result.stderr
    assert not os.path.exists(tmp_path / "logs")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"flush_every_steps": 10**7}, "flush_every_steps must be at most 100,000"),
    ({"flush_every_steps": 10**30}, "flush_every_steps must be at most 100,000"),
    ({"flush_every_seconds": 0}, "flush_every_seconds"),
    ({"flush_every_seconds": float("nan")}, "flush_every_seconds"),
    ({"forensic_spacing": 0}, "forensic_spacing"),
    ({"log_dir": "logs\x00/x"}, "NUL"),
])
def test_bad_arguments_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        mpprof.MixedPrecisionProfiler(**{"log_dir": "logs", **kwargs})


def test_numpy_scalars_are_accepted_by_every_numeric_argument(tmp_path):
    profiler = mpprof.MixedPrecisionProfiler(
        str(tmp_path), numerics_every=np.int64(3), forensic_budget=np.int32(2),
        forensic_spacing=np.int64(5), flush_every_steps=np.int64(10),
        flush_every_seconds=np.float32(2.5), gpu_interval=np.float32(0.5),
        profile_steps=(np.int64(1), np.int64(2)),
    )
    settings = profiler.settings
    assert (settings.numerics_every, settings.flush_every_seconds, settings.gpu_interval,
            settings.profile_steps) == (3, 2.5, 0.5, (1, 2))


def test_two_profilers_in_one_fit_are_refused(tmp_path):
    model = _small_model()
    x, y = _small_data()
    first = mpprof.MixedPrecisionProfiler(str(tmp_path / "a"))
    second = mpprof.MixedPrecisionProfiler(str(tmp_path / "b"))
    with pytest.raises(ValueError, match="Two mpprof.MixedPrecisionProfiler callbacks"):
        model.fit(x, y, verbose=0, callbacks=[first, second])
    # The first one's patches are gone with its fit: plain training works.
    model.fit(x, y, verbose=0)
    assert not _is_profiler_function(model)


def test_after_another_callback_raised_the_next_profiled_fit_is_clean(tmp_path):
    class Boom(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            raise RuntimeError("boom")

    model = _small_model()
    x, y = _small_data()
    with pytest.raises(RuntimeError, match="boom"):
        model.fit(x, y, verbose=0, callbacks=[
            mpprof.MixedPrecisionProfiler(str(tmp_path / "dead")), Boom()])
    model.fit(x, y, epochs=2, verbose=0,
              callbacks=[mpprof.MixedPrecisionProfiler(str(tmp_path / "fresh"))])
    dead = reader.read_run(str(tmp_path / "dead"), "train")
    fresh = reader.read_run(str(tmp_path / "fresh"), "train")
    assert dead.context["fit_state"] == run_context.FIT_FAILED
    assert fresh.context["fit_state"] == run_context.FIT_ENDED
    assert fresh.loss_scale.steps_run == int(model.optimizer.iterations.numpy()) + (
        fresh.loss_scale.skipped_steps + dead.loss_scale.skipped_steps)
    assert not _is_profiler_function(model)


def test_users_own_error_passes_through_unchanged(tmp_path):
    def failing_loss(y_true, y_pred):
        raise ValueError("the user's loss is broken")

    errors = []
    for callbacks in ([], [mpprof.MixedPrecisionProfiler(str(tmp_path))]):
        model = _small_model(loss=failing_loss)
        x, y = _small_data()
        with pytest.raises(ValueError) as caught:
            model.fit(x, y, verbose=0, callbacks=callbacks)
        errors.append((type(caught.value), str(caught.value)))
        assert not _is_profiler_function(model)
    assert errors[0] == errors[1]


# Each collector's own method made to fail: (collector named in the run
# context, class, method). The first eight run on the host, the last four
# while the train step is traced. The hooks that run after a call whose
# alarm rang get a loss scale that overflows.
INJECTIONS = [
    ("loss_scale", LossScales, "flush"),
    ("loss_scale", LossScales, "note_overflows"),
    ("loss_health", RunHealth, "note_calls"),
    ("numerics", NumericsSamples, "after_sample"),
    ("loss_health", RunHealth, "record"),
    ("precision", Inventory, "after_call"),
    ("precision", PrecisionTracer, "inventory"),
    ("gpu", HostRecorder, "flush"),
    ("numerics", NumericsTaps, "on_call"),
    ("loss_scale", LossScaleSeries, "_append"),
    ("loss_health", LossWatch, "_watch"),
    ("precision", PrecisionTracer, "on_call"),
]


@pytest.mark.parametrize(("collector", "owner", "method"), INJECTIONS,
                         ids=[f"{o.__name__}.{m}" for _, o, m in INJECTIONS])
def test_a_failing_collector_is_switched_off_and_training_goes_on(
        tmp_path, monkeypatch, collector, owner, method):
    monkeypatch.setattr(owner, method, _raising(f"injected into {method}"))
    initial_scale = 2.0**40 if method in ("note_overflows", "note_calls") else None
    profiled = _fit_as_without_the_profiler(
        tmp_path, f"stopped recording {collector}", initial_scale=initial_scale,
        numerics_every=2,
    )
    context = reader.read_run(str(tmp_path), "train").context
    state = context["collectors"][collector]
    assert state["state"] == "failed" and f"injected into {method}" in state["reason"]
    assert not _is_profiler_function(profiled)


def test_a_profiler_that_cannot_start_leaves_training_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(TrainFunctions, "install", _raising("injected into install"))
    profiled = _fit_as_without_the_profiler(tmp_path, "stopped recording profiler")
    context = reader.read_run(str(tmp_path), "train").context
    assert "injected into install" in context["collectors"]["profiler"]["reason"]
    assert context["fit_state"] == run_context.FIT_FAILED
    assert not _is_profiler_function(profiled) and "train_step" not in vars(profiled)


def test_a_full_disk_stops_recording_not_training(tmp_path):
    """The profiler's writes fail (the process may not grow a file past 20 kB:
    the kernel answers EFBIG as it answers ENOSPC on a full disk)."""
    script = textwrap.dedent(f"""
        import resource, signal, sys, warnings
        sys.path.insert(0, {TESTS!r})
        import keras, numpy as np, mpprof
        from conftest import overflow_model, overflow_data
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        model = overflow_model(growth_steps=4)
        x, y = overflow_data(512)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[
                mpprof.MixedPrecisionProfiler({str(tmp_path)!r}, numerics_every=2,
                                              flush_every_steps=1)])
        mine = [str(w.message) for w in caught if "mpprof" in str(w.message)]
        assert len(mine) == 1, mine
        print(mine[0])
        assert "train_function" not in vars(model) or "Profiler" not in repr(model.train_function)
        print("FIT COMPLETED", int(model.optimizer.iterations.numpy()))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300, cwd=TESTS)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mpprof: stopped writing its records (OSError" in result.stdout
    assert "File too large" in result.stdout or "No space" in result.stdout
    assert "FIT COMPLETED" in result.stdout
    # What reached the disk before the failure still reads, and the run says
    # the fit ended (its reserved fit-end file), not that it was cut short.
    run = reader.read_run(str(tmp_path), "train")
    assert run.context is not None and run.cut_short is None
    stopped = run.recording_stopped
    assert stopped["fit_state"] == "ended" and "File too large" in stopped["reason"]
    assert stopped["fit_step"] == 192 > stopped["records_until_step"]
    summary = summarize_run(run)
    assert "cut short" not in summary and "the fit went on and ended at step 192" in summary


def test_a_disk_full_at_the_start_stops_recording_not_training(tmp_path):
    """The one rule (mpprof.recording.routing): a full disk, at the start as
    midway, stops the recording with one warning, never the fit; an
    unwritable log_dir still fails at the start (test_callback.py:
    test_unwritable_log_dir_fails_at_train_begin)."""
    script = textwrap.dedent(f"""
        import resource, signal, sys, warnings
        sys.path.insert(0, {TESTS!r})
        import keras, numpy as np, mpprof
        from conftest import overflow_model, overflow_data
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        model = overflow_model(growth_steps=4)
        x, y = overflow_data(64)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[
                mpprof.MixedPrecisionProfiler({str(tmp_path)!r}, numerics_every=2)])
        mine = [str(w.message) for w in caught if "mpprof" in str(w.message)]
        assert len(mine) == 1, mine
        print(mine[0])
        print("FIT COMPLETED", int(model.optimizer.iterations.numpy()))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300, cwd=TESTS)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mpprof: stopped writing its records (OSError" in result.stdout
    assert "File too large" in result.stdout
    assert "FIT COMPLETED" in result.stdout


def test_a_disk_full_before_the_first_record_says_why_the_run_is_empty(tmp_path, capsys):
    """Room for the event file's header and the reserved fit-end file (the
    process may not grow a file past 1,100 bytes), none for a record: the
    run has nothing readable, and says why (its fit-end file) wherever it is
    read, with how the fit ended."""
    from mpprof import cli

    script = textwrap.dedent(f"""
        import resource, signal, sys
        sys.path.insert(0, {TESTS!r})
        import mpprof
        from conftest import overflow_model, overflow_data
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        model = overflow_model(growth_steps=4)
        x, y = overflow_data(64)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1_100, 1_100))
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[
            mpprof.MixedPrecisionProfiler({str(tmp_path)!r}, numerics_every=2)])
        print("FIT COMPLETED", int(model.optimizer.iterations.numpy()))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300, cwd=TESTS)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "FIT COMPLETED" in result.stdout
    run = reader.read_run(str(tmp_path), "train")
    assert not run.readable
    why = "no record could be written: writing them failed (OSError: [Errno 27] File too large)"
    assert cli.main(["diagnose", str(tmp_path)]) == cli.EXIT_UNREADABLE
    out, err = capsys.readouterr()
    assert f"{why}; the fit went on and ended at step 8" in out
    assert f"nothing readable: no record of this run could be read (see its warnings); {why}" \
        in err
    assert cli.main(["summary", str(tmp_path)]) == cli.EXIT_UNREADABLE
    assert why in capsys.readouterr().out


def _raising(message: str):
    def broken(*args, **kwargs):
        raise RuntimeError(message)

    return broken


def _fit_as_without_the_profiler(tmp_path, warning: str, initial_scale=None,
                                 **profiler_kwargs) -> keras.Model:
    """Trains twin models from the same weights (their loss scale starting at
    `initial_scale`, or Keras' default), one plain and one with the profiler
    (which must warn `warning`); asserts they end with the same weights and
    returns the profiled one."""
    x, y = _small_data()
    baseline = _small_model(initial_scale=initial_scale)
    profiled = _small_model(initial_scale=initial_scale)
    profiled.set_weights(baseline.get_weights())
    baseline.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    profiler = mpprof.MixedPrecisionProfiler(str(tmp_path), **profiler_kwargs)
    with pytest.warns(RuntimeWarning, match=warning):
        profiled.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False,
                     callbacks=[profiler])
    for expected, got in zip(baseline.get_weights(), profiled.get_weights(), strict=True):
        np.testing.assert_array_equal(expected, got)
    return profiled


def _small_model(loss="mse", initial_scale=None) -> keras.Model:
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    model = keras.Sequential([
        keras.layers.Input((4,)), keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(1, dtype="float32"),
    ])
    optimizer = keras.optimizers.SGD(0.01)
    if initial_scale is not None:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=initial_scale)
    model.compile(optimizer=optimizer, loss=loss)
    return model


def _small_data():
    rng = np.random.default_rng(0)
    return rng.random((32, 4), dtype=np.float32), rng.random((32, 1), dtype=np.float32)


def _is_profiler_function(model) -> bool:
    function = vars(model).get("train_function")
    return isinstance(getattr(function, "__self__", None), ProfiledFit)


def _start_hard_stop_fit(tmp_path, *extra):
    progress = tmp_path / "progress.txt"
    process = subprocess.Popen(
        [sys.executable, os.path.join(TESTS, "hard_stop_fit.py"), str(tmp_path / "logs"),
         str(progress), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    return process, progress


def _steps_done_by(progress, when: float) -> int:
    """Steps the subprocess had finished at time `when`."""
    done = 0
    for line in progress.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and float(parts[1]) <= when:
            done = int(parts[0])
    return done


def _wait_for_steps(process, progress, steps: int, timeout: float = 120) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the fit ended early: {process.stderr.read()[-3000:]}")
        if progress.exists() and len(progress.read_text().splitlines()) >= steps:
            return
        time.sleep(0.1)
    process.kill()
    raise AssertionError("the fit did not reach the steps in time")


def test_sigkill_loses_at_most_the_flush_interval(tmp_path):
    import signal
    import time

    from hard_stop_fit import FLUSH_EVERY_SECONDS

    process, progress = _start_hard_stop_fit(tmp_path)
    _wait_for_steps(process, progress, 50)
    time.sleep(3 * FLUSH_EVERY_SECONDS)
    killed_at = time.time()
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    # Every step is an overflow; each one that ended more than the interval
    # (plus one step and a margin for the check after it) before the kill is
    # on disk.
    bound = FLUSH_EVERY_SECONDS + 0.5
    must_have = _steps_done_by(progress, killed_at - bound)
    assert must_have >= 50
    run = reader.read_run(str(tmp_path / "logs"), "train")
    overflow_steps = set(run.loss_scale.overflow_steps.astype(int).tolist())
    assert set(range(must_have)) <= overflow_steps
    # The run says it never ended.
    assert run.context["fit_state"] == run_context.FIT_RUNNING


@pytest.mark.parametrize("own_handler", [False, True], ids=["default", "user_handler"])
def test_sigterm_saves_the_records_and_passes_the_signal_on(tmp_path, own_handler):
    import signal
    import time

    marker = tmp_path / "user_handler_ran"
    extra = ("--own-sigterm-handler", str(marker)) if own_handler else ()
    process, progress = _start_hard_stop_fit(tmp_path, *extra)
    _wait_for_steps(process, progress, 50)
    signalled_at = time.time()
    process.send_signal(signal.SIGTERM)
    returncode = process.wait(timeout=60)
    if own_handler:
        assert returncode == 0 and marker.read_text() == "handled"
    else:
        assert returncode == -signal.SIGTERM
    run = reader.read_run(str(tmp_path / "logs"), "train")
    overflow_steps = set(run.loss_scale.overflow_steps.astype(int).tolist())
    assert set(range(_steps_done_by(progress, signalled_at))) <= overflow_steps
