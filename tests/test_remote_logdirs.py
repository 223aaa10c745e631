"""Logdirs on S3, written and read without TensorFlow's file systems.

Against a real S3 server on 127.0.0.1 (moto's server mode, `s3_server`): a
real fit writes there, `mpprof diagnose s3://...` and the plugin read it, each
flush is one new object (never a rewrite), TensorBoard's own loader reads the
parts, and a writer killed between flushes reads back like a local cut-short
run. Behind a proxy that stops answering (a hung store), a fit's flush waits
no longer than its deadline, the recording stops with one warning and the
fit goes on, and SIGTERM still ends the fit. Nothing prints or logs the
credentials.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import keras
import pytest
from conftest import overflow_data, overflow_model
from s3_server import BUCKET, SECRET_KEY, StallingProxy, s3_endpoint, writes_per_key
from tensorboard.backend import application
from tensorboard.plugins import base_plugin
from werkzeug import test as werkzeug_test

import mpprof
from mpprof import cli
from mpprof.records import filesystem, reader, run_context, schema
from mpprof.records.writer import RecordWriter
from tensorboard_plugin_mpprof.routes import MpprofPlugin

TESTS = os.path.dirname(os.path.abspath(__file__))
MPPROF = os.path.join(os.path.dirname(sys.executable), "mpprof")


@pytest.fixture(scope="module")
def s3():
    with s3_endpoint() as endpoint:
        yield endpoint


def _fit(log_dir: str) -> None:
    keras.utils.set_random_seed(0)
    model = overflow_model(growth_steps=4)
    x, y = overflow_data(96)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False, callbacks=[
        mpprof.MixedPrecisionProfiler(log_dir=log_dir, numerics_every=4, flush_every_steps=5,
                                      gpu_interval=None)])
    keras.mixed_precision.set_dtype_policy("float32")


@pytest.fixture(scope="module")
def fitted(s3, tmp_path_factory):
    """The same fit twice: into a local logdir and into s3://BUCKET/logs."""
    local = str(tmp_path_factory.mktemp("local_logs"))
    _fit(local)
    remote = f"s3://{BUCKET}/logs"
    _fit(remote)
    return local, remote


def _steps(run: reader.Run) -> dict[str, list[int]]:
    return {key: [r.step for r in found] for key, found in run.records.items()}


def test_a_fit_writes_to_s3_and_reads_back_like_the_local_run(fitted):
    local, remote = fitted
    assert reader.list_runs(remote) == reader.list_runs(local) == ["train"]
    here, there = reader.read_run(local, "train"), reader.read_run(remote, "train")
    assert there.warnings == []
    assert _steps(there) == _steps(here)
    assert there.loss_scale.events.tolist() == here.loss_scale.events.tolist()
    assert there.fit_ends[-1]["fit_state"] == run_context.FIT_ENDED and there.cut_short is None


def test_each_flush_is_one_new_object_never_a_rewrite(fitted):
    writes = writes_per_key("logs/train/")
    parts = {key: count for key, count in writes.items() if "tfevents" in key}
    assert len(parts) >= 5  # the start, a flush every 5 of 24 steps, the end
    assert set(parts.values()) == {1}
    assert all(schema.event_file_base(key.rsplit("/", 1)[-1]) for key in parts)
    # The 1 KiB fit-end file: "running" at the start, "ended" at the end.
    (fit_end,) = [key for key in writes if schema.FIT_END_PREFIX in key]
    assert writes[fit_end] == 2


