"""Starts local MultiWorkerMirroredStrategy workers on 127.0.0.1 and waits for them.

Each worker is a separate process with its own TF_CONFIG; ports are free
loopback ports (bound to port 0 by the OS, then released). Every worker is
killed when the launch ends, also when it fails or times out.

    python tests/multi_worker_fit.py LOGDIR [WORKERS]

runs `tests/tf_keras_fit.py worker LOGDIR` in WORKERS (default 2) processes
and prints each worker's JSON line, in task order, as one JSON list.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

TESTS = os.path.dirname(os.path.abspath(__file__))
LOOPBACK = "127.0.0.1"


def free_loopback_ports(count: int) -> list[int]:
    """`count` distinct ports that were free on 127.0.0.1 a moment ago."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind((LOOPBACK, 0))
        return [s.getsockname()[1] for s in sockets]


def tf_config(ports: list[int], index: int) -> str:
    return json.dumps({
        "cluster": {"worker": [f"{LOOPBACK}:{port}" for port in ports]},
        "task": {"type": "worker", "index": index},
    })


def run_workers(command: list[str], workers: int = 2, timeout_s: float = 240.0,
                env: dict | None = None) -> list[tuple[int, str, str]]:
    """Runs `command` once per worker; returns (returncode, stdout, stderr) each.

    Workers see no GPU (CUDA_VISIBLE_DEVICES="") unless `env` says otherwise.

    When one worker fails the others are killed (they would wait for it in
    their collectives). Raises TimeoutError, after killing every worker, when
    they do not all finish within `timeout_s`.
    """
    ports = free_loopback_ports(workers)
    processes, outputs = [], []
    with tempfile.TemporaryDirectory(prefix="mpprof_workers_") as scratch:
        try:
            for index in range(workers):
                out = open(os.path.join(scratch, f"{index}.out"), "w+")  # noqa: SIM115
                err = open(os.path.join(scratch, f"{index}.err"), "w+")  # noqa: SIM115
                outputs.append((out, err))
                # CPU workers by default: processes sharing one GPU would
                # each try to take all of its memory. `env` may override.
                worker_env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
                              "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {}),
                              "TF_CONFIG": tf_config(ports, index)}
                processes.append(subprocess.Popen(
                    command, stdout=out, stderr=err, env=worker_env, cwd=TESTS,
                ))
            _wait_for_all(processes, outputs, timeout_s)
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait(timeout=30)
        results = []
        for process, (out, err) in zip(processes, outputs, strict=True):
            out.seek(0)
            err.seek(0)
            results.append((process.returncode, out.read(), err.read()))
            out.close()
            err.close()
        return results


def _wait_for_all(processes, outputs, timeout_s: float) -> None:
    """Waits until every worker exits; one failure ends the wait at once
    (the others would block in their collectives until the timeout)."""
    deadline = time.monotonic() + timeout_s
    while any(process.poll() is None for process in processes):
        if any(process.poll() not in (None, 0) for process in processes):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{len(processes)} workers did not finish within {timeout_s:.0f} s:\n"
                f"{_tails(outputs)}"
            )
        time.sleep(0.2)


def _tails(outputs) -> str:
    tails = []
    for index, (_, err) in enumerate(outputs):
        err.flush()
        err.seek(0)
        tails.append(f"[worker {index}] ...{err.read()[-1500:]}")
    return "\n".join(tails)


def main(logdir: str, workers: int = 2) -> None:
    command = [sys.executable, os.path.join(TESTS, "tf_keras_fit.py"), "worker", logdir]
    results = run_workers(command, workers)
    found = []
    for index, (returncode, out, err) in enumerate(results):
        if returncode != 0:
            raise SystemExit(f"worker {index} failed ({returncode}):\n{err[-3000:]}")
        found.append(json.loads(out.strip().splitlines()[-1])["worker"])
    print(json.dumps(found))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2)
