"""One fit under the `MixedPrecisionProfiler`, from train begin to its end.

`ProfiledFit` runs the collectors of one fit (`mpprof.recording.collectors.base`): it
builds them, installs their patches through one `Patches`, dispatches each
train-function call (plain or instrumented), does the bookkeeping after it,
flushes the records and, when the fit ends or raises, undoes every patch.
Every step goes through the fit's `Guard`, so mpprof's own failures never
reach training. The callback makes one per fit and keeps what carries from
one fit to the next (`mpprof.recording.callback.AcrossFits`).
"""

from __future__ import annotations

import atexit
import functools
import posixpath
import time
import weakref
from typing import TYPE_CHECKING

from mpprof.backends import backend_for
from mpprof.recording.collectors import step_origin
from mpprof.recording.collectors.base import Collector
from mpprof.recording.collectors.host import HostRecorder
from mpprof.recording.collectors.inventory import Inventory
from mpprof.recording.collectors.numerics_samples import NumericsSamples
from mpprof.recording.collectors.optimizers import OptimizerUsage
from mpprof.recording.distributed import announce_keras_3_multi_worker, worker_role
from mpprof.recording.fit_state import FitState
from mpprof.recording.guard import Guard
from mpprof.recording.hard_stop import FlushClock, SigtermFlush
from mpprof.recording.patching import Patches
from mpprof.recording.routing import RecordRouting
from mpprof.recording.siblings import sibling_callbacks
from mpprof.records import schema

if TYPE_CHECKING:
    from mpprof.recording.callback import AcrossFits, MixedPrecisionProfiler

# The fit being profiled on each model, to refuse a second profiler in the
# same fit and to finish one whose fit was ended by another's exception.
_ACTIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def start(profiler: MixedPrecisionProfiler, across_fits: AcrossFits) -> ProfiledFit:
    """Begins profiling the fit `profiler.model` is starting.

    Args:
        profiler: the `MixedPrecisionProfiler` (its settings and its place
            among the fit's callbacks).
        across_fits: what the profiler's earlier fits left.

    Raises:
        ValueError: another profiler runs in the same fit.
    """
    model = profiler.model
    api = backend_for(model)
    _take_over(profiler, model, api)
    fit = ProfiledFit(profiler, model, api, across_fits)
    _ACTIVE[model] = fit
    fit.begin()
    return fit


def _take_over(profiler, model, keras_api) -> None:
    """Refuses a second profiler in the same fit; finishes the model's
    earlier profiled fit if it never ended (another callback's exception
    stopped that fit before `on_train_end`)."""
    other = _ACTIVE.get(model)
    if other is None:
        return
    if other.profiler is not profiler:
        siblings = sibling_callbacks(profiler, keras_api.callback_list_class)
        if any(c is other.profiler for c in siblings):
            raise ValueError(
                "Two mpprof.MixedPrecisionProfiler callbacks in one fit: they would "
                "patch the same train step. Pass one (it records everything)."
            )
    other.finish(schema.FIT_FAILED)


