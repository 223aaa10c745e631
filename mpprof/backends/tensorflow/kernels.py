"""The XProf window of `profile_steps` on TensorFlow: tf.profiler's start and
stop. The conversion, the share and the window's states are shared by every
backend (`mpprof.backends.xprof_kernels`, `mpprof.backends.profile_window`).
"""

from __future__ import annotations

import tensorflow as tf

from mpprof.backends import profile_window


class ProfileWindow(profile_window.ProfileWindow):
    """Traces train steps `start`..`stop` with tf.profiler (see
    `mpprof.backends.profile_window.ProfileWindow` for the arguments); it
    closes once the callback has seen step `stop`'s logs, without a wait."""

    framework = "TensorFlow"

    def _start_profiler(self, run_dir: str) -> None:
        tf.profiler.experimental.start(run_dir)

    def _stop_profiler(self) -> None:
        tf.profiler.experimental.stop()
