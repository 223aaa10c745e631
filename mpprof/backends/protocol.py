"""The protocol between the recording core and a backend, declared once.

The recording core (`mpprof.recording`) never imports a framework: at train
begin it asks `mpprof.backends.backend_for(model)` for the model's `Backend`
(`mpprof.backends.base`) and builds everything framework-bound from that
backend's factories. This module declares every member the core calls on the
objects those factories return; mypy checks the core's calls against it and
each registered backend's `Backend` against `Backend` (`make test`), and
`tests/test_backend_contract.py` checks each backend's behaviour.

What holds for every member:

- the work inside the traced (or jitted) step is the backend's; the host
  reads device state only where a member below says it may (a flush, a
  sampled call, an alarm that rang). A member called after every call never
  syncs the host with the device: a per-step sync costs more than the
  whole profiler's budget on a fast step;
- nothing here raises into the user's training: the core calls each member
  through its `Guard` (`mpprof.recording.guard`), which switches the
  collector off with the reason in the run context; a member that must
  not fail inside the traced step catches its own errors
  (`mpprof.backends.traced_guard.TracedGuard`);
- every patch of a Keras or framework object goes through the fit's
  `Patches` (`mpprof.backends.patching`), so that it is undone when the
  fit ends; nothing is left on the model.

The factories (class attributes of a `Backend`, or methods where one fit's
instance holds state, as on JAX) and what they return:

- `LossScales(backend, usage, strategy, capacity, reuse, earlier)`:
  `LossScales`; `RunHealth(backend, usage, strategy, graph_step_of, reuse,
  instrumenting)`: `RunHealth`;
- `Float8State(model, loss_scales)`: a `Collector`; `Float8Shares(model,
  sampling)`: a `SamplingCollector`; `ReplayCapture(budget, backend,
  loss_scales, health, instrumenting)`: `ReplayCapture`;
- `TrainFunctions(model, backend, instrumented)`, `CallAlarm(counters,
  host_reads_needed)`, `PrecisionTracer(model)`, `LayerCallPatch(model,
  hooks)`: the protocols of the same names;

each once per fit, at train begin; `numerics_taps(model, strategy)`: the
`NumericsTaps`, at the first sampled call; `profile_window(start, stop,
run_dir)`: the `ProfileWindow`, once per profiler.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from mpprof.backends.optimizer_usage import OptimizerUse
    from mpprof.backends.patching import Patches


@runtime_checkable
class Collector(Protocol):
    """One concern of a fit, from its patches to its records.

    The lifecycle (`mpprof.backends.collector.Collector` is the base
    class every collector extends; each step does nothing by default):
    `install` at train begin, `after_call` after each train-function call
    (when `after_each_call`), `after_sample` after each sampled call,
    `flush` at flush points, `end` when the fit ends, `context` for the run
    context. Collectors never judge (`mpprof.diagnosis` does) and write
    only through `fit.writer` / `fit.host_writer`.
    """

    # The collector's key in the run context's "collectors".
    name: str

    def install(self, fit: Any, patches: Patches) -> None:
        """Once, at train begin, before the first step is traced: its patches
        (through `patches`) and device state."""

    def after_call(self, fit: Any) -> None:
        """After each train-function call while `after_each_call`: host
        bookkeeping only, never a device read unless one is due."""

    @property
    def after_each_call(self) -> bool:
        """Whether `after_call` has work (asked at install, after the first
        call and after each sampled call)."""

    def quiet_until(self) -> float:
        """Until when (`time.monotonic()`) later calls may skip `after_call`."""

    def after_sample(self, fit: Any) -> None:
        """After each sampled (instrumented) call: read what it recorded."""

    def flush(self, fit: Any) -> None:
        """At a flush point: read the device state once, write the records."""

    def end(self, fit: Any) -> None:
        """The fit ends (or raised); the last `flush` follows."""

    def context(self) -> dict:
        """This collector's state for the run context (JSON-safe)."""


@runtime_checkable
class SamplingCollector(Collector, Protocol):
    """A collector whose in-graph taps run on sampled calls only."""

    def instrument(self, on: bool) -> None:
        """Switches the taps on just before a sampled call and off after it:
        a host flag the traced taps read, never a retrace."""


