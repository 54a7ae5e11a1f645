"""Remote tier under storage faults, against real servers over HTTP on 127.0.0.1.

A missing bucket, credentials the server rejects (a moto server in IAM
authentication mode, its own process; rclone's server reached with a wrong
secret key) and an endpoint nobody listens on:
each must end in a clear error within a bounded time, never a hang and never
a half-committed remote step, with the local steps intact. Throttling, 5xx,
resets and stalls on the restore path must be retried to success. The
crash-consistency soak of the remote tier (trainer and uploader SIGKILLed at
random moments and at named kill points) runs CI-sized on a ``file://``
remote, every uploader kill point, and for a few trials against the S3
server over HTTP (the 50-trial S3 soak is a benchmark: see the README).

Bounded time is asserted by running each call in a thread that must finish
within a generous limit; nothing here measures speed.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from faultproxy import FaultProxy  # noqa: E402
from helpers import ROOT, free_port  # noqa: E402
from s3server import BUCKET, CREDENTIALS, Server, reset_if_used, stop_uploaders  # noqa: E402

import shardckpt  # noqa: E402
from shardckpt.errors import RemoteError  # noqa: E402
from shardckpt.format import layout
from shardckpt.node import node_registry
from shardckpt.remote import commit as remote_commit  # noqa: E402

BOUND_S = 120.0  # generous: a hang, not slowness, is what fails these tests

# Small limits so that every failure path ends quickly.
FAST = dict(
    request_timeout_s=2.0,
    remote_max_attempts=2,
    backoff_max_s=0.2,
    step_deadline_s=10.0,
    drain_timeout_s=6.0,
    preemption_signals=(),
)


def bounded(fn, limit: float = BOUND_S):
    """Run ``fn`` in a thread; fail if it has not returned within ``limit`` seconds."""
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        raise AssertionError(f"call did not return within {limit:.0f} s (a hang)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


# ---------------------------------------------------------------- servers


class AuthServer:
    """moto's server in its own process with IAM authentication on.

    ``INITIAL_NO_AUTH_ACTION_COUNT=1``: the first request (creating the
    bucket) is let through, every later one must be signed by a known IAM
    access key; the test credentials are unknown to it, so S3 answers
    403 InvalidAccessKeyId, as a real store does for wrong credentials.
    """

    code = "InvalidAccessKeyId"
    env: dict[str, str] = {}  # the test credentials, as they are: unknown to it

    CODE = (
        "import logging, sys\n"
        "from moto.server import ThreadedMotoServer\n"
        "logging.getLogger('werkzeug').setLevel(logging.ERROR)\n"
        "s = ThreadedMotoServer(ip_address='127.0.0.1', port=0, verbose=False)\n"
        "s.start()\n"
        "print(s.get_host_and_port()[1], flush=True)\n"
        "sys.stdin.read()\n"
    )

    def __init__(self) -> None:
        env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", self.CODE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self.endpoint = f"http://127.0.0.1:{int(self.proc.stdout.readline())}"
        self.client().create_bucket(Bucket=BUCKET)  # the one unauthenticated action

    def client(self):
        import boto3

        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        )

    def keys(self) -> list[str]:
        """Every object the server ever stored in the bucket, read from moto's own state.

        ``/moto-api/data.json`` needs no signature, so no unauthenticated
        S3 request is let through: a still-retrying uploader cannot take one
        (listing under a short-lived auth opening raced with it).
        """
        with urllib.request.urlopen(f"{self.endpoint}/moto-api/data.json", timeout=30) as answer:
            state = json.loads(answer.read())
        return sorted({o["name"] for o in state.get("s3", {}).get("FakeKey", []) if o.get("bucket_name") == BUCKET})

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


class WrongSecret:
    """The module's rclone server, reached with its access key id and a wrong secret key.

    rclone checks the SigV4 signature of every request against its
    ``--auth-key`` pairs: 403 SignatureDoesNotMatch (InvalidAccessKeyId for
    an unknown key id; a bare 403 for HEAD, which has no body).
    """

    code = "SignatureDoesNotMatch"

    def __init__(self, server: Server) -> None:
        self.server = server
        self.endpoint = server.endpoint
        self.env = {"AWS_SECRET_ACCESS_KEY": "wrong-" + secrets.token_urlsafe(16)}

    def keys(self) -> list[str]:
        """List the bucket with the server's own credentials."""
        return list(self.server.keys())

    def stop(self) -> None:
        pass


