"""mpprof: a mixed-precision profiler for Keras.

Add `mpprof.MixedPrecisionProfiler(log_dir)` to `model.fit`, then look at the
"mpprof" tab of `tensorboard --logdir LOG_DIR`, or run `mpprof diagnose LOG_DIR`.
In Python, after `import mpprof`: `mpprof.reader.read_logdir(LOG_DIR)`,
`mpprof.diagnosis.diagnose(run)`, `mpprof.replay.replay(run_dir)`.
"""

from __future__ import annotations

import importlib

from mpprof._version import __version__

# The modules the documentation calls as `mpprof.<name>.<function>`. Each is
# imported at its first use, so `import mpprof` stays light: reading pulls in
# numpy, recording Keras and a framework (seconds), and neither should be paid
# for by a program that only needs the version or one of the others.
_SUBMODULES = (
    "backends", "cli", "diagnosis", "display", "dtypes", "reader", "recording", "records",
    "replay", "report", "terminal", "advisor",
)

__all__ = ["MixedPrecisionProfiler", "__version__", "advise", *_SUBMODULES]


def __getattr__(name: str):
    if name == "MixedPrecisionProfiler":
        from mpprof.recording.callback import MixedPrecisionProfiler

        return MixedPrecisionProfiler
    if name == "advise":
        from mpprof.advisor import advise

        return advise
    if name in _SUBMODULES:
        # import_module binds the submodule on this package too: later
        # lookups find it without coming here.
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'mpprof' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
