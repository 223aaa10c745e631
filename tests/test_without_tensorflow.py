"""Records written and read with TensorFlow, Keras, JAX and torch absent.

The record format and everything that reads it import no framework (the
import-linter contracts in pyproject.toml say so statically); here a fresh
process where importing any of them fails re-writes a real recorded run
record by record with `RecordWriter`, reads it back, and serves it through
the CLI, the HTML report and the TensorBoard tab.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import diagnosis_runs
import pytest

SCRIPT = textwrap.dedent("""
    import json, sys
    for name in ("tensorflow", "keras", "tf_keras", "jax", "torch"):
        sys.modules[name] = None  # `import name` now raises ImportError

    import mpprof
    from mpprof import cli
    from mpprof import diagnosis
    from mpprof.records import reader
    from mpprof.records import schema
    from mpprof.records.writer import RecordWriter
    from tensorboard.plugins import base_plugin
    from tensorboard_plugin_mpprof import routes
    from werkzeug import test

    source, logdir, report = sys.argv[1:4]
    original = reader.read_run(source, "train")
    writer = RecordWriter(f"{logdir}/train")
    for key, records in original.records.items():
        record, _, series = key.partition(schema.SERIES_SEPARATOR)
        for r in records:
            if isinstance(r.value, (dict, list)):
                writer.write_json(record, r.value, r.step)
            else:
                writer.write_array(record, r.value, r.step, series or None)
    writer.close()
    copy = reader.read_run(logdir, "train")
    same = sorted(copy.records) == sorted(original.records) and all(
        [(r.step, json.dumps(r.value, default=lambda a: a.tolist())) for r in copy.records[k]]
        == [(r.step, json.dumps(r.value, default=lambda a: a.tolist()))
            for r in original.records[k]]
        for k in original.records)
    findings = [f.code for f in diagnosis.evaluate(copy).findings]
    codes = [cli.main(["diagnose", logdir]), cli.main(["summary", logdir]),
             cli.main(["report", logdir, "-o", report, "-q"])]
    apps = routes.MpprofPlugin(base_plugin.TBContext(logdir=logdir)).get_plugin_apps()
    statuses = [test.Client(apps[route]).get(route, query_string=query).status_code
                for route, query in (("/runs", {}), ("/findings", {"run": "train"}),
                                     ("/loss_scale", {"run": "train"}),
                                     ("/numerics", {"run": "train", "direction": "forward",
                                                    "stat": "abs_max"}))]
    print(json.dumps({"same": same, "records": len(copy.records), "findings": findings,
                      "expected": [f.code for f in diagnosis.evaluate(original).findings],
                      "codes": codes, "statuses": statuses, "warnings": copy.warnings}))
""")


def test_a_run_is_written_read_and_served_without_any_framework(tmp_path):
    source = diagnosis_runs.logdir("storm_sampled")  # loss scale, numerics, replay
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(source), str(tmp_path / "logs"),
         str(tmp_path / "report.html")],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    found = json.loads(result.stdout.splitlines()[-1])
    assert found["same"] and found["records"] >= 5 and found["warnings"] == []
    assert found["findings"] == found["expected"] and "MP002" in found["findings"]
    # diagnose exits 0 without --fail-on; every route answers.
    assert found["codes"] == [0, 0, 0]
    assert found["statuses"] == [200, 200, 200, 200]


REPLAY_SCRIPT = textwrap.dedent("""
    import sys
    for name in sys.argv[2].split(","):
        sys.modules[name] = None  # not installed: `import name` raises ImportError

    from mpprof import cli
    sys.exit(cli.main(["replay", sys.argv[1]]))
""")


def _replay_without(logdir, missing: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", REPLAY_SCRIPT, str(logdir), missing],
                          capture_output=True, text=True, timeout=300)


def _capture_trained_on(tmp_path, backend: str):
    """A copy of a real capture, its manifest saying which backend trained it."""
    logdir = tmp_path / backend
    shutil.copytree(diagnosis_runs.logdir("forward_overflow"), logdir)
    for manifest in (logdir / "train" / "replay").glob("step_*/manifest.json"):
        fields = json.loads(manifest.read_text())
        manifest.write_text(json.dumps({**fields, "backend": backend}))
    return logdir


@pytest.mark.parametrize(("backend", "missing", "extra"), [
    ("jax", "jax,jaxlib", "mpprof[jax]"),
    ("tensorflow", "tensorflow", "mpprof[tensorflow]"),
    ("jax", "keras", "mpprof[jax]"),
])
def test_replay_without_its_backend_says_which_extra_to_install(tmp_path, backend, missing,
                                                                 extra):
    result = _replay_without(_capture_trained_on(tmp_path, backend), missing)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert f'pip install "{extra}"' in result.stderr, result.stderr
    framework = {"jax": "JAX", "tensorflow": "TensorFlow"}[backend]
    assert f"trained on {framework}" in result.stderr
    # The progress line names the framework the replay imports.
    assert f"(imports Keras and {framework})" in result.stderr
    assert result.stdout == ""
