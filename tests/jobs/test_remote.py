"""Remote tier against real S3-protocol servers (moto's and rclone's, over HTTP on 127.0.0.1).

Multi-rank tests run real gloo process groups under torchrun; nothing in
boto3 or torch.distributed is patched.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from faultproxy import FaultProxy  # noqa: E402
from helpers import PROGRAMS, free_port, kill_job, run_torchrun, start_torchrun, wait_for  # noqa: E402
from helpers import child_env as job_env  # noqa: E402
from s3server import BUCKET, Server, reset_if_used, stop_peer_daemons, stop_uploaders  # noqa: E402

import shardckpt  # noqa: E402
from shardckpt import cli, stores  # noqa: E402
from shardckpt import steps as steps_mod  # noqa: E402
from shardckpt.errors import CorruptCheckpointError, RemoteError  # noqa: E402
from shardckpt.format import layout  # noqa: E402
from shardckpt.node import node_registry, uploader  # noqa: E402
from shardckpt.remote import commit as remote_commit  # noqa: E402
from shardckpt.remote import early_upload, ranged  # noqa: E402
from shardckpt.remote import listing as remote_listing  # noqa: E402

PROG = PROGRAMS / "remote_train.py"
MiB = 1 << 20


@pytest.fixture(autouse=True)
def fresh_bucket(request, tmp_path):
    reset_if_used(request)
    yield
    stop_uploaders(tmp_path, grace_s=30.0)


def remote_manifests(s3: Server, prefix: str) -> list[int]:
    steps = []
    for key in s3.keys(prefix + "/"):
        parts = key.split("/")
        if parts[-1] == layout.MANIFEST_NAME:
            steps.append(layout.parse_step_dirname(parts[-2]))
    return sorted(steps)


def check_remote_step(s3: Server, prefix: str, step: int) -> layout.Manifest:
    """Every file the remote manifest lists exists with its size and checksum."""
    client = s3.client()
    base = f"{prefix}/{layout.step_dirname(step)}"
    body = client.get_object(Bucket=BUCKET, Key=f"{base}/{layout.MANIFEST_NAME}")["Body"].read().decode()
    manifest = layout.Manifest.from_json(body, base)
    for name, entry in manifest.files.items():
        data = client.get_object(Bucket=BUCKET, Key=f"{base}/{name}")["Body"].read()
        assert len(data) == entry.size, name
        assert layout.checksum_bytes(data, like=entry.checksum) == entry.checksum, name
    return manifest


def save_local_steps(local_dir: Path, steps: list[int], width: int = 64) -> dict[int, dict]:
    """Single-process saves (no remote) of a model whose state changes per step."""
    model = torch.nn.Linear(width, width)
    ckpt = shardckpt.Checkpointer(local_dir=str(local_dir), keep_last=None, preemption_signals=())
    saved = {}
    for step in steps:
        with torch.no_grad():
            model.weight.add_(float(step))
        ckpt.save({"model": model}, step).wait()
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt.close()
    return saved


def wait_uploader_exit(local_dir: Path, timeout: float = 90) -> dict:
    status = local_dir / node_registry.STATE_DIR / "status.json"
    wait_for(lambda: node_registry.read_json(str(status)).get("state") == "exited", timeout,
             f"the uploader of {local_dir} to exit")
    return node_registry.read_json(str(status))


def wait_all(procs, logs) -> None:
    """Every launcher exits 0 (else its log's end is shown); none is left running."""
    try:
        for proc, log_path in zip(procs, logs):
            rc = proc.wait(timeout=300)
            assert rc == 0, Path(log_path).read_text()[-5000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_job(proc)


# ---------------------------------------------------------------- multi-node


def test_two_nodes_upload_then_restore_on_new_instances(s3, tmp_path):
    """2 nodes x 2 ranks save with node-local dirs; all local dirs wiped; 2 new nodes x 1 rank
    restore from the remote (4 -> 2 ranks), each through a byte-counting proxy: bitwise, and each
    node fetched about half of the step's shard bytes (fetching every file would be all of them)
    although it loaded the step twice (the second load read what the first one fetched). The state
    also holds a replicated module (DDP-style: every rank needs all of it): read once, shared, so
    both nodes together fetched the step's bytes once (fetching it per node: 1.25x). A chunk node 1
    passes on is damaged in transit: node 0 refuses it and fetches that chunk from the remote itself."""
    base = tmp_path / "job1"
    url = f"s3://{BUCKET}/twonode"
    # ~30 KiB per rank: many chunks per file; the replica is a third of the step.
    knobs = {"RT_WIDTH": "512", "RT_CHUNK": "1024", "RT_REPLICA": "1024"}
    env = job_env(**s3.env(), **knobs)
    port = free_port()
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    procs = [
        start_torchrun(2, PROG, "save", base, url, tmp_path / "saved.pt", "3",
                       nnodes=2, node_rank=i, port=port, env=env, log_path=logs[i])
        for i in range(2)
    ]
    wait_all(procs, logs)

    # Each node holds only its own ranks' shard files locally.
    node1_files = os.listdir(base / "node1" / layout.step_dirname(3))
    assert not any(n.startswith("__0_") or n.startswith("__1_") for n in node1_files)

    # Committed remotely: manifest + both nodes' markers; remote retention kept 2 steps.
    assert remote_manifests(s3, "twonode") == [2, 3]
    markers = [k for k in s3.keys(f"twonode/{layout.step_dirname(3)}/{remote_commit.NODES_DIR}/")]
    assert len(markers) == 2, markers
    manifest = check_remote_step(s3, "twonode", 3)
    assert {e.rank for e in manifest.files.values()} == {0, 1, 2, 3}
    for node in ("node0", "node1"):
        assert remote_commit.is_uploaded(str(base / node / layout.step_dirname(3)), url)
        status = wait_uploader_exit(base / node)
        assert status["pending_steps"] == []

    stop_peer_daemons(base)  # the old instances are gone, their daemons with them
    shutil.rmtree(base)
    proxies = [FaultProxy(s3.endpoint) for _ in range(2)]
    logs = [tmp_path / f"restore{i}.log" for i in range(2)]
    port = free_port()
    procs = [
        start_torchrun(1, PROG, "restore", tmp_path / "job2", url, tmp_path / "restored.pt", nnodes=2, node_rank=i,
                       port=port, log_path=logs[i],
                       env=job_env(**{**s3.env(), "AWS_ENDPOINT_URL": proxies[i].endpoint}, **knobs, RT_LOAD_TWICE="1",
                                   SHARDCKPT_FAILPOINTS="flip:share.chunk_send" if i == 1 else ""))
        for i in range(2)
    ]
    try:
        wait_all(procs, logs)
    finally:
        for proxy in proxies:
            proxy.stop()
    saved = torch.load(tmp_path / "saved.pt")
    # Both loads bitwise: the first (which received the damaged chunk) and the second (which read what the
    # first fetched); and no chunk the sparse copies hold fails its checksum on disk (a received chunk that
    # failed was never written as held).
    for restored in (torch.load(tmp_path / "restored.pt.first"), torch.load(tmp_path / "restored.pt")):
        assert restored["step"] == 3
        assert saved["tensors"].keys() == restored["tensors"].keys()
        for key, value in saved["tensors"].items():
            assert torch.equal(value, restored["tensors"][key]), key
    for node in range(2):
        held = json.loads((tmp_path / f"restored.pt.held{node}.json").read_text())
        assert held["held"] > 0 and held["bad"] == [], (node, held)
    # Each new node fetched the ranges its rank read: about half of the shard bytes.
    shards = sum(e.size for n, e in manifest.files.items() if n.endswith(".distcp"))
    where = f"/{layout.step_dirname(3)}/"
    fetched = [sum(n for path, n in p.got if where in path and path.endswith(".distcp")) for p in proxies]
    for node, got in enumerate(fetched):
        assert 0.35 * shards < got < 0.75 * shards, (node, got, shards, fetched)
    # The replicated bytes were read once, not per node (per node: 1.25x; records nobody reads, as the
    # RNG states of the saved ranks 2-3, are not fetched at all).
    assert 0.8 * shards < sum(fetched) <= 1.1 * shards, (fetched, shards)
    metadata_gets = [path for p in proxies for path, _n in p.got if path.endswith(f"{where}{layout.METADATA_NAME}")]
    assert len(metadata_gets) == 1, metadata_gets  # .metadata too: fetched once, passed to the other node
    texts = [log_path.read_text() for log_path in logs]
    assert all("read once, shared" in text for text in texts)
    assert "received from rank 1 fails its checksum; fetching it from the remote instead" in texts[0]
    assert re.search(r"again after a failed delivery [1-9]", texts[0]), texts[0][-3000:]
    for node in range(2):
        local_dir = tmp_path / "job2" / f"node{node}"
        assert layout.committed_steps(str(local_dir)) == []  # a sparse copy is never a committed step
        assert [n for n in os.listdir(local_dir) if n.startswith(ranged.SPARSE_PREFIX)]


@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_dead_uploader_fails_its_steps_in_time_naming_the_node_and_later_steps_commit(s3, tmp_path, capsys):
    """2 nodes; node 1's uploader is SIGKILLed after step 1 and steps 2-4 are saved.

    Within remote_commit_timeout_s (5 s) of their save node 0 reports each failed, naming
    node 1 and its ranks, in its trainer's log and in status(); step 1 stays the newest
    remote step; node 0's requests stay bounded while the three steps wait (through a
    counting proxy). Node 1's uploader back, step 5 commits.
    """
    import json
    import socket

    base, out = tmp_path / "job", tmp_path / "out"
    prefix = "deadnode"
    url = f"s3://{BUCKET}/{prefix}"
    proxy = FaultProxy(s3.endpoint)  # node 0's trainer and uploader only: its requests are counted
    port = free_port()
    envs = [job_env(**s3.env(), SHARDCKPT_REMOTE_COMMIT_TIMEOUT_S="5", SHARDCKPT_ENDPOINT_URL=proxy.endpoint),
            job_env(**s3.env(), SHARDCKPT_REMOTE_COMMIT_TIMEOUT_S="5")]
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    procs = [start_torchrun(2, PROG, "deadnode", base, url, out, nnodes=2, node_rank=i, port=port,
                            env=envs[i], log_path=logs[i]) for i in range(2)]
    try:
        failed_file = Path(str(out) + ".failed")
        wait_for(failed_file.exists, 120, "steps 2-4 reported failed", procs[0], logs[0])
        window_s = 4.0
        before, t0 = proxy.index, time.monotonic()
        assert cli.main(["status", str(base / "node0")]) == 0
        shown = capsys.readouterr().out
        time.sleep(max(0.0, window_s - (time.monotonic() - t0)))
        rate = (proxy.index - before) / window_s
        assert remote_manifests(s3, prefix) == [1]  # the failed steps are not committed, step 1 stays
        Path(str(out) + ".go").write_text("go")
        for proc, log_path in zip(procs, logs):
            rc = proc.wait(timeout=180)
            assert rc == 0, Path(log_path).read_text()[-5000:]
    finally:
        proxy.stop()
        for proc in procs:
            if proc.poll() is None:
                kill_job(proc)
    report = json.loads(failed_file.read_text())
    node1 = f"{socket.gethostname()}:1"
    status = report["status"]
    assert status["latest_remote"] == 1, status
    assert sorted(status["failed_commits"]) == ["2", "3", "4"], status
    for step, saved in report["saved"].items():
        failed = status["failed_commits"][step]
        assert failed["ranks"] == [2, 3] and failed["nodes"] == [node1], failed
        # Reported once the deadline passed: 5 s, plus the polls' own spacing and the
        # status file's round trip to the trainer (generous on a loaded machine).
        assert report["reported"] - saved < 5 + 15, (step, report)
    text = logs[0].read_text()
    for step in (2, 3, 4):
        assert f"step {step} is not committed on {url} 5 s after its save" in text, text[-4000:]
    assert f"no upload of ranks 2-3 (node {node1})" in text
    for step in (2, 3, 4):  # and `shardckpt status` on node 0
        assert f"FAILED: step {step} is not committed on {url}" in shown, shown
    assert f"no upload of ranks 2-3 (node {node1})" in shown, shown
    # One poll per 0.5 s per node at most, whatever the number of steps waiting; a poll of
    # the committer costs at most 6 requests here. (Polling each step every 0.5 s: ~30/s.)
    print(f"node 0: {rate:.1f} requests/s while steps 2-4 wait")
    assert rate <= 2 * 6, rate
    # Node 1 back: step 5 commits (and 2-4 commit late or are superseded); nothing committed is lost.
    assert remote_manifests(s3, prefix)[-1] == 5
    check_remote_step(s3, prefix, 5)
    for node in ("node0", "node1"):
        assert remote_commit.is_uploaded(str(base / node / layout.step_dirname(5)), url)


@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_a_dead_node_costs_each_poll_the_same_and_one_node_reports_it_for_all(s3, tmp_path):
    """Three nodes (one rank each); node C, which holds the highest rank, is dead from step 2.

    A poll of a blocked step costs the same for step 2 (step 3 blocked after it) as for step 3,
    and the committer reads no marker again; past the deadline node B (no reporter) reads no
    marker and waits for the report, the committer writes it once (ranks and node of C, from
    step 1's markers) and B then learns it with one GET.
    """
    from remote_history import RequestLog

    base, out = tmp_path / "nvme", tmp_path / "out"
    out.mkdir()
    run_torchrun(3, PROGRAMS / "multinode.py", "save", base, out, "--layout", "rank", "--steps", "3")
    url = f"s3://{BUCKET}/deadpoll"
    dirs = {n: str(base / f"rank{r}") for r, n in enumerate("abc")}
    opened = {n: stores.open_store(url, _opts()) for n in "abc"}
    logs = {n: RequestLog(opened[n]) for n in "ab"}
    caches = {n: remote_commit.MarkerCache() for n in "abc"}

    def push(n: str, step: int, **kw) -> remote_commit.PushResult:
        return remote_commit.push_step(opened[n], dirs[n], step, node=n, policy=None, markers=caches[n], **kw)

    for n in "cba":
        push(n, 1)
    assert remote_listing.committed_record(opened["a"], 1, stores.Deadline(30)) is not None
    marked = {}
    for step in (2, 3):
        for n in "ba":
            result = push(n, step)
            assert result.state == remote_commit.WAITING, result
            marked[(n, step)] = result.marked
    polls = {}
    for step in (2, 3):
        for n in "ab":
            logs[n].clear()
            assert push(n, step, skip_upload_digest=marked[(n, step)]).state == remote_commit.WAITING
            polls[(n, step)] = (dict(logs[n].kinds), dict(logs[n].gets))
    for n in "ab":
        assert polls[(n, 2)] == polls[(n, 3)], polls
        assert not any(name.startswith("ranks-") for name in polls[(n, 2)][1]), polls  # no marker read again

    def details(n: str) -> dict:
        up = uploader.Uploader(dirs[n], opened[n], node=n)
        up.markers, up.latest_remote = caches[n], 1
        failed: dict = {"detail": ""}
        logs.get(n, logs["a"]).clear()
        up._failure_details(2, failed)
        return failed

    waiting = details("b")
    assert waiting.get("awaiting_report") and not waiting.get("ranks"), waiting
    assert not any(name.startswith("ranks-") for name in logs["b"].gets), logs["b"].gets
    assert "_failed.json" in uploader.failure_text(2, {**waiting, "timeout_s": 5}, url)
    reported = details("a")
    assert reported["ranks"] == [2] and reported["nodes"] == ["c"], reported
    learned = details("b")
    assert learned["ranks"] == [2] and learned["nodes"] == ["c"] and not learned.get("awaiting_report"), learned
    assert dict(logs["b"].kinds) == {"GET": 1}, logs["b"].kinds
    for store in opened.values():
        store.close()


def test_uploader_commits_after_trainer_is_sigkilled(s3, tmp_path):
    base = tmp_path / "job"
    url = f"s3://{BUCKET}/killed"
    out = tmp_path / "out.pt"
    log_path = tmp_path / "train.log"
    proc = start_torchrun(2, PROG, "hang", base, url, out, "3", env=job_env(**s3.env()), log_path=log_path)
    local_dir = base / "node0"

    def step4_sent_early() -> bool:
        names = [k.rsplit("/", 1)[1] for k in s3.keys(f"killed/{layout.step_dirname(4)}/")]
        return {n[:4] for n in names if n.startswith("__")} == {"__0_", "__1_"}

    try:
        wait_for(lambda: Path(str(out) + ".ready").exists(), 240, "step 3 committed locally", proc, log_path)
        wait_for(step4_sent_early, 120, "step 4's files uploaded before its local commit", proc, log_path)
    finally:
        kill_job(proc)  # torchrun and every worker, at once
    assert node_registry.trainers_alive(str(local_dir)) == []
    assert layout.committed_steps(str(local_dir))[-1] == 3
    wait_for(lambda: 3 in remote_manifests(s3, "killed"), 120, "step 3 committed remotely after SIGKILL")
    check_remote_step(s3, "killed", 3)
    status = wait_uploader_exit(local_dir)
    assert status["pending_steps"] == []
    assert status["latest_remote"] == 3
    # Step 4 was killed mid-save after its files were uploaded early: objects without a manifest,
    # not a remote step; step 3 stays the newest.
    early = [k for k in s3.keys(f"killed/{layout.step_dirname(4)}/") if k.rsplit("/", 1)[1].startswith("__")]
    assert {k.rsplit("/", 1)[1][:4] for k in early} == {"__0_", "__1_"}, early
    assert remote_manifests(s3, "killed") == [2, 3]
    assert remote_listing.remote_steps(stores.open_store(url, _opts()), stores.Deadline(60)) == [2, 3]
    for step in layout.committed_steps(str(local_dir)):
        assert remote_commit.is_uploaded(str(local_dir / layout.step_dirname(step)), url)


# ---------------------------------------------------------------- faults


def _opts(**kw) -> stores.TransferOptions:
    base = dict(
        concurrency=4, part_size=5 * MiB, multipart_threshold=10 * MiB, request_timeout_s=1.0,
        connect_timeout_s=1.0, max_attempts=12, backoff_base_s=0.02, backoff_max_s=0.2, step_deadline_s=120,
    )
    base.update(kw)
    return stores.TransferOptions(**base)


def test_uploads_survive_throttling_errors_resets_and_stalls(s3, tmp_path):
    local_dir = tmp_path / "local"
    save_local_steps(local_dir, [1], width=1700)  # ~11 MiB shard: multipart (5 MiB parts)
    proxy = FaultProxy(s3.endpoint, stall_s=2.0, every=3)
    proxy.set_mode("cycle", kinds=("503", "500", "reset", "stall"))
    try:
        url = f"s3://{BUCKET}/faults"
        store = stores.open_store(url, _opts(endpoint_url=proxy.endpoint))
        up = uploader.Uploader(str(local_dir), store, node="n0", once=True, poll_s=0.05)
        assert up.run() == 0, up.last_error
    finally:
        proxy.stop()
    for kind in ("503", "500", "reset", "stall"):
        assert proxy.counts.get(kind, 0) >= 1, proxy.counts
    assert remote_manifests(s3, "faults") == [1]
    manifest = check_remote_step(s3, "faults", 1)
    assert max(e.size for e in manifest.files.values()) > 10 * MiB


def test_persistent_failure_is_reported_never_half_committed_then_retried(s3, tmp_path):
    local_dir = tmp_path / "local"
    save_local_steps(local_dir, [1])
    proxy = FaultProxy(s3.endpoint)
    url = f"s3://{BUCKET}/down"
    try:
        proxy.set_mode("fail503")
        store = stores.open_store(url, _opts(endpoint_url=proxy.endpoint, max_attempts=3))
        up = uploader.Uploader(str(local_dir), store, node="n0", once=True, poll_s=0.05)
        assert up.run() == 1
        error = up.last_error
        assert "503" in error and "SlowDown" in error and f"s3://{BUCKET}/down/" in error, error
        assert s3.credentials["AWS_SECRET_ACCESS_KEY"] not in error
        status = node_registry.read_status(str(local_dir))
        assert status["pending_steps"] == [1] and status["pending_bytes"] > 0
        assert status["last_error"] == error
        assert remote_manifests(s3, "down") == []
        assert not remote_commit.is_uploaded(str(local_dir / layout.step_dirname(1)), url)

        # A Checkpointer on this node reports it, and local retention keeps the step.
        ckpt = shardckpt.Checkpointer(local_dir=str(local_dir), remote=url, uploader="external",
                                      endpoint_url=proxy.endpoint, drain_timeout_s=0.5, preemption_signals=())
        st = ckpt.status()
        assert st["pending_upload_steps"] == [1] and st["last_upload_error"] == error
        assert st["latest_local"] == 1 and st["latest_remote"] is None
        assert ckpt._deletable(1) is False
        ckpt.close()

        proxy.set_mode("pass")
        up = uploader.Uploader(str(local_dir), stores.open_store(url, _opts(endpoint_url=proxy.endpoint)),
                                   node="n0", once=True, poll_s=0.05)
        assert up.run() == 0
    finally:
        proxy.stop()
    assert remote_manifests(s3, "down") == [1]
    check_remote_step(s3, "down", 1)
    assert remote_commit.is_uploaded(str(local_dir / layout.step_dirname(1)), url)


def test_steps_waiting_for_a_missing_node_are_polled_with_backoff_and_reported_failed(tmp_path, monkeypatch):
    """Three steps wait for a file another node would hold (here: deleted from the only copy).

    Their polls share one per poll_s and each backs off (in the time of 60 polls of one
    step, about 30 for all three); each is reported failed once, past the deadline, with
    no rank of its own missing but the file named; none is marked uploaded.
    """
    local_dir = tmp_path / "local"
    save_local_steps(local_dir, [1, 2, 3])
    for step in (1, 2, 3):
        os.unlink(local_dir / layout.step_dirname(step) / layout.METADATA_NAME)
    url = (tmp_path / "remote").as_uri()
    polls: list[tuple[float, int]] = []
    real = uploader.push_step

    def counted(*args, **kw):
        polls.append((time.monotonic(), args[2]))
        return real(*args, **kw)

    monkeypatch.setattr(uploader, "push_step", counted)
    up = uploader.Uploader(str(local_dir), stores.open_store(url, _opts()), node="n0", poll_s=0.05,
                           commit_timeout_s=0.5)
    thread = threading.Thread(target=up.run)
    thread.start()
    time.sleep(3.0)
    up.stop()
    thread.join(timeout=30)
    # Without backoff: 3 x 60 polls; one poll per poll_s for all of them: 60; backing off: ~30.
    print(f"{len(polls)} polls in 3 s of 3 waiting steps")
    assert 9 <= len(polls) <= 45, polls
    # After each step's first pass, one poll per poll_s for all of them (not one per step).
    again = [t for i, (t, step) in enumerate(polls) if step in {s for _, s in polls[:i]}]
    assert min(b - a for a, b in zip(again, again[1:])) >= 0.5 * 0.05, polls
    status = node_registry.read_status(str(local_dir))
    assert sorted(status["failed_steps"]) == ["1", "2", "3"], status
    for failed in status["failed_steps"].values():
        assert failed["timeout_s"] == 0.5 and "markers covering 1 file(s), e.g. .metadata" in failed["detail"], failed
    assert status["pending_steps"] == [1, 2, 3]
    for step in (1, 2, 3):
        assert not remote_commit.is_uploaded(str(local_dir / layout.step_dirname(step)), url)


# ---------------------------------------------------------------- corruption


def test_bit_flip_in_remote_object_is_refused_or_falls_back(s3, tmp_path, caplog):
    """A restore onto an empty disk fetches ranges: the flipped chunk fails its chunk checksum,
    is fetched once more, fails again, and the step is refused (or falls back)."""
    src = tmp_path / "src"
    saved = save_local_steps(src, [1, 2])
    url = f"s3://{BUCKET}/flip"
    up = uploader.Uploader(str(src), stores.open_store(url, _opts()), node="n0", once=True, poll_s=0.05)
    assert up.run() == 0
    key = f"flip/{layout.step_dirname(2)}/__0_0.distcp"
    client = s3.client()
    data = bytearray(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x10
    client.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))

    fresh = tmp_path / "fresh"
    ckpt = shardckpt.Checkpointer(local_dir=str(fresh), remote=url, uploader="off", preemption_signals=())
    model = torch.nn.Linear(64, 64)
    with caplog.at_level("WARNING", logger="shardckpt"), pytest.raises(CorruptCheckpointError) as info:
        ckpt.load({"model": model})
    assert f"s3://{BUCKET}/{key}" in str(info.value) and "chunk checksum twice" in str(info.value)
    assert "fail their chunk checksum; fetching them again" in caplog.text
    assert layout.committed_steps(str(fresh)) == []  # nothing unverified became a local step
    sparse = [n for n in os.listdir(fresh) if n.startswith(ranged.SPARSE_PREFIX)]
    assert sparse and layout.step_dirname(2) in sparse[0]
    held = json.loads((fresh / sparse[0] / ranged.HELD_NAME).read_text())
    assert held.get("__0_0.distcp") == []  # the corrupt chunk was never taken as held
    ckpt.close()

    ckpt = shardckpt.Checkpointer(local_dir=str(fresh), remote=url, uploader="off", on_corrupt="fallback",
                                  preemption_signals=())
    assert ckpt.load({"model": model}) == 1
    for k, v in saved[1].items():
        assert torch.equal(model.state_dict()[k], v), k
    # A held chunk that rots on the local disk is checked before it is read, and fetched again.
    (sparse,) = [fresh / n for n in os.listdir(fresh) if n.startswith(ranged.SPARSE_PREFIX)]
    with open(sparse / "__0_0.distcp", "r+b") as f:
        f.seek(os.path.getsize(sparse / "__0_0.distcp") // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    model = torch.nn.Linear(64, 64)
    assert ckpt.load({"model": model}, step=1) == 1
    for k, v in saved[1].items():
        assert torch.equal(model.state_dict()[k], v), k
    ckpt.close()


@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_chunk_sums_are_taken_while_writing_and_a_manifest_without_them_is_fetched_whole(s3, tmp_path):
    src = tmp_path / "src"
    saved = save_local_steps(src, [1], width=1100)  # a shard of ~4.6 MiB: two chunks
    step_dir = src / layout.step_dirname(1)
    manifest = layout.read_manifest(str(step_dir))
    for name, entry in manifest.files.items():  # the sums of the write are the sums of the file
        assert layout.file_sums(str(step_dir / name)) == (entry.size, entry.checksum, entry.chunks), name
    assert len(layout.chunk_table(manifest.files["__0_0.distcp"].chunks, manifest.files["__0_0.distcp"].size)[1]) == 2
    url = f"s3://{BUCKET}/oldmanifest"
    assert uploader.Uploader(str(src), stores.open_store(url, _opts()), node="n0", once=True, poll_s=0.05).run() == 0
    # A manifest from before chunk sums: the step is fetched whole and committed locally, as before.
    key = f"oldmanifest/{layout.step_dirname(1)}/{layout.MANIFEST_NAME}"
    body = json.loads(s3.client().get_object(Bucket=BUCKET, Key=key)["Body"].read())
    for entry in body["files"].values():
        del entry["chunks"]
    del body["digest"]  # nor did such manifests carry a digest of their own content
    s3.client().put_object(Bucket=BUCKET, Key=key, Body=json.dumps(body).encode())
    fresh = tmp_path / "fresh"
    model = torch.nn.Linear(1100, 1100)
    with shardckpt.Checkpointer(local_dir=str(fresh), remote=url, uploader="off", preemption_signals=()) as ckpt:
        assert ckpt.load({"model": model}) == 1
    for k, v in saved[1].items():
        assert torch.equal(model.state_dict()[k], v), k
    assert layout.committed_steps(str(fresh)) == [1]
    assert not [n for n in os.listdir(fresh) if n.startswith(ranged.SPARSE_PREFIX)]


def test_upload_check_refuses_an_object_recorded_with_another_checksum(s3):
    """The HEAD after an upload compares the checksum recorded with the object to the manifest's.

    (An object replaced between the PUT and the HEAD, by another writer, carries another one.)
    rclone answers the metadata name capitalised (``Checksum``): the lookup ignores case.
    """
    data = b"shardckpt" * 1000
    other = "xxh64:0123456789abcdef"
    s3.client().put_object(Bucket=BUCKET, Key="recorded/obj", Body=data, Metadata={"checksum": other})
    store = stores.open_store(f"s3://{BUCKET}/recorded", _opts())
    try:
        with pytest.raises(RemoteError, match="its recorded checksum differs"):
            store._verify_upload("obj", len(data), layout.checksum_bytes(data), "", stores.Deadline(30))
    finally:
        store.close()


# ---------------------------------------------------------------- file:// and the CLI


def test_file_remote_auto_uploader_and_cli_pull_push(tmp_path, caplog):
    import re

    caplog.set_level("INFO", logger="shardckpt")
    local_dir = tmp_path / "local"
    mount = tmp_path / "nfs"
    url = f"file://{mount}"
    model = torch.nn.Linear(32, 32)
    ckpt = shardckpt.Checkpointer(local_dir=str(local_dir), remote=url, keep_last=1, preemption_signals=())
    for step in (1, 2):
        with torch.no_grad():
            model.weight.add_(1.0)
        ckpt.save({"model": model}, step).wait()
    ckpt.close()
    st = ckpt.status()
    assert st["pending_upload_steps"] == [] and st["latest_remote"] == 2, st
    # The save's durability levels, the remote one logged once known (here by close()).
    levels = re.search(r"shardckpt: step 2: local (\d+\.\d) s, remote (\d+\.\d) s$", caplog.text, re.M)
    assert levels and float(levels[2]) >= float(levels[1]), caplog.text
    assert (mount / layout.step_dirname(2) / layout.MANIFEST_NAME).exists()
    wait_uploader_exit(local_dir)

    # pull into an empty directory: a verified, committed local step
    pulled = tmp_path / "pulled"
    assert cli.main(["pull", "--remote", url, "--local", str(pulled)]) == 0
    step_dir = pulled / layout.step_dirname(2)
    layout.verify_files(str(step_dir), layout.read_manifest(str(step_dir)))

    # push to another remote by hand
    other = tmp_path / "other"
    assert cli.main(["push", "--local", str(pulled), "--remote", f"file://{other}"]) == 0
    assert (other / layout.step_dirname(2) / layout.MANIFEST_NAME).exists()

    # restore on a new instance from the file:// remote
    fresh = torch.nn.Linear(32, 32)
    ckpt = shardckpt.Checkpointer(local_dir=str(tmp_path / "new"), remote=url, uploader="off", preemption_signals=())
    assert ckpt.load({"model": fresh}) == 2
    assert torch.equal(fresh.weight, model.weight)
    ckpt.close()


def test_errors_never_carry_credentials_and_name_the_object(s3, tmp_path):
    url = "s3://no-such-bucket-xyz/run"
    store = stores.open_store(url, _opts(max_attempts=2))
    with pytest.raises(RemoteError) as info:
        remote_listing.remote_steps(store, stores.Deadline(30))
    text = str(info.value)
    assert "NoSuchBucket" in text and "no-such-bucket-xyz" in text and "Remedy" in text
    assert s3.credentials["AWS_SECRET_ACCESS_KEY"] not in text
    assert stores.redact("https://AKIA:s3cr3t@minio:9000/x") == "https://***@minio:9000/x"


def test_step_saved_again_replaces_its_remote_copy(s3, tmp_path):
    """A step saved again locally (after a rollback) retires the earlier remote copy, never mixes them."""
    local_dir = tmp_path / "local"
    url = f"s3://{BUCKET}/again"
    save_local_steps(local_dir, [1])
    assert uploader.Uploader(str(local_dir), stores.open_store(url, _opts()), node="n0", once=True,
                             poll_s=0.05).run() == 0
    first = check_remote_step(s3, "again", 1)
    time.sleep(0.01)  # a later manifest timestamp
    save_local_steps(local_dir, [1])  # fresh random weights: different content
    local = layout.read_manifest(str(local_dir / layout.step_dirname(1)))
    assert remote_commit.files_digest(local) != remote_commit.files_digest(first)
    assert uploader.Uploader(str(local_dir), stores.open_store(url, _opts()), node="n0", once=True,
                             poll_s=0.05).run() == 0
    second = check_remote_step(s3, "again", 1)
    assert remote_commit.files_digest(second) == remote_commit.files_digest(local)


@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_files_upload_while_the_save_is_written_and_never_over_a_committed_step(s3, tmp_path, monkeypatch):
    """With the uploader running (``auto``), a save's shard files are on the remote before its local
    commit, are not sent twice, and the step commits bitwise. A second save of that committed step
    number uploads nothing before its local commit (the committed objects stay untouched until the
    committer retires that copy); then it commits whole."""
    from shardckpt import _failpoints

    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    local_dir, url = tmp_path / "local", f"s3://{BUCKET}/early"
    step_prefix = f"early/{layout.step_dirname(1)}/"
    client = s3.client()

    def shard_etags() -> dict[str, str]:
        objs = client.list_objects_v2(Bucket=BUCKET, Prefix=step_prefix).get("Contents", [])
        return {o["Key"].rsplit("/", 1)[1]: o["ETag"] for o in objs if o["Key"].rsplit("/", 1)[1].startswith("__")}

    seen: dict[str, object] = {}

    def first_write_done() -> None:  # every shard file written, the step not committed locally
        wait_for(lambda: len(shard_etags()) == 2, 60, "the shard files uploaded before the local commit")
        seen["local_commit"] = os.path.exists(local_dir / layout.step_dirname(1))
        seen["remote_manifest"] = bool(s3.keys(step_prefix + layout.MANIFEST_NAME))

    def second_write_done() -> None:
        # An early pass over this save while the first one is committed remotely (its writer alive, its
        # files published) sends nothing: the committed objects keep the first save's bytes.
        store = stores.open_store(url, _opts())
        try:
            seen["sent_early"] = early_upload.EarlyUploads().run(store, str(local_dir))
        finally:
            store.close()
        seen["first_intact"] = {n: client.get_object(Bucket=BUCKET, Key=step_prefix + n)["Body"].read()
                                for n in first_bytes} == first_bytes
        log_file = local_dir / node_registry.STATE_DIR / "uploader.log"
        wait_for(lambda: "under another save" in log_file.read_text(), 60, "the early pass to pass the step over")
        seen["after_refusal"] = shard_etags()

    model = torch.nn.Linear(128, 128)
    ckpt = shardckpt.Checkpointer(local_dir=str(local_dir), remote=url, uploader="auto", mode="sync", io_threads=2,
                                  keep_last=None, preemption_signals=(), drain_timeout_s=60)
    try:
        _failpoints.arm("write.done", first_write_done)
        ckpt.save({"model": model}, 1)
        assert seen == {"local_commit": False, "remote_manifest": False}
        wait_for(lambda: s3.keys(step_prefix + layout.MANIFEST_NAME), 60, "step 1 committed remotely")
        first = check_remote_step(s3, "early", 1)
        first_bytes = {}
        for name in first.files:
            first_bytes[name] = client.get_object(Bucket=BUCKET, Key=step_prefix + name)["Body"].read()
            assert first_bytes[name] == (local_dir / layout.step_dirname(1) / name).read_bytes(), name
        status = wait_for_status(local_dir, lambda st: st.get("latest_remote") == 1)
        assert status["uploaded_bytes"] == first.total_bytes  # each file sent once
        committed_etags = shard_etags()

        with torch.no_grad():
            model.weight.add_(1.0)
        _failpoints.arm("write.done", second_write_done)
        ckpt.save({"model": model}, 1, force=True)
        assert seen["sent_early"] == 0 and seen["first_intact"], {k: v for k, v in seen.items() if k != "after_refusal"}
        assert seen["after_refusal"] == committed_etags
        local = layout.read_manifest(str(local_dir / layout.step_dirname(1)))
        store = stores.open_store(url, _opts())
        wait_for(lambda: getattr(remote_listing.committed_record(store, 1, stores.Deadline(10)), "files_digest", None)
                 == remote_commit.files_digest(local), 60, "the second save of step 1 committed remotely")
        assert remote_commit.files_digest(check_remote_step(s3, "early", 1)) == remote_commit.files_digest(local)
    finally:
        _failpoints.arm("write.done", lambda: None, nth=10**9)
        ckpt.close()


def test_a_partial_save_whose_writer_died_is_not_uploaded_early(tmp_path):
    """The early pass uploads a partial save's published files only while the process that wrote
    them runs: a save whose trainer died can never commit, and an uploader that outlives it (as it
    is meant to) must not keep sending its files into the remote step."""
    import subprocess

    root, url = tmp_path / "local", f"file://{tmp_path / 'remote'}"
    for step, pid in ((1, None), (2, os.getpid())):
        partial = root / layout.partial_dirname(step, f"1-nonce{step}")
        partial.mkdir(parents=True)
        data = bytes([step]) * 4096
        (partial / "__0_0.distcp").write_bytes(data)
        early_upload.publish(str(partial), step=step, save_id=f"nonce{step}-1", rank=0, name="__0_0.distcp",
                             size=len(data), checksum=layout.checksum_bytes(data))
        if pid is None:  # rewrite the sidecar as a process that has exited wrote it
            dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                                  text=True, check=True)
            sidecar = partial / f"{early_upload.READY_PREFIX}__0_0.distcp.json"
            body = json.loads(sidecar.read_text())
            body["pid"] = int(dead.stdout)
            sidecar.write_text(json.dumps(body))
    store = stores.open_store(url, _opts())
    sent = early_upload.EarlyUploads().run(store, str(root))
    assert sent == 4096
    assert not (tmp_path / "remote" / layout.step_dirname(1)).exists()
    assert (tmp_path / "remote" / layout.step_dirname(2) / "__0_0.distcp").read_bytes() == bytes([2]) * 4096


def wait_for_status(local_dir: Path, predicate, timeout: float = 60) -> dict:
    path = str(local_dir / node_registry.STATE_DIR / "status.json")
    wait_for(lambda: predicate(node_registry.read_json(path)), timeout, f"the uploader status of {local_dir}")
    return node_registry.read_json(path)


@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_one_node_uploads_metadata_per_step_and_the_step_restores(s3, tmp_path):
    """Two node-local copies (one rank each, as two nodes hold): `.metadata` is PUT once per step,
    by the committer, whichever node uploads first; the other node's marker leaves it out; each
    step commits and is fetched whole; `shardckpt push` from that other node still repairs it."""
    base, out = tmp_path / "nvme", tmp_path / "out"
    out.mkdir()
    run_torchrun(2, PROGRAMS / "multinode.py", "save", base, out, "--layout", "rank", "--steps", "2")
    store = stores.open_store(f"s3://{BUCKET}/onemeta", _opts())
    put_keys: list[str] = []
    real_put = store.put_file

    def counted(path, key, *args, **kwargs):
        put_keys.append(key)
        return real_put(path, key, *args, **kwargs)

    store.put_file = counted
    a, b = str(base / "rank0"), str(base / "rank1")  # A holds rank 0's shard: it commits
    push = remote_commit.push_step
    from remote_history import RequestLog

    b_store = stores.open_store(f"s3://{BUCKET}/onemeta", _opts())  # node B's own client, counted
    b_log = RequestLog(b_store)
    assert push(b_store, b, 1, node="b", policy=None).state == remote_commit.WAITING
    assert push(store, a, 1, node="a", policy=None).state == remote_commit.COMMITTED
    assert push(store, a, 2, node="a", policy=None).state == remote_commit.WAITING
    marked = push(b_store, b, 2, node="b", policy=None)
    assert marked.state == remote_commit.WAITING
    b_log.clear()  # a waiting pass, then the pass that sees step 1 committed: the step record, never the manifest
    assert push(b_store, b, 2, node="b", policy=None, skip_upload_digest=marked.marked).state == remote_commit.WAITING
    assert push(b_store, b, 1, node="b", policy=None).state == remote_commit.COMMITTED
    assert b_log.manifest_gets == 0 and b_log.gets[remote_listing.STEP_RECORD_NAME] == 2, (b_log.kinds, b_log.gets)
    assert b_log.bytes_in < 4096, b_log.bytes_in
    b_store.close()
    assert push(store, a, 2, node="a", policy=None).state == remote_commit.COMMITTED
    client = s3.client()
    for step in (1, 2):
        meta = remote_commit.step_key(step, layout.METADATA_NAME)
        assert put_keys.count(meta) == 1, (step, put_keys)
        markers = {k.rsplit("/", 1)[1]: json.loads(client.get_object(Bucket=BUCKET, Key=k)["Body"].read())
                   for k in s3.keys(f"onemeta/{layout.step_dirname(step)}/{remote_commit.NODES_DIR}/")}
        assert sorted(markers) == ["ranks-0-0-1.json", "ranks-1-1-1.json"], markers
        assert layout.METADATA_NAME in markers["ranks-0-0-1.json"]["files"]
        assert layout.METADATA_NAME not in markers["ranks-1-1-1.json"]["files"]
        fetched = steps_mod.fetch_step(store, str(tmp_path / f"fetched{step}"), step)  # each file verified
        assert fetched == set(layout.read_manifest(os.path.join(a, layout.step_dirname(step))).files), fetched
    # A damaged remote .metadata is put back from the node that does not upload it.
    client.put_object(Bucket=BUCKET, Key=f"onemeta/{remote_commit.step_key(2, layout.METADATA_NAME)}", Body=b"x")
    result = push(store, b, 2, node="b", policy=None, verify_remote=True)
    assert result.state == remote_commit.COMMITTED and layout.METADATA_NAME in result.detail, result
    steps_mod.fetch_step(store, str(tmp_path / "fetched2-again"), 2)
    store.close()


def test_local_retention_keeps_unuploaded_steps_unless_disk_nearly_full(tmp_path, monkeypatch, caplog):
    local_dir = tmp_path / "local"
    save_local_steps(local_dir, [1, 2])
    url = f"file://{tmp_path / 'nfs'}"
    ckpt = shardckpt.Checkpointer(local_dir=str(local_dir), remote=url, uploader="external", drain_timeout_s=0.5,
                                  preemption_signals=())
    assert ckpt._deletable(1) is False
    remote_commit.mark_uploaded(str(local_dir / layout.step_dirname(1)), url,
                                layout.read_manifest(str(local_dir / layout.step_dirname(1))))
    assert ckpt._deletable(1) is True

    import collections

    from shardckpt import checkpointer

    Usage = collections.namedtuple("Usage", "total used free")
    monkeypatch.setattr(checkpointer.shutil, "disk_usage", lambda path: Usage(1 << 30, 1 << 30, 0))
    with caplog.at_level("WARNING", logger="shardckpt"):
        assert ckpt._deletable(2) is True
    assert "NOT yet committed" in caplog.text and "local step 2" in caplog.text
    monkeypatch.undo()
    ckpt.close()
    assert ckpt.status()["drain"]["pending_steps"] == [2]


def test_share_plan_gives_each_chunk_to_one_node_spread_by_bytes():
    """Read once: every chunk some node lacks is fetched by exactly one node (a holder when there
    is one), the fetched bytes are even across the nodes, and every node gets what it reads."""
    chunk = 1024
    files = {n: layout.FileEntry(size=size, checksum="", rank=0,
                                 chunks=f"xxh3-64:{chunk}:" + "0" * 16 * (-(-size // chunk)))
             for n, size in (("a", 12 * chunk), ("b", 3 * chunk + 100))}
    every = set(range(12))
    wants = [{"a": set(every), "b": {0, 3}}, {"a": set(every)}, {"a": set(every), "b": {3}}]
    holds = [{}, {}, {"a": {11}}]
    plan = ranged.share_plan(wants, holds, files)
    owners: dict[tuple[str, int], list[int]] = {}
    for c, part in enumerate(plan):
        for name, indices in part["fetch"].items():
            for i in indices:
                owners.setdefault((name, i), []).append(c)
    assert set(owners) == {("a", i) for i in every} | {("b", 0), ("b", 3)}
    assert all(len(v) == 1 for v in owners.values()), owners
    assert owners[("b", 0)] == [0]  # wanted by one node only: that node
    assert owners[("a", 11)] == [2]  # already held there: passed on, not fetched again
    fetched = [sum(min(files[n].size, (i + 1) * chunk) - i * chunk for n, idx in part["fetch"].items() for i in idx
                   if i not in holds[c].get(n, ())) for c, part in enumerate(plan)]
    assert max(fetched) - min(fetched) <= 2 * chunk, fetched
    for c, part in enumerate(plan):
        got = {(n, i) for n, idx in part["fetch"].items() for i in idx}
        for src, chunks in part["recv"].items():
            assert plan[src]["send"][c] == chunks
            got |= {(n, i) for n, idx in chunks.items() for i in idx}
        assert ({(n, i) for n, idx in wants[c].items() for i in idx}
                <= got | {(n, i) for n, idx in holds[c].items() for i in idx})
