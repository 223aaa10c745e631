"""In CI a skip fails: the conftest's hook, run by a real pytest on a small
test file (a subprocess: the hook reads the environment of its own run)."""

import os
import pathlib
import subprocess
import sys

import pytest

TESTS = pathlib.Path(__file__).resolve().parent

SAMPLE = '''
import pytest

def test_passes():
    pass

def test_skips():
    pytest.skip("no frobnicator here")

def test_imports_or_skips():
    pytest.importorskip("no_such_module_mpprof_test")

@pytest.fixture
def unavailable():
    pytest.skip("the fixture cannot run here")

def test_with_a_fixture_that_skips(unavailable):
    pass

@pytest.mark.xfail(reason="known", strict=True)
def test_expected_to_fail():
    raise AssertionError
'''


def run_pytest(tmp_path, ci):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no_silent_skips", "-p", "no:cacheprovider",
         "-rA", "test_sample.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
    )


@pytest.mark.parametrize("ci", ["true", "1", "True"])
def test_in_ci_every_skip_fails_with_its_reason(tmp_path, ci):
    result = run_pytest(tmp_path, ci)
    assert result.returncode == 1, result.stdout
    summary = result.stdout.strip().splitlines()[-1]
    assert "1 passed" in summary and "1 xfailed" in summary, summary
    assert "2 failed" in summary and "1 error" in summary and "skipped" not in summary, summary
    for reason in ("no frobnicator here", "no_such_module_mpprof_test",
                   "the fixture cannot run here"):
        assert reason in result.stdout
    assert "CI never passes by skipping" in result.stdout


@pytest.mark.parametrize("ci", [None, "", "false", "0"])
def test_outside_ci_a_skip_stays_a_skip(tmp_path, ci):
    result = run_pytest(tmp_path, ci)
    assert result.returncode == 0, result.stdout
    summary = result.stdout.strip().splitlines()[-1]
    assert "1 passed" in summary and "3 skipped" in summary and "1 xfailed" in summary, summary
