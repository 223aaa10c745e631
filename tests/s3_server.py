"""A real S3 server on 127.0.0.1 for the remote-logdir tests (moto's server mode).

`s3_endpoint()` starts moto's threaded server on a free port, points botocore
and s3fs at it the way a user would (`AWS_ENDPOINT_URL`) with dummy
credentials, and creates a versioned bucket: the versions of each key say how
often it was written.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator

BUCKET = "mpprof-test"
# Dummy credentials; the secret is distinctive so a test can look for it in
# everything mpprof prints and logs.
ACCESS_KEY = "AKIAMPPROFTESTKEY"
SECRET_KEY = "mpprof-test-SECRET-must-never-be-shown"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def s3_endpoint() -> Iterator[str]:
    """Yields the endpoint URL of a running S3 server with `BUCKET` in it;
    the environment (inherited by subprocesses) points at it meanwhile."""
    import boto3
    import s3fs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    settings = {
        "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1",
    }
    cleared = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3")
    saved = {key: os.environ.get(key) for key in (*settings, *cleared)}
    os.environ.update(settings)
    for key in cleared:
        os.environ.pop(key, None)
    # s3fs keeps one file system per set of options: none from another server.
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        client = boto3.client("s3")
        client.create_bucket(Bucket=BUCKET)
        client.put_bucket_versioning(Bucket=BUCKET,
                                     VersioningConfiguration={"Status": "Enabled"})
        yield endpoint
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()


def writes_per_key(prefix: str) -> dict[str, int]:
    """How many times each key under `prefix` of `BUCKET` was written."""
    import boto3

    counts: dict[str, int] = {}
    paginator = boto3.client("s3").get_paginator("list_object_versions")
    for page in paginator.paginate(Bucket=BUCKET, Prefix=prefix):
        for version in page.get("Versions", []):
            counts[version["Key"]] = counts.get(version["Key"], 0) + 1
    return counts


class StallingProxy:
    """A TCP proxy on 127.0.0.1 in front of `target_port` that can stop
    answering: after `stall()` it still accepts connections and reads what
    it is sent, but passes nothing on either way (a hung store); after
    `refuse()` it closes every connection and refuses new ones (a store
    that is down). A context manager; `endpoint` is its URL.
    """

    def __init__(self, target_port: int):
        import threading

        self._target = target_port
        self._stalled = threading.Event()
        self._closed = threading.Event()
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.2)
        self.endpoint = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def stall(self) -> None:
        self._stalled.set()

    def refuse(self) -> None:
        self._closed.set()
        self._server.close()

    def _accept(self) -> None:
        import threading

        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(client,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _serve(self, client: socket.socket) -> None:
        import selectors

        upstream = None
        if not self._stalled.is_set():
            upstream = socket.create_connection(("127.0.0.1", self._target))
        peers = {client: upstream, upstream: client} if upstream else {}
        with selectors.DefaultSelector() as selector:
            for sock in (client, upstream):
                if sock is not None:
                    selector.register(sock, selectors.EVENT_READ)
            try:
                while not self._closed.is_set():
                    for key, _ in selector.select(0.2):
                        data = key.fileobj.recv(65536)
                        if not data:
                            return
                        if not self._stalled.is_set() and peers:
                            peers[key.fileobj].sendall(data)
            except OSError:
                return
            finally:
                for sock in (client, upstream):
                    if sock is not None:
                        sock.close()

    def __enter__(self) -> StallingProxy:
        return self

    def __exit__(self, *exc) -> None:
        self._closed.set()
        self._server.close()
        for thread in self._threads:
            thread.join(timeout=5)
