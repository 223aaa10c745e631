"""mpprof: a mixed-precision profiler for Keras.

Add `mpprof.MixedPrecisionProfiler(log_dir)` to `model.fit`, then look at the
"mpprof" tab of `tensorboard --logdir LOG_DIR`, or run `mpprof diagnose LOG_DIR`.
"""

from __future__ import annotations

from mpprof._version import __version__

__all__ = ["MixedPrecisionProfiler", "__version__", "advise"]


def __getattr__(name: str):
    # The callback imports Keras and TensorFlow (seconds): only code that
    # records a run pays for them, not `mpprof diagnose` or the TensorBoard
    # plugin, which read logdirs through `mpprof.records.reader`.
    if name == "MixedPrecisionProfiler":
        from mpprof.recording.callback import MixedPrecisionProfiler

        return MixedPrecisionProfiler
    if name == "advise":
        from mpprof.advisor import advise

        return advise
    raise AttributeError(f"module 'mpprof' has no attribute {name!r}")
