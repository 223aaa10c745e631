"""The profile window of `profile_steps` on PyTorch: not traced yet.

TensorFlow and JAX write an XProf trace (`xplane.pb`) that
`mpprof.backends.xprof_kernels` reads for the Tensor Core kernel share;
`torch.profiler` writes a Chrome trace of its own, which that reader does
not parse. The window says so in the run context instead of tracing, and
training goes on.
"""

from __future__ import annotations

from mpprof.backends import profile_window

NOT_YET = ("profile_steps is not traced on PyTorch yet: torch.profiler writes a Chrome "
           "trace, which mpprof's XProf reader (the Tensor Core kernel share) does not "
           "read. Profile with torch.profiler yourself, or train on TensorFlow or JAX")


class ProfileWindow(profile_window.ProfileWindow):
    """Says that the window is not traced on PyTorch (arguments: as
    `mpprof.backends.profile_window.ProfileWindow`)."""

    framework = "PyTorch"

    def _start_profiler(self, run_dir: str) -> None:
        raise NotImplementedError(NOT_YET)

    def _stop_profiler(self) -> None:
        """(Never started.)"""
