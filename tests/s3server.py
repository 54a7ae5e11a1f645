"""A real S3-protocol server for tests: moto's server on 127.0.0.1, a free port.

Module-scoped in the tests that use it (one server per test module), reset
between tests (``reset()`` empties every bucket) so tests never see each
other's objects. Clients talk real HTTP to it through boto3.
"""

from __future__ import annotations

import logging
import os
import urllib.request

import pytest

BUCKET = "shardckpt-test"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing-key-id",
    "AWS_SECRET_ACCESS_KEY": "testing-secret-key-do-not-log",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class S3Server:
    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.port = port

    def env(self) -> dict[str, str]:
        """Environment for client processes: credentials and the endpoint."""
        env = dict(CREDENTIALS)
        env["AWS_ENDPOINT_URL"] = self.endpoint
        return env

    def client(self, endpoint: str | None = None):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=endpoint or self.endpoint,
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
        )

    def reset(self) -> None:
        req = urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")
        urllib.request.urlopen(req, timeout=30).read()
        self.client().create_bucket(Bucket=BUCKET)

    def keys(self, prefix: str = "") -> dict[str, int]:
        out = {}
        paginator = self.client().get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=BUCKET, Prefix=prefix):
            for obj in page.get("Contents", []):
                out[obj["Key"]] = obj["Size"]
        return out

    def stop(self) -> None:
        self._server.stop()


def apply_env(server: S3Server) -> dict[str, str]:
    """Set the server's credentials/endpoint in os.environ; returns the previous values."""
    previous = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    return previous


def restore_env(previous: dict[str, str | None]) -> None:
    for k, v in previous.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def stop_uploaders(base, grace_s: float = 0.0) -> None:
    """End the uploaders that a test's trainers started under ``base``.

    Each gets ``grace_s`` seconds to exit on its own (idle, no trainer left),
    then SIGTERM and up to 30 s to stop.
    """
    import signal as _signal
    import time as _time
    from pathlib import Path as _Path

    from shardckpt import node_registry as _node_registry

    for status in _Path(base).rglob(f"{_node_registry.STATE_DIR}/status.json"):
        body = _node_registry.read_json(str(status))
        pid, start = body.get("pid"), body.get("pid_start")
        # In-process uploads (push/pull/sync --once from a test) record the test's own pid.
        if not isinstance(pid, int) or pid == os.getpid() or body.get("state") != "running":
            continue
        for wait_s, signum in ((grace_s, None), (30.0, _signal.SIGTERM)):
            if not _node_registry.pid_alive(pid, start):
                break
            if signum is not None:
                os.kill(pid, signum)
            deadline = _time.monotonic() + wait_s
            while _node_registry.pid_alive(pid, start) and _time.monotonic() < deadline:
                _time.sleep(0.1)


@pytest.fixture(scope="module")
def s3():
    """One moto S3 server per test module, with the AWS_* environment pointing at it."""
    server = S3Server()
    previous = apply_env(server)
    try:
        yield server
    finally:
        restore_env(previous)
        server.stop()