@runtime_checkable
class LossScales(Collector, Protocol):
    """Every LossScaleOptimizer's scale, overflows and skipped steps.

    Counting happens inside the step (on device); the host reads the counts
    only in `flush`, `note_overflows` (an alarm rang) and `step_of` (asked
    at the first call, at sampled calls and at flushes).
    """

    # One series per loss-scaled optimizer the step may use, by the name the
    # optimizer is known by (`"optimizer"`, a GAN's `"g_opt"`); kept across
    # fits (`AcrossFits.loss_scales`, by optimizer id, each with `optimizer`).
    by_name: dict[str, Any]

    def __bool__(self) -> bool:
        """Whether any series is active (a loss-scaled optimizer is used)."""

    def note_overflows(self, fit: Any) -> None:
        """A call's alarm rang: read the overflow counts (a host read, on
        that call only) and arm a forensic sample when one overflowed."""

    def skipped_counters(self) -> list:
        """The in-graph counters of skipped steps the `CallAlarm` sums
        (framework values, asked while the step is traced and on reads)."""

    def skipped_steps(self) -> int:
        """Steps skipped so far, summed over the series (a host read, at
        context writes only)."""

    def step_of(self, use: OptimizerUse) -> int | None:
        """The step `use`'s optimizer has reached (iterations plus skipped
        steps), or None where the backend does not follow it."""

    def scale_value(self) -> float:
        """The primary series' scale now (NaN: none), for a numerics sample."""

    def scale_of(self, name: str) -> Any:
        """A getter of series `name`'s scale inside the traced step (None:
        unscaled), which the numerics taps divide the gradients by."""

    def graph_step_of(self, name: str) -> Any:
        """A getter of the step of series `name` inside the traced step, by
        which `RunHealth` dates a non-finite loss."""


@runtime_checkable
class RunHealth(Collector, Protocol):
    """The in-step non-finite loss check of each optimizer's loss, and the
    weights' health at epoch ends."""

    def nonfinite_counters(self) -> list:
        """The in-graph counters of non-finite losses the `CallAlarm` sums."""

    def note_calls(self, first_step: int, last_step: int) -> None:
        """A call covering `first_step`..`last_step` rang the alarm: date the
        first non-finite loss (a host read, on that call only)."""

    def last_loss(self) -> float:
        """The loss of the last step (a host read: sampled calls only)."""

    def check_weights(self, model: Any) -> None:
        """At an epoch end: whether any weight is non-finite."""

    def record(self, step: int) -> dict:
        """The health part of the run context at `step`."""

    def by_optimizer(self) -> dict[int, Any]:
        """What the next fit of the same profiler continues, by optimizer id."""


@runtime_checkable
class ReplayCapture(Collector, Protocol):
    """Copies a sampled step that overflowed into `replay/step_<N>/`."""

    def wrap_train_step(self, fit: Any, patches: Patches) -> None:
        """At train begin, before the train functions are made: wraps the
        model's train step (through `patches`) so that a sampled step keeps
        what it received."""


@runtime_checkable
class CallAlarm(Protocol):
    """One number each call returns: which call had trouble (a skipped step
    or a non-finite loss), so that the host reads counters only then."""

    def install(self, model: Any, patches: Patches, in_logs: bool) -> None:
        """At train begin: takes the counters' start; with `in_logs`, makes
        the train step report the alarm in its logs (through `patches`)."""

    def unchanged(self, value: Any) -> bool:
        """A quiet call's quick check: whether the alarm `value` its logs held
        (None: none) surely says no trouble. Called on every quiet call: no
        device sync beyond the number itself."""

    def hold(self, value: Any, first_step: int, last_step: int, *,
             wait: bool) -> list[tuple[int, int]]:
        """Keeps this call's alarm and examines the one before (and with
        `wait` this one too); returns the steps of each call that rang."""

    def drain(self) -> tuple[int, int] | None:
        """Examines the kept alarm now (before a flush)."""


@runtime_checkable
class ReplayedSample(Protocol):
    """A forensic sample of an earlier step's batch (where the backend
    dispatches ahead of the host), as `TrainFunctions.replayed` gives it."""

    step: int

    def note(self) -> dict:
        """What the numerics records say of it (JSON-safe)."""