@pytest.fixture
def auth_server(s3, monkeypatch):
    """A server that rejects the credentials in the environment (set here; the uploader inherits them)."""
    server = AuthServer() if s3.kind == "moto" else WrongSecret(s3)
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def fresh_bucket(request, tmp_path):
    reset_if_used(request)
    yield
    stop_uploaders(tmp_path, grace_s=0.0)


# ---------------------------------------------------------------- helpers


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(32, 32)


def _save_two_steps(local_dir: Path, url: str, endpoint: str) -> dict:
    """A trainer told to go on without its broken remote saves steps 1 and 2, then closes."""
    model = _model()
    ckpt = shardckpt.Checkpointer(local_dir=str(local_dir), remote=url, endpoint_url=endpoint, keep_last=1,
                                  on_remote_unavailable="warn", **FAST)
    saved = {}
    for step in (1, 2):
        with torch.no_grad():
            model.weight.add_(1.0)
        ckpt.save({"model": model}, step).wait()
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    # Give the uploader a chance to fail at least once before close() drains.
    status_file = local_dir / node_registry.STATE_DIR / "status.json"
    end = time.monotonic() + 60
    while time.monotonic() < end and not node_registry.read_json(str(status_file)).get("last_error"):
        time.sleep(0.1)
    ckpt.close()
    return {"saved": saved, "status": ckpt.status()}


SCENARIOS = ("missing_bucket", "wrong_credentials", "unreachable_endpoint")


def _scenario(name: str, s3: Server, request) -> tuple[str, str, str, object]:
    """(remote URL, endpoint, what the error must name, server or None)."""
    if name == "missing_bucket":
        return "s3://no-such-bucket-xyz/run", s3.endpoint, "no-such-bucket-xyz", None
    if name == "wrong_credentials":
        server = request.getfixturevalue("auth_server")
        return f"s3://{BUCKET}/run", server.endpoint, BUCKET, server
    port = free_port()  # nothing listens there: connection refused
    return f"s3://{BUCKET}/run", f"http://127.0.0.1:{port}", f"127.0.0.1:{port}", None


def _secrets(s3: Server) -> set[str]:
    """The server's keys and those in the environment now (a rejected pair, in wrong_credentials)."""
    names = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    return {s3.credentials[n] for n in names} | {os.environ[n] for n in names if os.environ.get(n)}


def _check_message(text: str, must_name: str, s3: Server) -> None:
    assert text, "no error reported"
    assert must_name in text, text
    assert "Remedy" in text, text
    for secret in _secrets(s3):
        assert secret not in text, "a credential leaked into an error message"


# ---------------------------------------------------------------- broken remotes


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s != "unreachable_endpoint"])
def test_broken_remote_save_close_and_load_end_in_bounded_clear_errors(scenario, s3, tmp_path, request, caplog):
    check_broken_remote(scenario, s3, tmp_path, request, caplog)


# moto only: nothing answers at the endpoint, whatever the server.
@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_unreachable_remote_save_close_and_load_end_in_bounded_clear_errors(s3, tmp_path, request, caplog):
    check_broken_remote("unreachable_endpoint", s3, tmp_path, request, caplog)


