"""Whether tf-keras, an optional extra, can be tested here.

`make test` installs it (`pip install -e .[dev,tf-keras]`) and sets
MPPROF_REQUIRE_TF_KERAS=1: then a missing tf-keras fails the tests instead of
skipping them.
"""

import importlib.util
import os

import pytest


def require_tf_keras() -> None:
    """Skips the calling test (or fixture) without tf-keras; fails if required."""
    if importlib.util.find_spec("tf_keras") is not None:
        return
    reason = "tf-keras is an optional extra: pip install 'mpprof[tf-keras]'"
    if os.environ.get("MPPROF_REQUIRE_TF_KERAS") == "1":
        pytest.fail(f"MPPROF_REQUIRE_TF_KERAS=1 but {reason}")
    pytest.skip(reason)