@runtime_checkable
class TrainFunctions(Protocol):
    """The plain and the instrumented train function, and the dispatch into
    them. `args` is what fit passes its train function (TensorFlow:
    `(iterator,)`; JAX: `(state, iterator)`); what a call returns goes back
    to fit unchanged, and `Backend.logs_of` gives its logs."""

    @property
    def instrumented(self) -> Any:
        """The instrumented function; None: none (not wanted, dropped after its
        first run failed, or not possible)."""

    @property
    def instrumented_off(self) -> str | None:
        """Why the first traced step showed the instrumented function would
        change the run (None: it may be used); asked after the first call."""

    @property
    def replayed(self) -> ReplayedSample | None:
        """The last sampled call's sample of an earlier step's batch, or None
        (every backend whose samples are of the call's own step)."""

    def install(self, dispatcher: Callable[..., Any], patches: Patches) -> None:
        """Makes both functions and puts `dispatcher` in `model.train_function`
        (through `patches`)."""

    # The arguments: fit's (`args`, which differ by backend), then by keyword
    # `on_abort: Callable[[], None]` and, for `run_instrumented`,
    # `on_failure: Callable[[str], None]` and `forensic: bool`.
    def run_plain(self, *args: Any, **kwargs: Any) -> Any:
        """One call of the plain function: the least Python there is (it runs
        on every step, no host sync); `on_abort()` before the user's own error
        propagates, never on the end of the data."""

    def run_instrumented(self, *args: Any, **kwargs: Any) -> Any:
        """One sampled call (`forensic`: a forensic sample). If its first run
        fails, it is dropped (`on_failure(reason)`) and the plain function
        runs instead."""

    def release(self) -> None:
        """Drops both functions at the fit's end."""


@runtime_checkable
class LayerCallHook(Protocol):
    """What sees each layer call a `LayerCallPatch` wraps."""

    def on_call(self, layer: Any, args: tuple, kwargs: dict, outputs: Any) -> Any:
        """Sees one call of `layer` while the step is traced; returns
        `outputs` (possibly replaced)."""


@runtime_checkable
class LayerCallPatch(Protocol):
    """Wraps the called method of the model and every nested layer so that
    hooks see each call while the step is traced."""

    def add_hook(self, hook: LayerCallHook) -> None:
        """Adds a hook; installed wrappers see it from their next call."""

    def install(self, patches: Patches) -> None:
        """Wraps every layer there is now, and later its new children, through
        `patches`."""


@runtime_checkable
class PrecisionTracer(LayerCallHook, Protocol):
    """Dtypes, policies and casts seen while the step is traced."""

    @property
    def traced(self) -> bool:
        """Whether a step was traced (the inventory is complete)."""

    def inventory(self) -> dict:
        """The INVENTORY record (`mpprof.records.schema`): JSON-safe; asked once
        the step was traced."""


@runtime_checkable
class NumericsTaps(LayerCallHook, Protocol):
    """Per-layer statistics of sampled calls, measured in the step."""

    # Set by the core around a sampled call (a host flag the taps read).
    instrumenting: bool

    def wrap_optimizer(self, optimizer: Any, loss_scale_getter: Any, patches: Patches) -> None:
        """Taps `optimizer`'s gradients, unscaled by `loss_scale_getter()`."""

    def read(self) -> dict[str, np.ndarray]:
        """The last sample's records (a host read: after a sampled call)."""

    def layout(self, policy_max: float) -> dict:
        """The NUMERICS_LAYOUT record of the rows `read` gives."""


@runtime_checkable
class ProfileWindow(Protocol):
    """The XProf trace window of `profile_steps` (`profile_window.ProfileWindow`
    is the shared implementation; a backend gives its profiler)."""

    state: str
    run_dir: str

    def begin(self, step: int, callbacks: Sequence[Any] = (), backend: Any = None) -> None:
        """At train begin."""

    def after_steps(self, step: int) -> dict | None:
        """After a call that reached `step`: opens or closes the trace."""

    def finish(self) -> dict | None:
        """At the fit's end: closes a trace left open."""

    def context(self) -> dict:
        """The run context's "kernels" entry."""