def check_broken_remote(scenario: str, s3: Server, tmp_path: Path, request, caplog) -> None:
    url, endpoint, must_name, server = _scenario(scenario, s3, request)
    local_dir = tmp_path / "node0"

    # (0) by default the first save finds out: RemoteError with the remedy, on every rank, nothing saved.
    strict = shardckpt.Checkpointer(local_dir=str(tmp_path / "strict"), remote=url, endpoint_url=endpoint, **FAST)
    with pytest.raises(RemoteError) as info:
        bounded(lambda: strict.save({"model": _model()}, 1))
    _check_message(str(info.value), must_name, s3)
    assert "Nothing was saved" in str(info.value) and "on_remote_unavailable='warn'" in str(info.value)
    assert strict.steps() == []
    strict.close()
    if server is not None:
        assert server.keys() == [], "something reached the bucket"

    # (a) told to go on: save + close return; the upload error is reported; nothing committed remotely.
    result = bounded(lambda: _save_two_steps(local_dir, url, endpoint))
    status = result["status"]
    _check_message(status["last_upload_error"], must_name, s3)
    if scenario == "missing_bucket":
        assert "NoSuchBucket" in status["last_upload_error"] and "create the bucket" in status["last_upload_error"]
    if scenario == "wrong_credentials":
        assert f"403 {server.code}" in status["last_upload_error"], status["last_upload_error"]
        assert "rejected the credentials" in status["last_upload_error"]
    if scenario == "unreachable_endpoint":
        assert "nothing answers at the endpoint" in status["last_upload_error"], status["last_upload_error"]
    drain = status["drain"]
    assert drain["pending_steps"] == [1, 2], drain  # local retention kept the un-uploaded step 1
    if scenario != "unreachable_endpoint":
        # A refusal that retries cannot fix ends close()'s wait early (no need to sit out drain_timeout_s).
        assert drain["ended"] == "permanent upload error", drain
    else:
        assert drain["ended"] == "drain_timeout_s", drain  # connection errors may pass: waited in full
    _check_message(drain["last_error"], must_name, s3)
    assert status["latest_remote"] is None
    assert status["pending_upload_steps"] == [1, 2]
    for step in (1, 2):
        assert not remote_commit.is_uploaded(str(local_dir / layout.step_dirname(step)), url)
    if scenario == "missing_bucket":
        assert "no-such-bucket-xyz" not in [b["Name"] for b in s3.client().list_buckets()["Buckets"]]
    if server is not None:
        assert server.keys() == [], "something reached the bucket"

    # Local steps are intact and load bitwise (local tier only).
    local_only = shardckpt.Checkpointer(local_dir=str(local_dir), preemption_signals=())
    for step in (1, 2):
        model = _model(seed=99)
        assert local_only.load({"model": model}, step=step) == step
        for k, v in result["saved"][step].items():
            assert torch.equal(model.state_dict()[k], v), (step, k)
    local_only.close()

    # (b) a fresh instance with only the remote: RemoteError, bounded, clear.
    fresh = shardckpt.Checkpointer(
        local_dir=str(tmp_path / "fresh"), remote=url, endpoint_url=endpoint, uploader="off", **FAST
    )
    with pytest.raises(RemoteError) as info:
        bounded(lambda: fresh.load({"model": _model(seed=7)}))
    _check_message(str(info.value), must_name, s3)
    assert "nothing was loaded" in str(info.value)
    fresh.close()

    # ... while a node that still has local steps resumes from them, with a warning.
    node = shardckpt.Checkpointer(local_dir=str(local_dir), remote=url, endpoint_url=endpoint, uploader="off", **FAST)
    model = _model(seed=7)
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        assert bounded(lambda: node.load({"model": model})) == 2
    for k, v in result["saved"][2].items():
        assert torch.equal(model.state_dict()[k], v), k
    assert "cannot list the remote" in caplog.text and "local steps only" in caplog.text
    assert not [secret for secret in _secrets(s3) if secret in caplog.text], "a credential leaked into the log"
    node.close()


def test_restore_retries_throttling_errors_resets_and_stalls(s3, tmp_path):
    """Downloads through a proxy that throttles, fails, resets and stalls: restored bitwise."""
    url = f"s3://{BUCKET}/restore-faults"
    src = tmp_path / "src"
    model = _model(seed=3)
    ckpt = shardckpt.Checkpointer(local_dir=str(src), remote=url, endpoint_url=s3.endpoint, keep_last=2,
                                  preemption_signals=())
    ckpt.save({"model": model}, 5).wait()
    ckpt.close()
    assert ckpt.status()["drain"]["pending_steps"] == []
    proxy = FaultProxy(s3.endpoint, stall_s=3.0, every=2)
    proxy.set_mode("cycle", kinds=("503", "500", "reset", "stall"))
    try:
        fresh = shardckpt.Checkpointer(
            local_dir=str(tmp_path / "fresh"), remote=url, endpoint_url=proxy.endpoint, uploader="off",
            request_timeout_s=1.0, remote_max_attempts=10, backoff_max_s=0.2, step_deadline_s=60,
            preemption_signals=(),
        )
        restored = _model(seed=11)
        assert bounded(lambda: fresh.load({"model": restored})) == 5
        fresh.close()
    finally:
        proxy.stop()
    for kind in ("503", "500", "reset", "stall"):
        assert proxy.counts.get(kind, 0) >= 1, proxy.counts
    for k, v in model.state_dict().items():
        assert torch.equal(restored.state_dict()[k], v), k


# moto only: every request stalls in the proxy, so no server ever answers one.
@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_remote_that_never_answers_fails_in_bounded_time(s3, tmp_path):
    """Every request stalls: load() ends with a RemoteError naming the object, never hangs."""
    url = f"s3://{BUCKET}/stalled"
    proxy = FaultProxy(s3.endpoint, stall_s=30.0)
    proxy.set_mode("cycle", kinds=("stall",))
    proxy.every = 1
    try:
        fresh = shardckpt.Checkpointer(local_dir=str(tmp_path / "fresh"), remote=url, endpoint_url=proxy.endpoint,
                                       uploader="off", **FAST)
        with pytest.raises(RemoteError) as info:
            bounded(lambda: fresh.load({"model": _model()}))
        fresh.close()
    finally:
        proxy.stop()
    _check_message(str(info.value), f"s3://{BUCKET}/stalled", s3)


