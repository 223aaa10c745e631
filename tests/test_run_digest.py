"""A fit's digest of its run (`mpprof.display.run_digest`): the run list's
row written at the fit's end, so that the tab's first `/runs` of a sweep
reads no records; trusted only while the run's files are those it was
computed from, by the same code, whole. A digest can make a read cheaper,
never different."""

from __future__ import annotations

import json
import os
import shutil

import diagnosis_runs
import google_crc32c
import pytest
from tensorboard.plugins import base_plugin
from werkzeug import test as werkzeug_test

from mpprof import diagnosis
from mpprof.display import run_digest
from mpprof.records import reader, schema
from mpprof.records.writer import RecordWriter
from tensorboard_plugin_mpprof import routes

RUNS = {"storm": "storm", "healthy": "healthy_float32"}


@pytest.fixture
def logdir(tmp_path, monkeypatch):
    """Two real fits' logdirs, copied with their mtimes (as `cp -p` would)."""
    monkeypatch.setenv("MPPROF_SUMMARY_CACHE", "off")
    root = tmp_path / "logs"
    for name, fixture in RUNS.items():
        shutil.copytree(diagnosis_runs.logdir(fixture), root / name)
    return root


def runs_of(logdir) -> dict[str, dict]:
    """/runs of a new plugin on `logdir` (a TensorBoard just started), by run."""
    plugin = routes.MpprofPlugin(base_plugin.TBContext(logdir=str(logdir)))
    response = werkzeug_test.Client(plugin.get_plugin_apps()["/runs"]).get("/runs")
    assert response.status_code == 200
    return {row["run"]: row for row in json.loads(response.get_data())["runs"]}


def read_row(logdir, run: str) -> dict:
    """The row computed from the files, as without any digest."""
    found = reader.read_run(logdir, run)
    return run_digest.run_summary(found, diagnosis.evaluate(found))


def loaded(logdir, run: str = "storm/train") -> dict:
    return run_digest.load_many({run: tuple(reader.run_file_states(logdir, run))})


def test_a_fit_writes_the_run_lists_row_and_the_first_runs_reads_no_run(logdir, reads):
    for name in RUNS:
        assert (logdir / name / "train" / run_digest.NAME).is_file()
    rows = runs_of(logdir)
    assert reads == []
    for run in ("storm/train", "healthy/train"):
        assert rows[run] == read_row(logdir, run)
    # The storm run's row is not an empty one: its findings are counted.
    assert rows["storm/train"]["findings"]["critical"] + \
        rows["storm/train"]["findings"]["warning"] > 0


def test_a_record_added_after_the_digest_is_read(logdir, reads):
    """Another fit (a writer) into the run's directory: the digest no longer
    describes the files, so the run is read and the row says what changed."""
    before = runs_of(logdir)["storm/train"]
    context = reader.read_run(logdir, "storm/train").context.record
    writer = RecordWriter(logdir / "storm" / "train")
    writer.write_json(schema.RUN_CONTEXT, {**context, "fit_state": "running"}, 10_000)
    writer.close()
    assert loaded(logdir) == {}
    reads.clear()
    after = runs_of(logdir)["storm/train"]
    assert reads == ["storm/train"]
    assert after == read_row(logdir, "storm/train") != before


def test_bytes_appended_to_an_event_file_void_the_digest(logdir, reads):
    (event_file,) = (logdir / "storm" / "train").glob("*tfevents*")
    with open(event_file, "ab") as f:
        f.write(b"\x00" * 40)  # damage: a record cut short
    row = runs_of(logdir)["storm/train"]
    assert reads == ["storm/train"]
    assert row["warnings"] > 0 and row == read_row(logdir, "storm/train")


