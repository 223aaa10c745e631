"""mpprof: a mixed-precision profiler for Keras.

Add `mpprof.MixedPrecisionProfiler(log_dir)` to `model.fit`, then look at the
"mpprof" tab of `tensorboard --logdir LOG_DIR`, or run `mpprof diagnose LOG_DIR`.
"""

__version__ = "0.1.0"

from mpprof.callback import MixedPrecisionProfiler  # noqa: E402

__all__ = ["MixedPrecisionProfiler", "__version__"]
