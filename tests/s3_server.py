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
