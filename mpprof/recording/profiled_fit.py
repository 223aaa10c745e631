"""One fit under the `MixedPrecisionProfiler`, from train begin to its end.

`ProfiledFit` runs the collectors of one fit (`mpprof.recording.collectors`,
built by `fit_collectors.build`): it installs their patches through one
`Patches`, dispatches each train-function call (plain, quiet or
instrumented), does the bookkeeping after it, flushes the records and, when
the fit ends or raises, undoes every patch. Every step goes through the
fit's `Guard`, so mpprof's own failures never reach training. Whatever
needs a framework is asked of the fit's backend (`mpprof.backends`).
"""

from __future__ import annotations

import atexit
import sys
import weakref
from collections.abc import Callable
from typing import Any

from mpprof.backends import backend_for, protocol
from mpprof.backends.base import Backend
from mpprof.backends.optimizer_usage import OptimizerUsage
from mpprof.backends.patching import Patches
from mpprof.recording import fit_collectors
from mpprof.recording.across_fits import AcrossFits
from mpprof.recording.context_writer import ContextWriter
from mpprof.recording.distributed import announce_keras_3_multi_worker
from mpprof.recording.fit_collectors import FitCollectors
from mpprof.recording.fit_state import FitState
from mpprof.recording.guard import Guard, describe_fit_error
from mpprof.recording.hard_stop import FlushSchedule, SigtermFlush
from mpprof.recording.quiet_calls import QuietCalls
from mpprof.recording.routing import RecordRouting
from mpprof.recording.settings import Settings
from mpprof.recording.siblings import sibling_callbacks
from mpprof.records import run_context

# The fit being profiled on each model, to refuse a second profiler in the
# same fit and to finish one whose fit was ended by another's exception.
_ACTIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def start(profiler, settings: Settings, across_fits: AcrossFits) -> ProfiledFit:
    """Begins profiling the fit `profiler.model` is starting.

    Args:
        profiler: the `MixedPrecisionProfiler` (its place among the fit's
            callbacks).
        settings: its settings.
        across_fits: what the profiler's earlier fits left.

    Raises:
        ValueError: another profiler runs in the same fit.
        OSError: the log_dir cannot be written.
    """
    model = profiler.model
    backend = backend_for(model)
    backend.hide_own_frames()
    _take_over(profiler, model, backend)
    fit = ProfiledFit(profiler, model, backend, settings, across_fits)
    _ACTIVE[model] = fit
    fit.begin()
    return fit


def _take_over(profiler, model, backend) -> None:
    """Refuses a second profiler in the same fit; finishes the model's
    earlier profiled fit if it never ended (another callback's exception
    stopped that fit before `on_train_end`)."""
    other = _ACTIVE.get(model)
    if other is None:
        return
    if other.profiler is not profiler:
        siblings = sibling_callbacks(profiler, backend.callback_list_class)
        if any(c is other.profiler for c in siblings):
            raise ValueError(
                "Two mpprof.MixedPrecisionProfiler callbacks in one fit: they would "
                "patch the same train step. Pass one (it records everything)."
            )
    other.finish(run_context.FIT_FAILED)