class ProfiledFit:
    """The collectors of one fit and everything that drives them.

    Args:
        profiler: the `MixedPrecisionProfiler` whose settings apply.
        model: the model being trained.
        api: the model's backend (`mpprof.backends.backend_for`).
        across_fits: what earlier fits left; updated when this one ends.
    """

    def __init__(self, profiler: MixedPrecisionProfiler, model, api,
                 across_fits: AcrossFits):
        self.profiler = profiler
        self.model = model
        self._api = api
        self._across_fits = across_fits
        self._schedule = across_fits.schedule
        self._role = worker_role(api.distribute_strategy(model))
        self._distribution_note = (
            announce_keras_3_multi_worker()
            if self._role.multi_worker and not api.fits_across_workers else None
        )
        self._guard = Guard()
        self._routing: RecordRouting | None = RecordRouting(
            profiler.run_dir, self._role, self._guard
        )
        self._patches = Patches()
        self._fit_state = schema.FIT_RUNNING
        across_fits.fit_count += 1
        self._fit: FitState | None = None
        self._collectors: list[Collector] = []
        self._batch_pending = False
        self._sigterm = SigtermFlush(self._flush)
        atexit.register(self._finish_unended)

    def begin(self) -> None:
        """Installs the collectors; a failure ends the profiling, not the fit."""
        try:
            self._begin()
        except Exception as e:  # noqa: BLE001 - mpprof's failure must not stop fit
            self._guard.fail("profiler", e)
            self.finish(schema.FIT_FAILED)

    def _begin(self) -> None:
        model = self.model
        usage = OptimizerUsage(self._api, model)
        self._schedule.start_fit()
        fit = FitState(
            model=model, guard=self._guard, writer=self._routing.model,
            host_writer=self._routing.host, usage=usage,
            schedule=self._schedule,
        )
        self._collectors = self._make_collectors(usage)
        fit.step = self._start_step(usage)
        self._fit_start_step = fit.step
        self._steps_since_flush = 0
        self._flush_clock = FlushClock(self.profiler.flush_every_seconds)
        # Quiet calls: those with nothing due but their count and the
        # alarm's check (`_run_quiet`); how many may come, and how many
        # came since the last bookkeeping.
        self._quiet_calls = 0
        self._quiet_made = 0
        self._quiet_until = 0.0
        usage.install(self._patches)
        self._alarm_in_logs = self._api.alarm_in_logs
        self._alarm = self._api.CallAlarm(self._alarm_counters, lambda: (
            self._alarm_in_logs or self._schedule.watching_overflows))
        self._guard.run("profiler", self._alarm.install, model, self._patches,
                        self._alarm_in_logs)
        self._guard.run(self._replay.name, self._replay.wrap_train_step, fit, self._patches)
        self._functions = self._api.TrainFunctions(
            model, self._api, self.profiler.numerics_every is not None)
        self._functions.install(self._run_train_function, self._patches)
        self._fit = fit
        for collector in self._collectors:
            self._guard.run(collector.name, collector.install, fit, self._patches)
        self._after_call_collectors = self._with_work_after_each_call()
        self._waits_for_alarm = self._reads_alarm_at_once()
        self._fixed_steps_per_call = self._api.fixed_steps_per_execution(model)
        self._sigterm.install()
        self._write_context()

    def _reads_alarm_at_once(self) -> bool:
        """Whether the host examines each call's alarm as the call returns,
        rather than one call late: where the step reports it in its logs
        (Keras 3 on TensorFlow turns every call's logs into Python numbers
        before the next call, so this waits for nothing more), and while a
        new overflow may still arm a forensic sample of the next call."""
        return self._alarm_in_logs or (
            self._schedule.watching_overflows and bool(self._loss_scales))

    def _with_work_after_each_call(self) -> list[Collector]:
        """The collectors whose `after_call` has work (a call per step each
        adds up on fast steps)."""
        return [c for c in self._collectors if c.after_each_call]

    def _make_collectors(self, usage: OptimizerUsage) -> list[Collector]:
        """Every collector of the fit, in the order their hooks run."""
        model, api, profiler = self.model, self._api, self.profiler

        def instrumenting() -> bool:
            """Whether the step being traced is the instrumented one."""
            return self._numerics.instrumenting

        strategy = api.distribute_strategy(model)
        capacity = 2 * (profiler.flush_every_steps + api.steps_per_execution(model))
        self._inventory = Inventory(api, model, self._guard)
        self._loss_scales = api.LossScales(
            api, usage, strategy, capacity, self._across_fits.loss_scales,
            functools.cache(lambda: step_origin.read_earlier(profiler.log_dir)),
        )
        self._health = api.RunHealth(api, usage, strategy, self._loss_scales.graph_step_of,
                                 self._across_fits.health, instrumenting)
        self._numerics = NumericsSamples(
            api.numerics_collector, self._inventory, self._loss_scales, self._health,
            {"every": profiler.numerics_every, "forensic_budget": profiler.forensic_budget,
             "forensic_spacing": profiler.forensic_spacing},
        )
        if self._across_fits.profile_window is None and profiler.profile_steps:
            self._across_fits.profile_window = api.profile_window(
                *profiler.profile_steps, profiler.run_dir)
        window = self._across_fits.profile_window
        if window is not None and self._role.worker_run is not None:
            # Each worker traces its own host, into its own run.
            window.run_dir = posixpath.join(profiler.run_dir, self._role.worker_run)
        self._host = HostRecorder(profiler.gpu_interval, window, profiler, api)
        self._replay = api.ReplayCapture(profiler.replay_budget, api, self._loss_scales,
                                     self._health, instrumenting)
        float8_shares = api.Float8Shares(model, profiler.numerics_every is not None)
        # The collectors whose in-graph taps run on sampled calls only.
        self._sampling_collectors = [self._numerics, float8_shares]
        return [
            self._inventory, self._loss_scales, self._health, self._numerics, self._host,
            api.Float8State(model, self._loss_scales), float8_shares, self._replay,
        ]

    # The Keras hooks the callback passes on.

    def batch_begin(self) -> None:
        self._batch_pending = True

    def epoch_end(self) -> None:
        if self._fit is None:
            return
        self._guard.run(self._health.name, self._health.check_weights, self.model)
        self._flush()

    # The train function fit calls while this profiler runs.

    # `args`: what fit passes: `(iterator,)` on TensorFlow, `(state, iterator)`
    # on JAX, whose function returns `(logs, state)` (`Backend.logs_of`).
    def _run_train_function(self, *args):
        fit = self._fit
        if not self._batch_pending or fit is None:
            # Called outside a profiled batch: a later fit or train_on_batch
            # after this fit was stopped by someone else's exception.
            self.finish(schema.FIT_FAILED)
            return self.model.train_function(*args)
        self._batch_pending = False
        if self._quiet_calls:
            return self._run_quiet(args, fit)
        # A call with something to do: the first, a sample, a flush, after
        # an alarm, or every call where quiet ones are not possible. The
        # schedule counts the quiet calls before it says whether one is due.
        self._guard.run("profiler", self._settle_quiet_calls)
        if self._sample_now(fit):
            result = self._run_sampled(args, fit)
        else:
            fit.sample_step = None
            result = self._functions.run_plain(*args, on_abort=self._abort)
        logs = self._api.logs_of(result)
        alarm = None
        if isinstance(logs, dict):
            alarm = logs.pop(self._api.alarm_logs_key, None)
            fit.replay_outputs = logs.pop(self._api.replay_logs_key, None)
        self._guard.run("profiler", self._after_call, fit, alarm)
        return result

    def _run_quiet(self, args: tuple, fit: FitState):
        """Runs a call with nothing due (most calls): the plain function, the
        alarm's quick check and a count. Per-call Python runs on caches the
        step has just flushed (tens of us where a tight loop would take a
        few), so a quiet call touches as little as it can; the bookkeeping
        of quiet calls waits for the next call that has something to do."""
        self._quiet_calls -= 1
        result = self._functions.run_plain(*args, on_abort=self._abort)
        logs = self._api.logs_of(result)
        alarm = logs.pop(self._api.alarm_logs_key, None) if isinstance(logs, dict) else None
        try:
            if self._alarm.unchanged(alarm) and time.monotonic() < self._quiet_until:
                # The step stays current: the GPU sampler's thread reads it.
                fit.step += self._fixed_steps_per_call
                self._quiet_made += 1
                return result
        except Exception as e:  # noqa: BLE001 - mpprof's failure must not stop fit
            self._quiet_calls = 0
            self._guard.fail("profiler", e)
            return result
        # Trouble, or a deadline passed: the whole bookkeeping, for this call.
        self._quiet_calls = 0
        self._guard.run("profiler", self._after_call, fit, alarm)
        return result

    def _settle_quiet_calls(self) -> None:
        """Counts the quiet calls made since the last bookkeeping (before
        anything reads the calls, the steps since the last flush or the
        schedule)."""
        made, self._quiet_made = self._quiet_made, 0
        if made:
            steps = made * self._fixed_steps_per_call
            self._fit.calls += made
            self._steps_since_flush += steps
            self._schedule.after_call(steps)

    def _quiet_calls_ahead(self, fit: FitState) -> int:
        """How many of the next calls may run quiet: none has a sample or a
        flush due before it, the steps of each call are known, and each
        collector with work after calls can wait (until `_quiet_until`, with
        the flush clock's deadline)."""
        steps = self._fixed_steps_per_call
        if not steps:
            return 0
        waits = [self._guard.run(c.name, c.quiet_until) for c in self._after_call_collectors]
        # (None: that collector failed, and its `after_call` no longer runs.)
        until = min([self._flush_clock.deadline()] + [w for w in waits if w is not None])
        if until <= time.monotonic():
            return 0
        self._quiet_until = until
        steps_free = self.profiler.flush_every_steps - self._steps_since_flush - 1
        if self._functions.instrumented is not None:
            steps_free = min(steps_free, self._schedule.steps_before_due())
        return max(0, int(steps_free) // steps)

    def _sample_now(self, fit: FitState) -> bool:
        """Whether this call is sampled (a sample is due and the numerics
        collector is ready)."""
        if self._functions.instrumented is None or not self._schedule.due(fit.calls):
            return False
        numerics = self._numerics
        return bool(self._guard.run(numerics.name, numerics.prepare, fit))

    def _run_sampled(self, args: tuple, fit: FitState):
        """Runs the instrumented function, its collectors' taps switched on."""
        fit.forensic = self._schedule.sampled()
        fit.sample_step = self._measured_step()
        for collector in self._sampling_collectors:
            collector.instrument(True)  # sets a flag the traced taps read
        try:
            return self._functions.run_instrumented(*args, on_abort=self._abort,
                                                    on_failure=self._instrumented_failed)
        finally:
            for collector in self._sampling_collectors:
                collector.instrument(False)

    def _instrumented_failed(self, reason: str) -> None:
        self._guard.fail(self._numerics.name, reason)

    def _alarm_counters(self) -> list:
        """What the alarm sums: every loss-scale series' skipped steps and
        every loss watcher's non-finite steps."""
        return self._loss_scales.skipped_counters() + self._health.nonfinite_counters()

    def _on_alarm(self, fit: FitState, steps: tuple[int, int] | None) -> None:
        """A call's alarm rang (`steps`: its first and last step, None: it
        did not): date the first non-finite loss, and arm a forensic sample
        after an overflow."""
        if steps is None:
            return
        self._quiet_calls = 0  # a forensic sample may now be due
        self._guard.run(self._health.name, self._health.note_calls, *steps)
        self._guard.run(self._loss_scales.name, self._loss_scales.note_overflows, fit)

    def _after_call(self, fit: FitState, alarm) -> None:
        """Bookkeeping after each call (`alarm`: the one its logs held, if
        any); reads the device only when it must."""
        self._settle_quiet_calls()
        first_call = fit.calls == 0
        fit.calls += 1
        # Exact but for an epoch's last call.
        steps = self._fixed_steps_per_call or self._api.steps_per_execution(self.model)
        fit.step += steps
        self._steps_since_flush += steps
        self._schedule.after_call(steps)
        if first_call:
            # Tracing showed which optimizers the step uses: say so at once,
            # with where their loss scales start.
            fit.usage.mark_traced()
            if self._functions.instrumented_off is not None:
                self._numerics.switch_off(self._functions.instrumented_off)
            fit.step = self._measured_step()
            self._guard.run(self._loss_scales.name, self._loss_scales.flush, fit)
            self._write_context()
        elif fit.sample_step is not None:
            fit.step = self._measured_step()
        for rang in self._alarm.hold(alarm, fit.step - steps, fit.step - 1,
                                     wait=self._waits_for_alarm):
            self._on_alarm(fit, rang)
        for collector in self._after_call_collectors:
            self._guard.run(collector.name, collector.after_call, fit)
        if fit.sample_step is not None:
            for collector in self._collectors:
                self._guard.run(collector.name, collector.after_sample, fit)
        if first_call or fit.sample_step is not None:
            # What tracing showed, or a forensic sample used, changes these.
            self._after_call_collectors = self._with_work_after_each_call()
            self._waits_for_alarm = self._reads_alarm_at_once()
        if (self._steps_since_flush >= self.profiler.flush_every_steps
                or self._flush_clock.due()):
            self._flush()
        self._quiet_calls = self._quiet_calls_ahead(fit)
        if self._quiet_calls:
            fit.sample_step = None  # quiet calls are not sampled

    # Steps.

    def _start_step(self, usage) -> int:
        if self._across_fits.last_step is not None:
            return self._across_fits.last_step
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
        self._settle_quiet_calls()
        fit.step = self._guard.run("profiler", self._measured_step) or fit.step
        self._on_alarm(fit, self._alarm.drain())
        for collector in self._collectors:
            self._guard.run(collector.name, collector.flush, fit)
        self._write_context()
        self._routing.flush()
        self._steps_since_flush = 0
        self._flush_clock.reset()

    # Ending the fit.

    def finish(self, fit_state: str) -> None:
        """Ends the profiling of this fit: `fit_state` says how the fit ended
        (`schema.FIT_ENDED` or `schema.FIT_FAILED`). Once only."""
        self._fit_state = fit_state
        self._finish()

    def _abort(self) -> None:
        """`fit` is raising from inside a train step: keep what was recorded."""
        self.finish(schema.FIT_FAILED)

    def _finish_unended(self) -> None:
        """At interpreter exit, for a fit that never reached its end."""
        self.finish(schema.FIT_FAILED)

    def _finish(self) -> None:
        if self._routing is None:
            return
        atexit.unregister(self._finish_unended)
        self._sigterm.remove()
        fit = self._fit
        try:
            if fit is not None:
                self._settle_quiet_calls()
                for collector in self._collectors:
                    self._guard.run(collector.name, collector.end, fit)
                self._flush()
                self._across_fits.last_step = fit.step
                self._across_fits.loss_scales = {
                    id(c.optimizer): c for c in self._loss_scales.by_name.values()
                }
                self._across_fits.health = self._health.by_optimizer()
            else:
                self._write_context()
        finally:
            if fit is not None:
                self._host.release()
                self._functions.release()
            for failure in self._patches.restore():
                print(f"mpprof: could not undo a patch ({failure})")
            self._fit = None
            self._routing.close()
            self._routing = None
            if _ACTIVE.get(self.model) is self:
                del _ACTIVE[self.model]

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
        step = fit.step if fit is not None else self._across_fits.last_step or 0
        context = self._api.run_context(
            self.model, collectors=collectors,
            hardware=self._host.hardware if fit is not None else None,
            step=self._fit_start_step if fit is not None else step,
            fit_count=self._across_fits.fit_count,
        )
        if fit is not None:
            context["optimizers"] = fit.usage.describe()
            primary = fit.usage.primary() if fit.usage.traced else None
            if primary is not None:
                context["optimizer"] = type(primary.optimizer).__name__
        context["fit_state"] = self._fit_state
        context["records_reach_disk"] = {
            "every_steps": self.profiler.flush_every_steps,
            "every_seconds": self.profiler.flush_every_seconds,
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
        step = fit.step if fit is not None else self._across_fits.last_step or 0
        evidence = None
        if fit is not None and self._routing.worker is not None:
            health = self._guard.run(self._health.name, self._health.record, step) or {}
            evidence = {"steps_run": step, "skipped_steps": self._loss_scales.skipped_steps(),
                        **health}
        self._routing.write_context(self._context(), step, evidence)

