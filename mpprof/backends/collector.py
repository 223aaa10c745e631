"""The lifecycle every collector of a profiled fit implements.

A collector owns one concern (the inventory, the loss scale, the health
checks, the numerics samples, the host's GPU) from its patches to its
records. The profiler calls each step of the lifecycle through its `Guard`:
whatever a collector raises switches that collector off for the rest of the
fit, with the reason in the run context, and training goes on.

    install(fit, patches)   at train begin, before the first step is traced:
                            patches (through `patches`, so that they are all
                            undone when the fit ends) and device state
    after_call(fit)         after each train-function call: host bookkeeping,
                            no device read unless one is due (it runs on
                            every step: a collector with nothing to do then
                            says so with `after_each_call`, one that can
                            wait a while with `quiet_until`)
    after_sample(fit)       after each sampled (instrumented) call: read what
                            the instrumented step recorded
    flush(fit)              at flush points (every N steps or seconds, epoch
                            ends, the end of fit, SIGTERM): read the device
                            state and write the records
    end(fit)                when the fit ends or raises, before the last flush
    context()               its state for the run context

Collectors never judge (`mpprof.diagnosis` does) and write only through
`fit.writer` / `fit.host_writer`.
"""

from __future__ import annotations

import math

from mpprof.backends.patching import Patches


class Collector:
    """Base class: every step of the lifecycle does nothing by default."""

    # The collector's key in the run context's "collectors".
    name = ""

    def install(self, fit, patches: Patches) -> None:
        """Called once at train begin, before the first step is traced."""

    def after_call(self, fit) -> None:
        """Called after each train-function call, when `after_each_call`."""

    @property
    def after_each_call(self) -> bool:
        """Whether `after_call` has work (asked once the collector is
        installed, then after the first call and after each sampled call): a
        call per step each adds up on fast steps."""
        return type(self).after_call is not Collector.after_call

    def quiet_until(self) -> float:
        """Until when (a `time.monotonic()`) the calls after this one may
        skip `after_call` ("quiet calls": `fit.step` is still kept current on
        each); asked after each call that ran it. By default, never: -inf."""
        return -math.inf

    def after_sample(self, fit) -> None:
        """Called after each sampled call (`fit.sample_step` is its step)."""

    def flush(self, fit) -> None:
        """Reads what the device holds and writes the pending records."""

    def end(self, fit) -> None:
        """The fit ends (or raised); the last `flush` follows."""

    def context(self) -> dict:
        """This collector's state for the run context."""
        return {"state": "ok"}