# ---------------------------------------------------------------- crash consistency


# moto only: soak_kill runs its own moto server, and the soak takes minutes; once is enough for CI.
def test_sigkill_of_trainer_and_uploader_loses_no_remote_step(tmp_path):
    """CI-sized remote soak: every uploader kill point, random kills of both, trainer kill points.

    After each trial the soak's checker process loads every local step and, from the
    remote alone, every remotely committed step, bitwise against the
    uninterrupted reference; the newest remote step never goes backwards and
    no step seen committed remotely disappears unless retention may drop it.
    """
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import soak_kill

    from shardckpt import _failpoints

    cycle = "u" * len(_failpoints.UPLOADER_POINTS) + "rt"  # every uploader point, random kills, a trainer point
    # A file:// remote here: the S3 protocol under the same kills is the next test (a few trials).
    stats = soak_kill.run_trials(len(cycle), seed=3, work=tmp_path, remote=True, cycle=cycle)
    _check_soak(stats)
    reached = {k for k in stats["points"] if not k.endswith("(not reached)")}
    assert set(_failpoints.UPLOADER_POINTS) <= reached, stats["points"]
    assert stats["uploader_kills"] >= len(_failpoints.UPLOADER_POINTS)


def _check_soak(stats: dict) -> None:
    assert stats["failures"] == [], stats["failures"]
    assert stats["lost_committed"] == 0
    assert stats["max_remote_step"] > 0


@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_sigkill_during_s3_uploads_loses_no_remote_step(s3, tmp_path):
    """Two trials of the soak against the S3 server over HTTP: the uploader SIGKILLed at its
    first kill point (files sent, no marker), then trainer and uploader at random moments."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import soak_kill

    from shardckpt import _failpoints

    s3.reset()
    stats = soak_kill._remote_trials(2, 5, tmp_path, False, f"s3://{BUCKET}/soak", s3.reset)
    _check_soak(stats)
    assert stats["remote"] == "s3" and stats["points"].get(_failpoints.UPLOADER_POINTS[0]) == 1, stats["points"]


# moto only: what it checks is our progress log; the server sees the same stalled, retried uploads
# as in test_uploads_survive_throttling_errors_resets_and_stalls, which runs on both.
@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_slow_upload_logs_progress_and_commits(s3, tmp_path, caplog):
    """An upload slowed by stalled requests reports its progress while it runs, then commits."""
    from shardckpt import stores

    src = tmp_path / "src"
    with shardckpt.Checkpointer(local_dir=str(src), preemption_signals=()) as ckpt:
        ckpt.save({"model": _model(seed=4)}, 3)
    proxy = FaultProxy(s3.endpoint, stall_s=2.0, every=2)
    proxy.set_mode("cycle", kinds=("stall",))
    options = stores.TransferOptions(endpoint_url=proxy.endpoint, request_timeout_s=0.5, backoff_max_s=0.1,
                                     max_attempts=10, step_deadline_s=60)
    store = stores.open_store(f"s3://{BUCKET}/progress", options)
    from shardckpt import _failpoints

    def progress_lines():
        return [r.getMessage() for r in caplog.records if "uploading step 3 to s3://" in r.getMessage()]

    # A progress interval far below the stall (each stalled request takes its 0.5 s timeout): what
    # is checked is that lines come while the files go up, before the step's marker and manifest.
    seen_when_files_sent = []
    _failpoints.arm("upload.files_sent", lambda: seen_when_files_sent.append(len(progress_lines())))
    try:
        with caplog.at_level(logging.INFO, logger="shardckpt"):
            result = bounded(
                lambda: remote_commit.push_step(store, str(src), 3, node="n0", policy=None, progress_s=0.05)
            )
    finally:
        _failpoints.arm("upload.files_sent", lambda: None, nth=0)  # disarmed
        store.close()
        proxy.stop()
    assert result.state == remote_commit.COMMITTED, result
    assert proxy.counts.get("stall", 0) >= 1, proxy.counts
    lines = progress_lines()
    assert lines and all(" of " in line and "MiB" in line for line in lines), caplog.text
    assert seen_when_files_sent == [len(lines)]  # every line came during the upload of the files
    done = [float(line.split(": ")[-1].split(" of ")[0]) for line in lines]
    assert done == sorted(done), lines  # progress only grows
    client = s3.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix="progress/").get("Contents", [])]
    assert f"progress/{layout.step_dirname(3)}/{layout.MANIFEST_NAME}" in keys
