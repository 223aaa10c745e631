"""In CI a skipped test fails: CI never passes by skipping.

CI services set `CI` (GitHub Actions, GitLab and most others: `CI=true`).
There a test that skips (a missing browser, tf-keras or keras-hub, a fixture
that cannot run on the runner) is reported as failed with its skip reason, so
a green run means every collected test ran. An expected failure
(`pytest.mark.xfail`) stays what it is. Outside CI, skips stay skips; the
project's own switches (MPPROF_REQUIRE_BROWSER=1, MPPROF_REQUIRE_TF_KERAS=1)
turn particular ones into failures too.

`conftest.py` registers the hook; `-p no_silent_skips` loads it alone.
"""

from __future__ import annotations

import os

import pytest


def in_ci(environ=os.environ) -> bool:
    return environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or hasattr(report, "wasxfail") or not in_ci():
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else longrepr
    report.outcome = "failed"
    report.longrepr = (
        f"skipped in CI (CI={os.environ.get('CI')!r}), and CI never passes by skipping: "
        f"{reason}"
    )
