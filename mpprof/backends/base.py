"""The protocol between the recording core and a backend.

A backend is the only code that imports a framework or branches on the
backend or the Keras flavour. The recording core (`mpprof.recording`) asks
the fit's `Backend` for everything framework-bound: the collectors whose
work happens inside the traced step, the train functions it dispatches to,
the call alarm, the facts of the run context and of the devices, the XProf
window. What each factory returns, and what the core calls on it, is
declared in `mpprof.backends.protocol` (checked by mypy in `make test`).
A new backend is one folder of `mpprof/backends/` with a `Backend`
subclass, registered in `mpprof.backends` (`REGISTRY`); it passes
`tests/test_backend_contract.py`.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

from mpprof.backends import protocol, worker_role
from mpprof.backends.worker_role import WorkerRole

# mpprof's own source directory: its frames are hidden from the user's
# tracebacks where the framework hides its own.
_MPPROF_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


# The keys a train step's logs carry the call alarm and the replay capture's
# outputs under (taken out by the core before Keras sees them).
ALARM_LOGS_KEY = "_mpprof_alarm"
REPLAY_LOGS_KEY = "_mpprof_replay"


class Backend:
    """What the recording core asks of the framework a model trains on.

    Class attributes name the flavour's hooks; factories build what one fit
    needs. Each backend's `backend.py` defines its `Backend`.

    Attributes:
        name: the Keras backend ("tensorflow", "jax").
        flavor: the Keras flavour ("keras" for Keras 3, "tf_keras").
        apply_method: the optimizer method every update goes through.
        loss_methods: the optimizer methods a train step hands its loss to.
        alarm_in_logs: whether the train step reports the call alarm in its
            logs (`mpprof.recording` reads it from there each call).
        fits_across_workers: whether this flavour's fit runs across worker
            processes.
        alarm_logs_key, replay_logs_key: the logs keys of the call alarm
            and of the replay capture's outputs (the core takes both out of
            every call's logs, before Keras sees them; a backend that puts
            neither there has nothing taken out).
    """

    name = ""
    flavor = ""
    apply_method = ""
    loss_methods: tuple[str, ...] = ()
    alarm_in_logs = False
    fits_across_workers = False
    alarm_logs_key = ALARM_LOGS_KEY
    replay_logs_key = REPLAY_LOGS_KEY
    # The framework modules that filter their own frames out of a raised
    # error's traceback by a tuple `_EXCLUDED_PATHS` of path fragments
    # (Keras' `keras.src.utils.traceback_utils`, tf-keras', TensorFlow's).
    traceback_filters: tuple[str, ...] = ()

    def hide_own_frames(self) -> None:
        """Adds mpprof's directory to each `traceback_filters` module's
        excluded paths, so that an error of the user's train step shows the
        traceback Keras would show without mpprof (mpprof's wrappers of the
        train function and the layers are hidden as Keras hides its own, and
        shown again by `keras.config.disable_traceback_filtering()`). Private
        framework API: where it is missing, nothing is hidden."""
        for name in self.traceback_filters:
            try:
                module = importlib.import_module(name)
            except Exception:  # noqa: BLE001 - a private module moved: show the frames
                continue
            excluded = getattr(module, "_EXCLUDED_PATHS", None)
            if isinstance(excluded, tuple) and _MPPROF_DIR not in excluded:
                setattr(module, "_EXCLUDED_PATHS", (*excluded, _MPPROF_DIR))  # noqa: B010

    # The fit's collectors and drivers, built by the core once per fit (what
    # each returns, and when it is called: `mpprof.backends.protocol`). A
    # class, or a method where one fit's backend instance holds their shared
    # state (JAX's step state).
    LossScales: Callable[..., protocol.LossScales]
    RunHealth: Callable[..., protocol.RunHealth]
    Float8State: Callable[..., protocol.Collector]
    Float8Shares: Callable[..., protocol.SamplingCollector]
    ReplayCapture: Callable[..., protocol.ReplayCapture]
    TrainFunctions: Callable[..., protocol.TrainFunctions]
    CallAlarm: Callable[..., protocol.CallAlarm]
    PrecisionTracer: Callable[..., protocol.PrecisionTracer]
    LayerCallPatch: Callable[..., protocol.LayerCallPatch]
    # `numerics_taps(model, strategy)`: made at the first sample.
    numerics_taps: Callable[..., protocol.NumericsTaps]

    def __init__(self, model=None):
        """Made once per fit by `mpprof.backends.backend_for(model)`: a backend
        whose factories share state within a fit keeps it on the instance."""

    def distribute_strategy(self, model):
        """The model's distribution strategy, or the backend's stand-in (the
        core asks it `num_replicas_in_sync`)."""
        return model.distribute_strategy

    def worker_role(self, model) -> WorkerRole:
        """This process's place in a fit across processes: its
        `tf.distribute` strategy's cluster role (a single process under any
        other strategy)."""
        return worker_role.of_strategy(self.distribute_strategy(model))

    def logs_of(self, result):
        """The logs dict of what a train-function call returned: the result
        itself on TensorFlow; JAX's fit gets `(logs, state)`. The core takes
        its own keys out of this dict (in place)."""
        return result

    def is_optimizer(self, value) -> bool:
        raise NotImplementedError

    def is_loss_scale_optimizer(self, optimizer) -> bool:
        raise NotImplementedError

    def candidate_optimizers(self, model) -> list[tuple[str, object]]:
        """The optimizers a train step may use, each with the name it is known by.

        The compiled `model.optimizer` ("optimizer") and every optimizer held
        in an attribute of the model (a GAN's `self.g_opt`, `self.d_opt`):
        which of them a step really uses is only known once it is traced
        (`mpprof.backends.optimizer_usage.OptimizerUsage`).
        """
        found: list[tuple[str, object]] = []
        if self.is_optimizer(model.optimizer):
            found.append(("optimizer", model.optimizer))
        for name, value in sorted(vars(model).items()):
            if (self.is_optimizer(value) and not name.startswith("_")
                    and all(value is not known for _, known in found)):
                found.append((name, value))
        return found

    @property
    def callback_list_class(self) -> type:
        raise NotImplementedError

    @property
    def tensorboard_class(self) -> type:
        raise NotImplementedError

    def steps_per_execution(self, model) -> int:
        raise NotImplementedError

    def fixed_steps_per_execution(self, model) -> int | None:
        """Steps per call when fixed for the whole fit, else None."""
        raise NotImplementedError

    def run_context(self, model, *, collectors: dict, step: int, fit_count: int,
                    hardware: dict | None = None) -> dict:
        """The framework's part of the run context (`mpprof.recording`); each
        backend's `context.run_context`."""
        raise NotImplementedError

    def hardware_facts(self, sampler) -> dict:
        """The run context's hardware facts (`sampler`: the fit's NVML sampler,
        started, or probed once when the fit samples no GPU)."""
        raise NotImplementedError

    def profile_window(self, start: int, stop: int, run_dir: str) -> protocol.ProfileWindow:
        """An XProf trace window over train steps `start`..`stop`."""
        raise NotImplementedError
