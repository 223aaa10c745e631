"""`mpprof diagnose` end to end on real logdirs: text, JSON, exit codes, errors."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from diagnosis_runs import HOSTILE_NAME, HOSTILE_RUN, logdir

from mpprof import cli, diagnosis


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """A logdir holding a healthy run and an overflow storm, as two runs."""
    root = tmp_path_factory.mktemp("two_runs")
    shutil.copytree(logdir("healthy_mixed"), root / "healthy")
    shutil.copytree(logdir("storm"), root / "storm")
    return root


def diagnose(capsys, *args) -> tuple[int, str, str]:
    code = cli.main(["diagnose", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_text_has_one_section_per_run_grouped_by_severity(two_runs, capsys):
    code, out, _ = diagnose(capsys, two_runs)
    assert code == 0
    healthy, storm = out.split("\n\n== run ")
    assert healthy.startswith("== run healthy/train")
    assert storm.startswith("storm/train")
    assert "MP002" not in healthy and "MP011" in healthy
    # Grouped by severity, the fix beneath the finding, the step shown.
    lines = storm.splitlines()
    assert lines[1] == "WARNING (2)"
    mp002 = next(i for i, line in enumerate(lines) if "MP002" in line)
    assert lines[mp002 + 1].strip() == "step 0"
    assert lines[mp002 + 2].strip().startswith("evidence: steps=24")
    assert lines[mp002 + 3].strip() == "fix:"
    assert "LossScaleOptimizer(optimizer, initial_scale=2.0**" in lines[mp002 + 5]
    assert "\033[" not in out  # not a terminal: no colour
    assert "not measured: MP003" in storm


def test_colour_on_a_terminal_and_control_characters_escaped():
    run = type("FakeRun", (), {})()
    run.name, run.warnings, run.context, run.loss_scale = "r", [], {}, None
    finding = diagnosis.Finding("MP003", "critical", "t", "evil\x1b[2Jname", 1, {}, "f")
    text = diagnosis.format_text(run, diagnosis.Diagnosis([finding], []), color=True)
    assert "\033[1;31mMP003\033[0m" in text
    assert "\x1b[2J" not in text and "evil\\x1b[2Jname" in text


def test_json_is_a_list_most_severe_first(two_runs, capsys):
    code, out, _ = diagnose(capsys, two_runs, "--format", "json")
    assert code == 0
    findings = json.loads(out)
    assert {f["run"] for f in findings} == {"healthy/train", "storm/train"}
    for finding in findings:
        assert {"code", "severity", "title", "layer", "step", "evidence", "fix"} <= set(finding)
    severities = [diagnosis.SEVERITIES.index(f["severity"]) for f in findings]
    assert severities == sorted(severities)
    storm = [f for f in findings if f["run"] == "storm/train"]
    assert [f["code"] for f in storm] == ["MP002", "MP011"]
    assert storm[0]["step"] == 0 and storm[0]["layer"] is None


def test_json_carries_critical_findings_and_layers(capsys):
    code, out, _ = diagnose(capsys, logdir("forward_overflow"), "--format", "json")
    assert code == 0
    first = json.loads(out)[0]
    assert (first["code"], first["severity"], first["layer"]) == ("MP003", "critical", "second")
    assert first["evidence"]["nonfinite_frac"] == 1.0


@pytest.mark.parametrize(
    ("run", "fail_on", "expected"),
    [
        ("healthy_float32", "warning", 0),  # no findings at all
        ("healthy_mixed", "critical", 0),  # only a warning (MP011)
        ("healthy_mixed", "warning", 1),
        ("forward_overflow", "critical", 1),  # MP003
        ("collapse", None, 0),  # without --fail-on nothing fails
    ],
)
def test_fail_on_sets_the_exit_code(capsys, run, fail_on, expected):
    args = [logdir(run)] + (["--fail-on", fail_on] if fail_on else [])
    assert diagnose(capsys, *args)[0] == expected


def test_run_selects_one_run(two_runs, capsys):
    code, out, _ = diagnose(capsys, two_runs, "--run", "storm/train", "--format", "json")
    assert code == 0
    assert {f["run"] for f in json.loads(out)} == {"storm/train"}
    code, _, err = diagnose(capsys, two_runs, "--run", "nope")
    assert code == 2
    assert "No mpprof run 'nope'" in err and "healthy/train, storm/train" in err


def test_missing_logdir(tmp_path, capsys):
    code, out, err = diagnose(capsys, tmp_path / "absent")
    assert code == 2 and out == ""
    assert "does not exist" in err


def test_logdir_without_mpprof_data_says_what_to_add(tmp_path, capsys):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "events.out.tfevents.1.host").write_bytes(b"")  # TB's own
    code, _, err = diagnose(capsys, tmp_path)
    assert code == 2
    assert "callbacks=[mpprof.MixedPrecisionProfiler(log_dir=...)]" in err


def test_truncated_event_file_diagnoses_what_is_readable(tmp_path, capsys):
    shutil.copytree(logdir("storm"), tmp_path, dirs_exist_ok=True)
    (event_file,) = (tmp_path / "train").glob("*tfevents*")
    data = event_file.read_bytes()
    event_file.write_bytes(data[: len(data) - 40])  # cut the last record short
    code, out, err = diagnose(capsys, tmp_path, "--format", "json")
    assert code == 0
    assert "incomplete record" in err and "warning" in err
    assert "MP002" in {f["code"] for f in json.loads(out)}


def test_corrupt_event_file_beside_a_good_one(tmp_path, capsys):
    shutil.copytree(logdir("storm"), tmp_path, dirs_exist_ok=True)
    (event_file,) = (tmp_path / "train").glob("*tfevents*")
    garbage = event_file.parent / ("events.out.tfevents.2.host" + ".mpprof.v2")
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00" + b"\xff" * 40)
    code, out, err = diagnose(capsys, tmp_path)
    assert code == 0
    assert "corrupt record" in err
    assert "MP002" in out


def test_hostile_names_print_as_text(capsys):
    code, out, _ = diagnose(capsys, logdir("hostile"), "--run", HOSTILE_RUN)
    assert code == 0
    assert f"layer {HOSTILE_NAME}" in out


def test_console_script_end_to_end(two_runs):
    env = {**os.environ, "NO_COLOR": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mpprof.cli", "diagnose", str(two_runs), "--fail-on", "warning"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert "== run storm/train" in result.stdout
    assert "MP002" in result.stdout
