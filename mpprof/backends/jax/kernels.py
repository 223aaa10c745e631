"""The XProf window of `profile_steps` on JAX: `jax.profiler.start_trace` /
`stop_trace`, which write `RUN_DIR/plugins/profile/<session>/<host>.xplane.pb`
as tf.profiler does. The conversion, the share and the window's states are
shared by every backend (`mpprof.backends.xprof_kernels`,
`mpprof.backends.profile_window`).

Keras' JAX fit dispatches steps asynchronously: the window opens and closes
from the host, after its dispatcher handed a call to the device
(`train_functions`), when the device may still be running earlier steps. So
the window waits for mpprof's step state, which every step takes and returns
(donated), before it starts the trace and before it stops it: the trace then
holds the window's steps whole, and nothing of the steps before it.
"""

from __future__ import annotations

import jax

from mpprof.backends import profile_window


class ProfileWindow(profile_window.ProfileWindow):
    """Traces train steps `start`..`stop` with `jax.profiler` (see
    `mpprof.backends.profile_window.ProfileWindow` for the arguments)."""

    framework = "JAX"

    def __init__(self, start: int, stop: int, run_dir: str):
        super().__init__(start, stop, run_dir)
        # This fit's `JaxBackend` (its step state holds the last step's output).
        self._backend = None

    def _bind(self, backend) -> None:
        self._backend = backend

    def _wait_for_device(self) -> None:
        # One compiled step's outputs are ready together, and a device runs
        # its calls in order: the last step's table ready means every step
        # dispatched so far has run.
        state = getattr(self._backend, "step_state", None)
        if state is not None and state.arrays is not None:
            jax.block_until_ready(state.arrays)

    def _start_profiler(self, run_dir: str) -> None:
        jax.profiler.start_trace(run_dir)

    def _stop_profiler(self) -> None:
        jax.profiler.stop_trace()