class ProfiledFit:
    """The collectors of one fit and everything that drives them.

    Args:
        profiler: the `MixedPrecisionProfiler` (for its place among the fit's
            callbacks).
        model: the model being trained.
        backend: the model's backend (`mpprof.backends.backend_for`).
        settings: the profiler's settings.
        across_fits: what earlier fits left; updated when this one ends.
    """

    def __init__(self, profiler, model, backend: Backend, settings: Settings,
                 across_fits: AcrossFits):
        self.profiler = profiler
        self.model = model
        self._backend = backend
        self._settings = settings
        self._across_fits = across_fits
        self._schedule = across_fits.schedule
        self._role = role = backend.worker_role(model)
        note = (announce_keras_3_multi_worker()
                if role.multi_worker and not backend.fits_across_workers else None)
        self._guard = Guard()
        self._routing: RecordRouting | None = RecordRouting(settings.run_dir, role, self._guard)
        self._context = ContextWriter(backend, model, settings, across_fits, self._guard,
                                      role, note)
        self._patches = Patches()
        self._fit_state = run_context.FIT_RUNNING
        self._fit_error: dict | None = None  # what fit raised inside a train step
        across_fits.fit_count += 1
        # Set by `begin` once the collectors are installed (None: not yet,
        # or profiling stopped before they were).
        self._fit: FitState | None = None
        self._collectors: FitCollectors | None = None
        self._functions: protocol.TrainFunctions | None = None
        self._alarm: protocol.CallAlarm | None = None
        self._run_plain: Callable[..., Any] | None = None  # (set by `begin`)
        self._logs_of: Callable[[Any], Any] | None = None
        self._alarm_key: str | None = None
        self._on_abort = self._abort
        self._start_step = 0
        self._batch_pending = False
        self._flushes = FlushSchedule(settings.flush_every_steps, settings.flush_every_seconds)
        self._quiet = QuietCalls(backend.fixed_steps_per_execution(model))
        # The collectors whose `after_call` has work (a call per step each
        # adds up on fast steps), and whether each call's alarm is examined
        # as the call returns: both change after the first and sampled calls.
        self._after_call_collectors: list = []
        self._waits_for_alarm = False
        self._sigterm = SigtermFlush(self._flush)
        atexit.register(self._finish_unended)

    def begin(self) -> None:
        """Installs the collectors; a failure ends the profiling, not the fit."""
        try:
            self._begin()
        except Exception as e:  # noqa: BLE001 - mpprof's failure must not stop fit
            self._guard.fail("profiler", e)
            self.finish(run_context.FIT_FAILED)

    def _begin(self) -> None:
        model, backend, patches = self.model, self._backend, self._patches
        usage = OptimizerUsage(backend, model)
        self._schedule.start_fit()
        fit = FitState(model=model, guard=self._guard, writer=self._routing.model,
                       host_writer=self._routing.host, usage=usage, schedule=self._schedule)
        collectors = fit_collectors.build(backend, model, self._settings, self._across_fits,
                                          self._guard, self._role, usage, self.profiler)
        self._collectors = collectors
        fit.step = self._start_step = self._first_step(usage)
        usage.install(patches)
        alarm_in_logs = backend.alarm_in_logs
        self._alarm = backend.CallAlarm(self._alarm_counters, lambda: (
            alarm_in_logs or self._schedule.watching_overflows))
        self._guard.run("profiler", self._alarm.install, model, patches, alarm_in_logs)
        self._guard.run(collectors.replay.name, collectors.replay.wrap_train_step, fit, patches)
        self._functions = backend.TrainFunctions(model, backend, self._settings.sampling)
        self._functions.install(self._run_train_function, patches)
        # What each quiet call uses, looked up once.
        self._run_plain = self._functions.run_plain
        self._logs_of, self._alarm_key = backend.logs_of, backend.alarm_logs_key
        self._fit = fit
        for collector in collectors.all:
            self._guard.run(collector.name, collector.install, fit, patches)
        self._after_calls_changed()
        self._sigterm.install()
        self._write_context()
        # On disk at once: a fit stopped before its first step (by another
        # callback) still says what it was and that its step never traced.
        self._routing.flush()

    def _after_calls_changed(self) -> None:
        """What the first call's tracing, or a forensic sample, changes: the
        collectors with work after each call, and whether the host examines
        each call's alarm as the call returns rather than one call late
        (where the step reports it in its logs, which Keras 3 on TensorFlow
        reads before the next call anyway, and while a new overflow may
        still arm a forensic sample of the next call)."""
        self._after_call_collectors = [c for c in self._collectors.all if c.after_each_call]
        self._waits_for_alarm = self._backend.alarm_in_logs or (
            self._schedule.watching_overflows and bool(self._collectors.loss_scales))

    # The Keras hooks the callback passes on.

    def batch_begin(self) -> None:
        self._batch_pending = True

    def epoch_end(self) -> None:
        if self._fit is None:
            return
        health = self._collectors.health
        self._guard.run(health.name, health.check_weights, self.model)
        self._flush()

    # The train function fit calls while this profiler runs.

    # `args`: what fit passes: `(iterator,)` on TensorFlow, `(state, iterator)`
    # on JAX, whose function returns `(logs, state)` (`Backend.logs_of`).
    def _run_train_function(self, *args):
        fit = self._fit
        if not self._batch_pending or fit is None:
            # Called outside a profiled batch: a later fit or train_on_batch
            # after this fit was stopped by someone else's exception.
            self.finish(run_context.FIT_FAILED)
            return self.model.train_function(*args)
        self._batch_pending = False
        quiet = self._quiet
        if quiet.ahead:
            # A quiet call, counted off here: this runs on every step.
            quiet.ahead -= 1
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
        logs = self._backend.logs_of(result)
        alarm = None
        if isinstance(logs, dict):
            alarm = logs.pop(self._backend.alarm_logs_key, None)
            fit.replay_outputs = logs.pop(self._backend.replay_logs_key, None)
        self._guard.run("profiler", self._after_call, fit, alarm)
        return result

    def _run_quiet(self, args: tuple, fit: FitState):
        """Runs a quiet call (`mpprof.recording.quiet_calls`): the whole
        bookkeeping only if its alarm rang or a deadline passed."""
        result = self._run_plain(*args, on_abort=self._on_abort)
        logs = self._logs_of(result)
        alarm = logs.pop(self._alarm_key, None) if isinstance(logs, dict) else None
        try:
            if self._alarm.unchanged(alarm) and self._quiet.went_quietly(fit):
                return result
        except Exception as e:  # noqa: BLE001 - mpprof's failure must not stop fit
            self._quiet.stop()
            self._guard.fail("profiler", e)
            return result
        self._quiet.stop()
        self._guard.run("profiler", self._after_call, fit, alarm)
        return result

    def _settle_quiet_calls(self) -> None:
        self._quiet.settle(self._fit, self._flushes, self._schedule)

    def _sample_now(self, fit: FitState) -> bool:
        """Whether this call is sampled (a sample is due and the numerics
        collector is ready)."""
        if self._functions.instrumented is None or not self._schedule.due(fit.calls):
            return False
        numerics = self._collectors.numerics
        return bool(self._guard.run(numerics.name, numerics.prepare, fit))

    def _run_sampled(self, args: tuple, fit: FitState):
        """Runs the instrumented function, its collectors' taps switched on."""
        fit.forensic = self._schedule.sampled()
        fit.sample_step = self._measured_step()
        sampling = self._collectors.sampling
        for collector in sampling:
            collector.instrument(True)  # sets a flag the traced taps read
        try:
            result = self._functions.run_instrumented(*args, on_abort=self._abort,
                                                      on_failure=self._instrumented_failed,
                                                      forensic=fit.forensic)
        finally:
            for collector in sampling:
                collector.instrument(False)
        # A forensic sample of an earlier, overflowed step's batch (where the
        # backend dispatches ahead of the host; None elsewhere).
        replayed = self._functions.replayed
        fit.replayed_sample = None if replayed is None else replayed.note()
        if replayed is not None:
            fit.sample_step = replayed.step
        return result

    def _instrumented_failed(self, reason: str) -> None:
        self._guard.fail(self._collectors.numerics.name, reason)

    def _alarm_counters(self) -> list:
        """What the alarm sums: every loss-scale series' skipped steps and
        every loss watcher's non-finite steps."""
        collectors = self._collectors
        return collectors.loss_scales.skipped_counters() + collectors.health.nonfinite_counters()

    def _on_alarm(self, fit: FitState, steps: tuple[int, int] | None) -> None:
        """A call's alarm rang (`steps`: its first and last step, None: it
        did not): date the first non-finite loss, and arm a forensic sample
        after an overflow."""
        if steps is None:
            return
        self._quiet.stop()  # a forensic sample may now be due
        health, loss_scales = self._collectors.health, self._collectors.loss_scales
        self._guard.run(health.name, health.note_calls, *steps)
        self._guard.run(loss_scales.name, loss_scales.note_overflows, fit)

    def _after_call(self, fit: FitState, alarm) -> None:
        """Bookkeeping after each call (`alarm`: the one its logs held, if
        any); reads the device only when it must."""
        self._settle_quiet_calls()
        first_call = fit.calls == 0
        fit.calls += 1
        # Exact but for an epoch's last call.
        steps = self._quiet.steps_per_call or self._backend.steps_per_execution(self.model)
        fit.step += steps
        self._flushes.steps += steps
        self._schedule.after_call(steps)
        collectors = self._collectors
        if first_call:
            # Tracing showed which optimizers the step uses: say so at once,
            # with where their loss scales start.
            fit.usage.mark_traced()
            if self._functions.instrumented_off is not None:
                collectors.numerics.switch_off(self._functions.instrumented_off)
            fit.step = self._measured_step()
            self._guard.run(collectors.loss_scales.name, collectors.loss_scales.flush, fit)
            self._write_context()
        elif fit.sample_step is not None:
            fit.step = self._measured_step()
        for rang in self._alarm.hold(alarm, fit.step - steps, fit.step - 1,
                                     wait=self._waits_for_alarm):
            self._on_alarm(fit, rang)
        for collector in self._after_call_collectors:
            self._guard.run(collector.name, collector.after_call, fit)
        if fit.sample_step is not None:
            for collector in collectors.all:
                self._guard.run(collector.name, collector.after_sample, fit)
        if first_call or fit.sample_step is not None:
            self._after_calls_changed()
        if self._flushes.due():
            self._flush()
        self._plan_quiet_calls()
        if self._quiet.ahead:
            fit.sample_step = None  # quiet calls are not sampled

    def _plan_quiet_calls(self) -> None:
        waits = [self._guard.run(c.name, c.quiet_until) for c in self._after_call_collectors]
        # (None: that collector failed, and its `after_call` no longer runs.)
        self._quiet.plan(
            [w for w in waits if w is not None], self._flushes,
            self._schedule.steps_before_due() if self._functions.instrumented is not None
            else float("inf"),
        )

    # Steps.

    def _first_step(self, usage: OptimizerUsage) -> int:
        if self._across_fits.last_step is not None:
            return self._across_fits.last_step
        return self._collectors.loss_scales.step_of(usage.uses[0]) if usage.uses else 0

    def _measured_step(self) -> int:
        """Steps run so far: the primary optimizer's (iterations, plus skipped
        steps under loss scaling) or, when the step applies no optimizer or
        one whose steps the backend does not follow, the host's count of
        steps run."""
        fit = self._fit
        primary = fit.usage.primary() if fit.usage.traced else None
        if primary is None or (primary.loss_scale and not self._guard.ok("loss_scale")):
            return fit.step
        step = self._collectors.loss_scales.step_of(primary)
        return fit.step if step is None else step

    # Writing.

    def _flush(self) -> None:
        """Reads the in-graph counters and writes every pending record."""
        fit = self._fit
        if fit is None or self._routing is None:
            return
        self._settle_quiet_calls()
        fit.step = self._guard.run("profiler", self._measured_step) or fit.step
        self._on_alarm(fit, self._alarm.drain())
        for collector in self._collectors.all:
            self._guard.run(collector.name, collector.flush, fit)
        self._write_context()
        self._routing.flush()
        self._flushes.reset()

    def _write_context(self) -> None:
        self._context.write(self._routing, self._collectors, self._fit, self._start_step,
                            self._fit_state, self._sigterm.state, self._fit_error)

    # Ending the fit.

    def finish(self, fit_state: str) -> None:
        """Ends the profiling of this fit: `fit_state` says how the fit ended
        (`run_context.FIT_ENDED` or `run_context.FIT_FAILED`). Once only."""
        self._fit_state = fit_state
        self._finish()

    def _abort(self) -> None:
        """`fit` is raising from inside a train step: keep what was recorded,
        and what it raised (the exception being handled) and at which step."""
        error = sys.exc_info()[1]
        self._guard.fit_raised = True
        if self._fit is not None:
            self._guard.run("profiler", self._settle_quiet_calls)  # the steps that ran
        step = self._fit.step if self._fit is not None else self._start_step
        self._fit_error = describe_fit_error(error, step)
        self.finish(run_context.FIT_FAILED)

    def _finish_unended(self) -> None:
        """At interpreter exit, for a fit that never reached its end."""
        self.finish(run_context.FIT_FAILED)

    def _finish(self) -> None:
        if self._routing is None:
            return
        atexit.unregister(self._finish_unended)
        self._sigterm.remove()
        fit = self._fit
        try:
            if fit is not None:
                self._settle_quiet_calls()
                for collector in self._collectors.all:
                    self._guard.run(collector.name, collector.end, fit)
                self._flush()
                self._carry_over(fit)
            else:
                self._write_context()
        finally:
            self._release(fit)

    def _carry_over(self, fit: FitState) -> None:
        """What the profiler's next fit continues from."""
        self._across_fits.last_step = fit.step
        self._across_fits.loss_scales = {
            id(c.optimizer): c for c in self._collectors.loss_scales.by_name.values()
        }
        self._across_fits.health = self._collectors.health.by_optimizer()

    def _ended_at_step(self, fit: FitState | None) -> int:
        if fit is not None:
            return fit.step
        return self._across_fits.last_step or 0

    def _release(self, fit: FitState | None) -> None:
        """Leaves the model as found, and closes the records."""
        if fit is not None:
            self._collectors.host.release()
            self._functions.release()
        for failure in self._patches.restore():
            print(f"mpprof: could not undo a patch ({failure})")
        self._fit = None
        self._routing.close(self._fit_state, self._ended_at_step(fit))
        self._routing = None
        if _ACTIVE.get(self.model) is self:
            del _ACTIVE[self.model]