def test_mpprof_diagnose_and_report_read_s3_like_the_local_logdir(fitted, tmp_path):
    local, remote = fitted
    done = subprocess.run([MPPROF, "report", remote, "-q", "-o", str(tmp_path / "r.html")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode in (cli.EXIT_OK, cli.EXIT_FINDINGS), done.stderr
    assert SECRET_KEY not in done.stdout + done.stderr
    assert "MP002" in (tmp_path / "r.html").read_text()
    found = {}
    for logdir in (local, remote):
        done = subprocess.run([MPPROF, "diagnose", logdir, "--format", "json"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode in (cli.EXIT_OK, cli.EXIT_FINDINGS), done.stderr
        assert SECRET_KEY not in done.stdout + done.stderr
        found[logdir] = [(row["code"], row["layer"], row["step"], row["fit_state"])
                         for row in json.loads(done.stdout)]
    assert found[remote] == found[local] and found[local]


def test_the_plugin_serves_an_s3_logdir(fitted):
    local, remote = fitted
    answers = {}
    for logdir in (local, remote):
        plugin = MpprofPlugin(base_plugin.TBContext(logdir=logdir))
        client = werkzeug_test.Client(application.TensorBoardWSGI([plugin]))
        runs = client.get("/data/plugin/mpprof/runs")
        assert runs.status_code == 200
        findings = client.get("/data/plugin/mpprof/findings", query_string={"run": "train"})
        assert findings.status_code == 200
        listing = json.loads(client.get("/data/plugins_listing").get_data())
        answers[logdir] = ([r["run"] for r in json.loads(runs.get_data())["runs"]],
                           [f["code"] for f in json.loads(findings.get_data())["findings"]])
        if logdir == remote:
            # No data provider here reads s3:// (TensorBoard's own may not
            # either): the tab shows from the plugin's own listing.
            assert listing["mpprof"]["enabled"] is True
    assert answers[remote] == answers[local] and answers[local][0] == ["train"]


def test_tensorboards_own_loader_reads_every_part(fitted, tmp_path):
    """TensorBoard reads each name holding "tfevents", in name order: the parts
    are successive complete event files to it, none skipped or repeated."""
    import s3fs
    from tensorboard.backend.event_processing import plugin_event_accumulator as accumulator

    _, remote = fitted
    s3fs.S3FileSystem().get(f"{BUCKET}/logs/train/", str(tmp_path / "train"), recursive=True)
    loaded = accumulator.EventAccumulator(str(tmp_path / "train"),
                                          size_guidance={accumulator.TENSORS: 0})
    loaded.Reload()
    run = reader.read_run(remote, "train")
    for key, records in run.records.items():
        record, _, series = key.partition(schema.SERIES_SEPARATOR)
        tag = schema.tag_for(record, series or None)
        assert [e.step for e in loaded.Tensors(tag)] == [r.step for r in records], tag
    assert loaded.PluginTagToContent(schema.PLUGIN_NAME)


def test_a_writer_killed_between_flushes_reads_like_a_local_cut_short_run(s3, tmp_path):
    """hard_stop_fit.py (every step an overflow, a flush every second), killed
    with SIGKILL: every step more than a flush interval old is on S3, and the
    run says it never ended, as the local test_sigkill_... checks on disk."""
    from hard_stop_fit import FLUSH_EVERY_SECONDS

    progress = tmp_path / "progress.txt"
    logdir = f"s3://{BUCKET}/killed"
    process = subprocess.Popen(
        [sys.executable, os.path.join(TESTS, "hard_stop_fit.py"), logdir, str(progress)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (progress.exists() and len(progress.read_text().splitlines()) >= 30):
            assert process.poll() is None, process.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the fit did not reach 30 steps"
            time.sleep(0.1)
        time.sleep(3 * FLUSH_EVERY_SECONDS)
        killed_at = time.time()
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
    must_have = 0
    for line in progress.read_text().splitlines():
        done, when = line.split()
        if float(when) <= killed_at - FLUSH_EVERY_SECONDS - 0.5:
            must_have = int(done)
    assert must_have >= 30
    run = reader.read_run(logdir, "train")
    assert run.warnings == []
    assert set(range(must_have)) <= set(run.loss_scale.overflow_steps.astype(int).tolist())
    assert run.cut_short is not None and run.cut_short["fit_state"] == run_context.FIT_RUNNING
    done = subprocess.run([MPPROF, "diagnose", logdir, "--format", "json-runs"],
                          capture_output=True, text=True, timeout=120)
    (listed,) = json.loads(done.stdout)["runs"]
    assert listed["fit_state"] == "cut_short" and listed["cut_short"] == run.cut_short


def test_a_missing_bucket_is_one_line_without_secrets(s3, capsys, caplog):
    code = cli.main(["diagnose", "s3://no-such-bucket-mpprof/logs"])
    out, err = capsys.readouterr()
    assert code == cli.EXIT_USAGE
    assert err.count("\n") == 1 and "s3://no-such-bucket-mpprof/logs" in err
    assert SECRET_KEY not in out + err + caplog.text


def test_a_password_in_a_url_is_never_shown(capsys):
    code = cli.main(["diagnose", "ftp://user:hunter2@127.0.0.1:9/logs"])
    out, err = capsys.readouterr()
    assert code == cli.EXIT_USAGE and err.count("\n") == 1
    assert "hunter2" not in out + err and "user:***@" in err


def test_a_scheme_without_its_package_names_the_extra(monkeypatch, capsys):
    import importlib

    registry = importlib.import_module("fsspec.registry")  # the module, not its mapping
    monkeypatch.setitem(registry.known_implementations, "gs", {
        "class": "mpprof_no_such_module.GCSFileSystem", "err": "Install gcsfs to access GCS"})
    monkeypatch.delitem(registry._registry, "gs", raising=False)
    code = cli.main(["diagnose", "gs://bucket/logs"])
    _, err = capsys.readouterr()
    assert code == cli.EXIT_USAGE and err.count("\n") == 1
    assert 'pip install "mpprof[gcs]"' in err


def _start_stalling_fit(s3: str, proxy: StallingProxy, tmp_path, deadline_s: float,
                        steps: int) -> subprocess.Popen:
    """hard_stop_fit.py writing through `proxy`, held after its 30th step
    until the test has stalled the proxy (then writes `go`)."""
    env = {**os.environ, "AWS_ENDPOINT_URL": proxy.endpoint,
           filesystem.DEADLINE_VARIABLE: str(deadline_s)}
    return subprocess.Popen(
        [sys.executable, os.path.join(TESTS, "hard_stop_fit.py"), f"s3://{BUCKET}/stalled",
         str(tmp_path / "progress.txt"), "--steps", str(steps),
         "--hold-at", "30", str(tmp_path / "go")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stall_at_the_hold(process: subprocess.Popen, proxy: StallingProxy, tmp_path) -> None:
    from hard_stop_fit import FLUSH_EVERY_SECONDS

    progress = tmp_path / "progress.txt"
    deadline = time.monotonic() + 120
    while not (progress.exists() and len(progress.read_text().splitlines()) >= 30):
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "the fit did not reach 30 steps"
        time.sleep(0.1)
    proxy.stall()
    time.sleep(FLUSH_EVERY_SECONDS + 0.2)  # the next step's flush is due
    (tmp_path / "go").write_text("")


def _step_times(tmp_path) -> list[float]:
    return [float(line.split()[1])
            for line in (tmp_path / "progress.txt").read_text().splitlines()]


def test_a_hung_store_stalls_a_flush_for_its_deadline_then_the_fit_goes_on(s3, tmp_path):
    """The store accepts connections and never answers: the fit's next flush
    gives up after its deadline (3 s here), one warning says the recording
    stopped, the fit runs to its end, and closing costs no second wait."""
    deadline_s = 3.0
    with StallingProxy(int(s3.rsplit(":", 1)[1])) as proxy:
        process = _start_stalling_fit(s3, proxy, tmp_path, deadline_s, steps=300)
        try:
            _stall_at_the_hold(process, proxy, tmp_path)
            released = time.time()
            _, stderr = process.communicate(timeout=120)
            exited = time.time()
        finally:
            process.kill()
            process.wait(timeout=60)
    assert process.returncode == 0, stderr[-3000:]
    assert stderr.count("mpprof: stopped writing its records") == 1, stderr[-3000:]
    assert "did not answer within 3 s" in stderr
    times = _step_times(tmp_path)
    assert len(times) == 300  # every step ran
    after = [t for t in times[30:]]
    stall = max(b - a for a, b in zip([released, *after], [*after, exited], strict=True))
    # One deadline, not one per write (the close and the fit-end file skip
    # the store that did not answer); the bound leaves room for a loaded
    # machine, far below the minutes botocore alone would wait.
    assert deadline_s <= stall < 4 * deadline_s + 10, stall
    run = reader.read_run(f"s3://{BUCKET}/stalled", "train")
    assert run.cut_short is not None  # its end could not be written


def test_sigterm_ends_a_fit_whose_flush_waits_on_a_hung_store(s3, tmp_path):
    """With a deadline far away (600 s), SIGTERM during the hung flush still
    ends the process at once with the signal, as it would without mpprof."""
    with StallingProxy(int(s3.rsplit(":", 1)[1])) as proxy:
        process = _start_stalling_fit(s3, proxy, tmp_path, 600.0, steps=100_000)
        try:
            _stall_at_the_hold(process, proxy, tmp_path)
            time.sleep(2.0)
            before = len(_step_times(tmp_path))
            time.sleep(1.0)
            assert len(_step_times(tmp_path)) == before, "the fit is not held by its flush"
            sent = time.monotonic()
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)
            waited = time.monotonic() - sent
        finally:
            process.kill()
            process.wait(timeout=60)
    assert process.returncode == -signal.SIGTERM
    assert waited < 10, waited


def test_a_fit_into_a_missing_bucket_fails_at_the_start_and_creates_none(s3):
    import boto3

    model = overflow_model(growth_steps=4)
    x, y = overflow_data(16)
    profiler = mpprof.MixedPrecisionProfiler(log_dir="s3://no-such-bucket-mpprof/logs",
                                             gpu_interval=None)
    with pytest.raises(OSError) as raised:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[profiler])
    keras.mixed_precision.set_dtype_policy("float32")
    message = str(raised.value)
    assert "\n" not in message and SECRET_KEY not in message
    assert "the bucket 'no-such-bucket-mpprof' does not exist" in message
    assert "s3://no-such-bucket-mpprof/logs/train" in message
    buckets = [b["Name"] for b in boto3.client("s3").list_buckets()["Buckets"]]
    assert buckets == [BUCKET]


def test_tensorboard_without_tensorflow_serves_the_tab_over_s3(fitted):
    """The documented way to the tab over s3:// (docs/dashboard.md): where
    TensorFlow cannot be imported, TensorBoard reads through its own stub's
    file systems (boto3 for s3://, fsspec for others), and serves the mpprof
    tab, with the same findings as the local logdir."""
    import re
    import urllib.request

    local, remote = fitted
    launcher = ("import sys; sys.modules['tensorflow'] = None; "  # as if not installed
                "from tensorboard.main import run_main; run_main()")
    process = subprocess.Popen(
        [sys.executable, "-c", launcher, "--logdir", remote, "--port", "0",
         "--host", "127.0.0.1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        url, seen = None, []
        while url is None:
            assert time.monotonic() < deadline and process.poll() is None, "".join(seen[-20:])
            seen.append(process.stderr.readline())
            found = re.search(r"(http://127\.0\.0\.1:\d+/)", seen[-1])
            url = found and found.group(1)

        def get(route: str):
            with urllib.request.urlopen(url + route, timeout=60) as response:
                return json.loads(response.read())

        assert get("data/plugins_listing")["mpprof"]["enabled"] is True
        assert get("data/runs") == ["train"]  # TensorBoard's own reading of s3://
        assert [r["run"] for r in get("data/plugin/mpprof/runs")["runs"]] == ["train"]
        codes = [f["code"] for f in get("data/plugin/mpprof/findings?run=train")["findings"]]
    finally:
        process.terminate()
        process.wait(timeout=30)
    plugin = MpprofPlugin(base_plugin.TBContext(logdir=local))
    client = werkzeug_test.Client(application.TensorBoardWSGI([plugin]))
    local_codes = [f["code"] for f in json.loads(client.get(
        "/data/plugin/mpprof/findings", query_string={"run": "train"}).get_data())["findings"]]
    assert codes == local_codes and "MP002" in codes


def test_s3_requests_get_timeouts_and_bounded_retries_under_the_users_settings(s3,
                                                                              monkeypatch):
    """botocore's defaults let one hung request wait minutes: mpprof gives
    S3 its connect/read timeouts and 3 attempts, and a user's own fsspec
    configuration of them wins."""
    import fsspec.config

    fs, _ = filesystem._remote("s3://bucket/logs")
    fs.call_s3("list_buckets")  # botocore takes the settings (and rewrites its copy)
    config = fs._prepare_config_kwargs() | fs.config_kwargs
    assert (config["connect_timeout"], config["read_timeout"]) == (5, 10)
    assert config["retries"] == {"total_max_attempts": 3, "mode": "standard"}
    assert fs.s3.meta.config.retries == {"total_max_attempts": 3, "mode": "standard"}
    assert filesystem._options("s3")["config_kwargs"]["retries"] == config["retries"]
    monkeypatch.setitem(fsspec.config.conf, "s3", {"config_kwargs": {"read_timeout": 60}})
    fs, _ = filesystem._remote("s3://bucket/logs")
    assert fs.config_kwargs["read_timeout"] == 60 and fs.config_kwargs["connect_timeout"] == 5
    assert "memory" in filesystem._remote("memory://logs")[0].protocol  # no S3 options


def test_a_fit_on_s3_writes_its_digest_and_a_later_writer_voids_it(fitted):
    """The digest (`run_digest`) on an object store: the fit's row is trusted
    while the run's parts are those it listed; another writer's part, and
    the run is read again."""
    from mpprof.display import run_digest

    local, remote = fitted
    rows = {logdir: run_digest.load_many({"train": tuple(reader.run_file_states(logdir, "train"))})
            for logdir in (local, remote)}
    assert rows[remote]["train"] == rows[local]["train"]
    assert rows[remote]["train"]["findings"] == rows[local]["train"]["findings"]
    # A copy of the run under another prefix, then a second writer into it.
    copy = f"s3://{BUCKET}/digest_copy/train"
    for path, _, _ in reader.run_file_states(remote, "train"):
        filesystem.write_bytes(f"{copy}/{path.rsplit('/', 1)[-1]}",
                               filesystem.open_file(path).read())
    assert run_digest.write(copy) is True
    copied = f"s3://{BUCKET}/digest_copy"
    assert run_digest.load_many({"train": tuple(reader.run_file_states(copied, "train"))})
    writer = RecordWriter(copy)
    writer.close()
    assert run_digest.load_many({"train": tuple(reader.run_file_states(copied, "train"))}) == {}
