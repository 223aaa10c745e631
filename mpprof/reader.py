"""Reading a logdir: `read_logdir`, `read_run` and the `Run` they return.

The public name of `mpprof.records.reader`, where the reading lives.
"""

from mpprof.records.reader import *  # noqa: F403 - the public reading API
from mpprof.records.reader import __all__  # noqa: F401
