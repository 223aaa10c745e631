"""The recording core: the callback and what drives one profiled fit.

The callback, the profiled fit (dispatch of each train-function call, the
bookkeeping after it, flushes, the end), the guard that keeps mpprof's own
failures from training, the patches, the sampling schedule, the hard stop,
the routing of records, and the backend-neutral collectors. Whatever needs
a framework is asked of the fit's backend (`mpprof.backends`).
"""