def test_a_file_rewritten_in_place_at_the_same_size_voids_the_digest(logdir):
    (event_file,) = (logdir / "storm" / "train").glob("*tfevents*")
    assert loaded(logdir)
    stat = event_file.stat()
    os.utime(event_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert loaded(logdir) == {}


def _rewrite(logdir, change) -> None:
    """Replaces the storm run's digest by `change(document)`'s bytes."""
    path = logdir / "storm" / "train" / run_digest.NAME
    path.write_bytes(change(json.loads(path.read_bytes())))


def _signed(body: dict) -> bytes:
    text = json.dumps(body)
    return json.dumps({"crc32c": google_crc32c.value(text.encode()), "body": text}).encode()


@pytest.mark.parametrize("change", [
    # A byte of the body changed (its findings said to be none): the checksum.
    lambda d: json.dumps({**d, "body": d["body"].replace('"critical": ', '"critical": 0')})
    .encode(),
    lambda d: json.dumps(d).encode()[:-20],  # cut short
    lambda d: b"\xff" * 10,  # not JSON
    lambda d: json.dumps({**d, "pad": "x" * run_digest.MAX_BYTES}).encode(),  # too large
    # Checksummed, but by another mpprof (or an edited one).
    lambda d: _signed({**json.loads(d["body"]), "code": "another"}),
    # Checksummed, but of other files (a digest copied from another run).
    lambda d: _signed({**json.loads(d["body"]), "files": [["x.mpprof.v2", 1, 1]]}),
    lambda d: _signed({**json.loads(d["body"]), "summary": ["not", "a", "row"]}),
], ids=["checksum", "cut-short", "not-json", "too-large", "other-code", "other-files",
        "bad-row"])
def test_a_digest_that_is_not_whole_or_not_this_codes_is_ignored(logdir, reads, change):
    _rewrite(logdir, change)
    assert loaded(logdir) == {}
    rows = runs_of(logdir)
    assert reads == ["storm/train"]
    assert rows["storm/train"] == read_row(logdir, "storm/train")


def test_no_digest_where_the_files_are_too_large(logdir, monkeypatch):
    run_dir = logdir / "storm" / "train"
    (run_dir / run_digest.NAME).unlink()
    monkeypatch.setattr(run_digest, "MAX_READ_BYTES", 10)
    assert run_digest.write(str(run_dir)) is False
    assert not (run_dir / run_digest.NAME).exists()
    monkeypatch.undo()
    assert run_digest.write(str(run_dir)) is True
    assert loaded(logdir)["storm/train"] == read_row(logdir, "storm/train")


@pytest.mark.parametrize("form", ["json", "json-runs"])
def test_diagnose_json_over_a_sweep_reads_no_digested_run_and_says_the_same(
        logdir, reads, tmp_path, capsys, form):
    from mpprof import cli

    shutil.copytree(logdir, tmp_path / "without", copy_function=shutil.copy2)
    for digest in (tmp_path / "without").rglob(run_digest.NAME):
        digest.unlink()
    # A run without a digest beside them is read (an older mpprof's, a fit
    # still running).
    (logdir / "healthy" / "train" / run_digest.NAME).unlink()
    outputs = []
    for root in (logdir, tmp_path / "without"):
        reads.clear()
        code = cli.main(["diagnose", str(root), "--format", form, "--fail-on", "warning"])
        outputs.append((code, capsys.readouterr().out, list(reads)))
    (code, out, read), (code_without, out_without, read_without) = outputs
    assert read == ["healthy/train"]
    assert read_without == ["healthy/train", "storm/train"]
    import difflib
    assert (code, out) == (code_without, out_without), "\n".join(difflib.unified_diff(
        out.splitlines(), out_without.splitlines(), lineterm=""))
    assert code == cli.EXIT_FINDINGS and "storm/train" in out
    # The text reads every run: it is not a sweep's format.
    reads.clear()
    cli.main(["diagnose", str(logdir)])
    assert reads == ["healthy/train", "storm/train"]


def test_a_fifo_named_as_the_digest_holds_up_neither_the_reader_nor_the_fit(logdir):
    path = logdir / "storm" / "train" / run_digest.NAME
    path.unlink()
    os.mkfifo(path)
    assert loaded(logdir) == {}  # refused, not waited on
    assert run_digest.write(str(path.parent)) is True  # renamed over it
    assert path.is_file() and loaded(logdir)["storm/train"] == read_row(logdir, "storm/train")
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []
