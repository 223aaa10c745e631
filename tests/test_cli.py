"""`mpprof diagnose` end to end on real logdirs: text, JSON, exit codes, errors."""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
from broken_logdirs import (
    BAD_STEP,
    MALFORMED,
    copy_run,
    event_file,
    flip_loss_scale_step_bit,
    malformed_logdir,
    newer_schema_run,
    without_root_privileges,
    write_malformed,
    write_record,
    zeros_run,
)
from diagnosis_runs import HOSTILE_NAME, HOSTILE_RUN, logdir

from mpprof import cli, diagnosis
from mpprof.records import reader, schema
from mpprof.records.run_context import RunContext


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
    assert lines[mp002 + 2].strip().startswith("evidence: optimizer=optimizer, steps=24")
    assert lines[mp002 + 3].strip() == "fix:"
    assert "LossScaleOptimizer(optimizer, initial_scale=2.0**" in lines[mp002 + 5]
    assert "\033[" not in out  # not a terminal: no colour
    assert "not measured: MP003" in storm


def test_colour_on_a_terminal_and_control_characters_escaped():
    run = type("FakeRun", (), {})()
    run.name, run.warnings, run.context, run.loss_scale = "r", [], RunContext(), None
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


def test_python_dash_m_mpprof_is_the_command(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mpprof", "diagnose", str(tmp_path / "absent")],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2 and "does not exist" in result.stderr


def test_a_file_given_as_the_logdir_is_named_a_file(tmp_path, capsys):
    path = tmp_path / "events.out.tfevents.1.mpprof.v2"
    path.write_bytes(b"")
    code, out, err = diagnose(capsys, path)
    assert code == 2 and out == ""
    assert "is a file, not a directory" in err


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


# ---------------------------------------------------------------- bad input


def summary(capsys, *args) -> tuple[int, str, str]:
    code = cli.main(["summary", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def mpprof(*args, timeout=120, privileged=True) -> subprocess.CompletedProcess:
    """`mpprof ARGS` in a fresh process (killed after `timeout` seconds: a
    hang fails the test instead of stopping the suite)."""
    command = [sys.executable, "-m", "mpprof.cli", *map(str, args)]
    if not privileged:
        command = without_root_privileges(command)
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "NO_COLOR": "1"})


@pytest.fixture(scope="module")
def malformed(tmp_path_factory):
    return malformed_logdir(tmp_path_factory.mktemp("malformed"))


def test_malformed_records_never_stop_diagnose(malformed, capsys):
    code, out, err = diagnose(capsys, malformed, "--format", "json")
    assert code == 0
    # Only what the healthy run shows: a policy_max of 0 did not make every
    # layer "overflow" (MP003), a NaN step did not become a step count.
    assert {(f["run"], f["code"]) for f in json.loads(out)} == {
        (f"{name}/train", "MP011") for name in MALFORMED
    }
    warnings = err.splitlines()
    assert len(warnings) == len(MALFORMED)
    for name, (record, _) in MALFORMED.items():
        (line,) = [w for w in warnings if f"run {name}/train:" in w]
        assert f"{schema.tag_for(record)} at step {BAD_STEP}" in line, line
    code, out, _ = diagnose(capsys, malformed)
    assert code == 0 and out.count("MP011") == len(MALFORMED)


def test_malformed_records_never_stop_summary_or_report(malformed, capsys, tmp_path):
    code, out, _ = summary(capsys, malformed)
    assert code == 0
    assert out.count("policy mixed_float16") == len(MALFORMED)
    assert out.count(f"at step {BAD_STEP}") == len(MALFORMED)
    assert cli.main(["report", str(malformed), "-o", str(tmp_path / "r.html"), "-q"]) == 0
    assert (tmp_path / "r.html").read_text().count("MP011") >= len(MALFORMED)


def test_a_flipped_bit_neither_invents_steps_nor_stops_report(tmp_path, capsys):
    flip_loss_scale_step_bit(event_file(copy_run("storm", tmp_path)))
    code, out, _ = summary(capsys, tmp_path)
    assert code == 0 and "corrupt record at byte" in out
    steps = int(re.search(r"over (\d+) steps", out).group(1))
    assert steps <= 24  # the storm ran 24 steps
    assert cli.main(["report", str(tmp_path), "-o", str(tmp_path / "r.html"), "-q"]) == 0


def test_an_unreadable_directory_is_skipped(tmp_path):
    """As a user without permission on `lost+found` (real permissions: root's
    override is dropped for the child)."""
    copy_run("storm", tmp_path / "storm")
    locked = tmp_path / "lost+found"
    locked.mkdir()
    locked.chmod(0)
    try:
        result = mpprof("summary", tmp_path, privileged=False)
        assert result.returncode == 0, result.stderr
        assert "run storm/train:" in result.stdout
        assert f"{locked}: cannot be listed (Permission denied); skipped" in result.stderr
        result = mpprof("diagnose", tmp_path, "--format", "json", privileged=False)
        assert result.returncode == 0, result.stderr
        assert "MP002" in {f["code"] for f in json.loads(result.stdout)}
    finally:
        locked.chmod(0o755)


def test_an_unreadable_event_file_leaves_nothing_readable(tmp_path):
    (event_file(copy_run("storm", tmp_path / "storm"))).chmod(0)
    copy_run("healthy_mixed", tmp_path / "healthy")
    result = mpprof("diagnose", tmp_path, privileged=False)
    assert result.returncode == cli.EXIT_UNREADABLE
    assert "cannot be read (Permission denied)" in result.stderr
    assert "== run healthy/train" in result.stdout  # the readable run is still judged


def test_symlink_loops_neither_hang_nor_repeat_runs(tmp_path):
    copy_run("storm", tmp_path / "storm")
    (tmp_path / "self").symlink_to(".")
    (tmp_path / "storm" / "up").symlink_to("..")
    result = mpprof("summary", tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("run ") == 1 and "run storm/train:" in result.stdout


def test_a_fifo_named_like_an_event_file_does_not_hang(tmp_path):
    run_dir = copy_run("storm", tmp_path)
    fifo = run_dir / ("events.out.tfevents.9.host" + schema.EVENT_FILE_SUFFIX)
    os.mkfifo(fifo)
    result = mpprof("diagnose", tmp_path, "--format", "json", timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"{fifo}: neither a regular file nor a directory; skipped" in result.stderr
    assert "MP002" in {f["code"] for f in json.loads(result.stdout)}


@pytest.mark.parametrize("output", ["text", "json"])
def test_a_newer_schema_is_one_warning_and_nothing_readable(tmp_path, monkeypatch, capsys,
                                                            output):
    newer_schema_run(tmp_path / "train", monkeypatch, records=200)
    code, out, err = diagnose(capsys, tmp_path, "--format", output, "--fail-on", "warning")
    assert code == cli.EXIT_UNREADABLE
    lines = err.splitlines()
    assert len(lines) == 2, err  # the summarised warning, and "nothing readable"
    assert "upgrade mpprof" in lines[0] and "199 more records" in lines[0]
    assert "run train: nothing readable" in lines[1]
    if output == "json":
        assert json.loads(out) == []
    else:
        assert "No findings" not in out and "nothing readable" in out


def test_a_file_of_zeros_is_nothing_readable(tmp_path, capsys):
    zeros_run(tmp_path / "zeros" / "train")
    copy_run("healthy_mixed", tmp_path / "healthy")
    code, out, err = diagnose(capsys, tmp_path)
    assert code == cli.EXIT_UNREADABLE
    assert "corrupt record at byte 0" in err and "run zeros/train: nothing readable" in err
    healthy, zeros = out.split("\n\n")
    assert "MP011" in healthy and "No findings" not in zeros
    code, out, _ = summary(capsys, tmp_path)
    assert code == cli.EXIT_UNREADABLE and "nothing readable" in out
    report = tmp_path / "report.html"
    code = cli.main(["report", str(tmp_path), "-o", str(report)])
    err = capsys.readouterr().err
    assert code == cli.EXIT_UNREADABLE and "run zeros/train: nothing readable" in err
    assert "Nothing readable" in report.read_text() and "MP011" in report.read_text()


def test_help_documents_the_exit_statuses():
    result = mpprof("diagnose", "--help")
    assert "exit status:" in result.stdout
    assert "3  nothing readable" in result.stdout and "1  diagnose --fail-on" in result.stdout


def test_terminal_escapes_in_names_and_records_are_escaped(tmp_path, capsys):
    name = "\x1b[2J\x1b]0;owned\x07\nrun"
    run_dir = copy_run("healthy_mixed", tmp_path / name)
    context = reader.read_run(tmp_path, f"{name}/train").context
    write_record(run_dir, schema.RUN_CONTEXT, {**context, "optimizer": "Adam\x1b[31m"}, 16)
    write_malformed(run_dir, "health_not_a_dict")  # a warning quoting the path
    escaped = "\\x1b[2J\\x1b]0;owned\\x07\\nrun"
    control = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # all but tab and newline
    code, out, err = summary(capsys, tmp_path)  # its warnings go to stdout
    assert code == 0 and not control.search(out + err)
    assert out.count(escaped) == 2  # the run's line, and the warning's path
    assert "optimizer Adam\\x1b[31m" in out
    code, out, err = diagnose(capsys, tmp_path)
    assert code == 0 and not control.search(out + err)
    assert escaped in out and escaped in err


def test_a_cut_short_run_says_where_it_stopped(tmp_path, capsys):
    run_dir = copy_run("healthy_mixed", tmp_path)
    good = reader.read_run(tmp_path, "train")
    last_step, _ = good.last_record
    write_record(run_dir, schema.RUN_CONTEXT, {**good.context, "fit_state": "running"}, 0)
    # A numerics sample after the last flush: the fit went on past it.
    write_record(run_dir, schema.NUMERICS_STEP, [last_step + 30, 1.0, 2.0**15, 0.0, 1.0],
                 last_step + 30)
    code, out, _ = summary(capsys, tmp_path)
    assert code == 0
    assert f"cut short at step {last_step + 30}" in out
    assert f"read up to step {good.loss_scale.steps_run}; later records reach step " \
           f"{last_step + 30}" in out
    code, out, _ = diagnose(capsys, tmp_path)
    assert code == 0 and f"! cut short at step {last_step + 30}" in out.splitlines()[1]


def test_reading_a_local_logdir_imports_neither_tensorflow_nor_keras(two_runs, tmp_path):
    """diagnose, summary, report and the plugin's routes, in a fresh process."""
    script = f"""
import json, sys
from werkzeug import test
from tensorboard.plugins import base_plugin
from mpprof import cli
from tensorboard_plugin_mpprof import routes
logdir = {str(two_runs)!r}
codes = [cli.main(["diagnose", logdir]), cli.main(["summary", logdir]),
         cli.main(["report", logdir, "-o", {str(tmp_path / "r.html")!r}, "-q"])]
apps = routes.MpprofPlugin(base_plugin.TBContext(logdir=logdir)).get_plugin_apps()
statuses = [test.Client(apps[route]).get(route, query_string={{"run": "storm/train"}}).status_code
            for route in ("/runs", "/findings", "/loss_scale")]
print(json.dumps({{"codes": codes, "statuses": statuses,
                  "loaded": sorted({{"tensorflow", "keras"}} & set(sys.modules))}}))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.splitlines()[-1])
    assert found == {"codes": [0, 0, 0], "statuses": [200, 200, 200], "loaded": []}


def test_report_and_dashboard_say_a_run_was_cut_short(tmp_path):
    from mpprof import report
    from mpprof.display import run_digest

    run_dir = copy_run("healthy_mixed", tmp_path)
    good = reader.read_run(tmp_path, "train")
    last_step, _ = good.last_record
    write_record(run_dir, schema.RUN_CONTEXT, {**good.context, "fit_state": "running"}, 0)
    run = reader.read_run(tmp_path, "train")
    page = report.build_report(tmp_path)
    assert f"<b>Cut short:</b> cut short at step {last_step}: the fit never recorded" in page
    summary_row = run_digest.run_summary(run, diagnosis.evaluate(run))
    assert summary_row["cut_short"]["step"] == last_step
    assert summary_row["fit_state"] == run.fit_outcome == "cut_short"
    # The healthy original says it ended, and neither shows a warning.
    assert good.cut_short is None and "Cut short" not in report.build_report(
        copy_run("healthy_mixed", tmp_path / "ended").parent)


# ---------------------------------------------------------------- summary, options, help


def test_summary_json_lists_each_run_as_recorded(two_runs, capsys):
    code, out, _ = summary(capsys, two_runs, "--format", "json")
    assert code == 0
    rows = json.loads(out)
    assert [row["run"] for row in rows] == ["healthy/train", "storm/train"]
    storm = reader.read_run(two_runs, "storm/train")
    row = rows[1]
    assert row["fit_state"] == "ended" and row["readable"] is True
    assert row["model_policy"] == storm.context.model_policy == "mixed_float16"
    assert row["optimizer"] == storm.context.optimizer
    assert row["loss_scale"]["overflows"] == storm.loss_scale.skipped_steps > 0
    assert row["loss_scale"]["initial"] == storm.loss_scale.initial_scale
    assert row["inventory"]["leaf_layers"] == len(
        [la for la in storm.inventory["layers"] if la.get("is_leaf")])
    assert row["warnings"] == []


def test_summary_run_selects_one_run(two_runs, capsys):
    code, out, _ = summary(capsys, two_runs, "--run", "storm/train")
    assert code == 0
    assert out.startswith("run storm/train:") and "healthy" not in out
    code, out, err = summary(capsys, two_runs, "--run", "nosuch")
    assert code == cli.EXIT_USAGE and "nosuch" in err


@pytest.mark.parametrize("command", ["summary", "diagnose", "report", "replay", "bundle"])
def test_every_command_takes_quiet_verbose_examples_and_says_what_logdir_is(command, capsys):
    parser = cli.build_parser()
    for flag in ("-q", "--quiet", "-v", "--verbose"):
        args = parser.parse_args([command, "logs", flag])
        assert args.verbosity == (-1 if flag.startswith(("-q", "--q")) else 1)
    assert parser.parse_args([command, "logs"]).verbosity == 0
    with pytest.raises(SystemExit):
        parser.parse_args([command, "logs", "-q", "-v"])  # one or the other
    capsys.readouterr()
    with pytest.raises(SystemExit):
        parser.parse_args([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "s3://" in text and "gs://" in text  # a logdir may be a URL
    assert f"examples: mpprof {command} " in text
    if command in ("report", "bundle"):
        default = {"report": "mpprof-report.html", "bundle": "mpprof-bundle.zip"}[command]
        assert f"(default: {default})" in text


def test_verbose_says_what_it_reads_and_quiet_says_nothing(two_runs, capsys, tmp_path):
    code, _, err = diagnose(capsys, two_runs, "-v")
    assert code == 0
    assert "mpprof: reading run storm/train (2/2" in err
    assert "mpprof: diagnosing run storm/train" in err
    code, _, err = diagnose(capsys, two_runs)  # small runs: no progress by default
    assert code == 0 and "reading run" not in err
    output = tmp_path / "r.html"
    assert cli.main(["report", str(two_runs), "-o", str(output), "-q"]) == 0
    assert capsys.readouterr().err == ""
    assert cli.main(["summary", str(two_runs), "-v"]) == 0
    assert "reading run healthy/train (1/2" in capsys.readouterr().err
def test_the_docs_give_the_exit_statuses_of_report_that_it_gives(tmp_path, capsys):
    """docs/cli.md says what `mpprof report` exits with; a run with nothing
    readable writes the file and exits 3, as there."""
    docs = pathlib.Path(__file__).parent.parent / "docs" / "cli.md"
    text = " ".join(docs.read_text().split())
    assert ("`mpprof report` writes the report whatever it could read, then exits 0, 2 as "
            "above, or 3 when a run had nothing readable") in text
    zeros_run(tmp_path / "train")
    report = tmp_path / "report.html"
    assert cli.main(["report", str(tmp_path), "-o", str(report)]) == cli.EXIT_UNREADABLE
    capsys.readouterr()
    assert "Nothing readable" in report.read_text()
