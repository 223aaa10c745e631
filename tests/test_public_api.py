"""`import mpprof` is light, and every documented `mpprof.<module>` works after it.

Each check runs in a fresh interpreter: in this process the test suite has
imported the submodules already, which would hide a missing lazy import.
"""

import subprocess
import sys
import textwrap

import pytest

# The modules the README and docs/ call as `mpprof.<name>.<function>`.
DOCUMENTED = ("reader", "diagnosis", "replay", "report", "records", "display", "cli")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=120)


def test_import_mpprof_loads_no_submodule_and_no_numpy():
    result = _run("""
        import sys
        import mpprof
        loaded = sorted(m for m in sys.modules
                        if m.startswith("mpprof.") and m != "mpprof._version")
        print(loaded, "numpy" in sys.modules, "keras" in sys.modules)
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[] False False"


@pytest.mark.parametrize("name", DOCUMENTED)
def test_documented_module_is_reachable_after_import_mpprof(name):
    result = _run(f"""
        import mpprof
        module = mpprof.{name}
        assert module.__name__ == "mpprof.{name}", module
        assert "{name}" in dir(mpprof)
        print("ok")
    """)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"


def test_the_readme_reading_calls_work_after_import_mpprof(overflow_logdir):
    result = _run(f"""
        import sys
        import mpprof
        runs = mpprof.reader.read_logdir({str(overflow_logdir)!r})
        for run in runs.values():
            print(run.name, sorted({{f.code for f in mpprof.diagnosis.diagnose(run)}}))
        assert "keras" not in sys.modules  # reading and diagnosing need no framework
    """)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "train ['MP002'" in result.stdout, result.stdout


def test_an_unknown_attribute_is_still_an_attribute_error():
    result = _run("""
        import mpprof
        try:
            mpprof.no_such_module
        except AttributeError as error:
            print(error)
    """)
    assert result.stdout.strip() == "module 'mpprof' has no attribute 'no_such_module'"
