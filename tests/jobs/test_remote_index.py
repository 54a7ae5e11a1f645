"""Finding the newest remote step and retention cost O(1) manifest reads, whatever the steps held.

Against the real moto S3 server; the requests are counted with botocore's
event hooks on the store's own client (tests/remote_history.py).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from faultproxy import FaultProxy  # noqa: E402
from remote_history import RequestLog, clone_steps  # noqa: E402
from s3server import BUCKET, reset_if_used  # noqa: E402
from test_remote import _opts, save_local_steps  # noqa: E402

import shardckpt  # noqa: E402
from shardckpt import stores
from shardckpt.format import layout
from shardckpt.format.retention import KeepLast  # noqa: E402
from shardckpt.node import uploader  # noqa: E402
from shardckpt.remote import commit as remote_commit
from shardckpt.remote import index as remote_index
from shardckpt.remote import listing as remote_listing

HELD = 50


@pytest.fixture(autouse=True)
def fresh_bucket(request):
    reset_if_used(request)


def index_steps(s3, prefix: str) -> list[int]:
    body = s3.client().get_object(Bucket=BUCKET, Key=f"{prefix}/{remote_index.INDEX_NAME}")["Body"].read()
    return sorted(int(s) for s in json.loads(body)["steps"])


def one_real_step(tmp_path: Path, prefix: str) -> tuple[Path, stores.Store]:
    """Step 1 saved and committed by the uploader on ``prefix``; the local directory and a store."""
    url = f"s3://{BUCKET}/{prefix}"
    local_dir = tmp_path / "local"
    save_local_steps(local_dir, [1])
    assert uploader.Uploader(str(local_dir), stores.open_store(url, _opts()), node="n0", once=True,
                             poll_s=0.05).run() == 0
    return local_dir, stores.open_store(url, _opts())


@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_newest_step_and_retention_read_o1_manifests_with_50_steps_held(s3, tmp_path):
    local_dir, store = one_real_step(tmp_path, "held")
    assert index_steps(s3, "held") == [1]  # the commit wrote its entry
    clone_steps(store, 1, list(range(2, HELD + 1)))  # committed, but not in the index
    log = RequestLog(store)
    deadline = stores.Deadline(60)

    # Committed steps missing from the index are found (their manifests read once); a reader does
    # not write the index, the committer's survey does.
    infos, bad = remote_listing.remote_infos(store, deadline)
    assert sorted(infos) == list(range(1, HELD + 1)) and bad == {}
    assert log.manifest_gets == HELD - 1
    assert index_steps(s3, "held") == [1]
    remote_index.survey(store, deadline, write_back=True)
    assert index_steps(s3, "held") == list(range(1, HELD + 1))

    # From then on: one listing, the index, and the head's manifest.
    log.clear()
    infos, _bad = remote_listing.remote_infos(store, deadline)
    assert max(infos) == HELD and infos[HELD][4] != infos[HELD - 1][4]  # versions kept apart
    assert log.manifest_gets <= 1, log.gets
    assert log.kinds["LIST"] == 1 and log.requests() <= 4, log.kinds

    log.clear()
    assert remote_listing.remote_steps(store, deadline) == list(range(1, HELD + 1))  # an uploader's start
    assert log.kinds["HEAD"] == 0 and log.manifest_gets <= 1, (log.kinds, log.gets)

    log.clear()
    doomed = remote_listing.apply_remote_retention(store, KeepLast(HELD - 10), deadline)
    assert doomed == list(range(1, 11))
    assert log.manifest_gets <= 1, log.gets
    assert index_steps(s3, "held") == list(range(11, HELD + 1))
    assert remote_listing.remote_steps(store, deadline) == list(range(11, HELD + 1))

    # A commit through the uploader (of a new branch: nothing was loaded, so retention counts it alone):
    # it adds its entry, and its retention pass reads no manifest of the steps held.
    time.sleep(0.01)
    save_local_steps(local_dir, [HELD + 1])
    up = uploader.Uploader(str(local_dir), store, node="n0", once=True, poll_s=0.05, policy=KeepLast(1))
    log.clear()
    assert up.run() == 0
    assert index_steps(s3, "held") == list(range(11, HELD + 2))
    assert log.manifest_gets <= 2, log.gets  # the committed step's own manifest (read before it is replaced)


@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_a_missing_stale_or_corrupt_index_is_repaired(s3, tmp_path):
    _local_dir, store = one_real_step(tmp_path, "stale")
    clone_steps(store, 1, [2, 3, 4, 5])
    deadline = stores.Deadline(60)
    client = s3.client()
    index_key = f"stale/{remote_index.INDEX_NAME}"

    # Missing: rebuilt from the manifests (written by the committer's survey, never a reader's).
    def remote_infos(store, deadline):
        infos, bad = remote_index.survey(store, deadline, write_back=True)
        return {s: i.to_json() for s, i in infos.items()}, bad

    assert sorted(remote_infos(store, deadline)[0]) == [1, 2, 3, 4, 5]
    client.delete_object(Bucket=BUCKET, Key=index_key)
    assert sorted(remote_infos(store, deadline)[0]) == [1, 2, 3, 4, 5]
    assert index_steps(s3, "stale") == [1, 2, 3, 4, 5]

    # Corrupt: rebuilt.
    client.put_object(Bucket=BUCKET, Key=index_key, Body=b"{not json")
    assert sorted(remote_infos(store, deadline)[0]) == [1, 2, 3, 4, 5]
    assert index_steps(s3, "stale") == [1, 2, 3, 4, 5]

    # Stale: the newest step's manifest is gone (un-committed behind the index's back): not a step.
    client.delete_object(Bucket=BUCKET, Key=f"stale/{layout.step_dirname(5)}/{layout.MANIFEST_NAME}")
    infos, _bad = remote_infos(store, deadline)
    assert sorted(infos) == [1, 2, 3, 4]
    assert index_steps(s3, "stale") == [1, 2, 3, 4]

    # Stale: the newest step was replaced by another save: the index takes the manifest's version.
    before = remote_infos(store, deadline)[0][4][4]
    clone_steps(store, 1, [4])
    log = RequestLog(store)
    after = remote_infos(store, deadline)[0]
    assert after[4][4] != before
    assert log.manifest_gets == 2  # step 4's, and step 5's (a directory without a manifest is looked at)
    assert json.loads(client.get_object(Bucket=BUCKET, Key=index_key)["Body"].read())["steps"]["4"][4] == after[4][4]

    # Stale: a deleted step directory drops its entry without reading anything of it.
    client.delete_objects(Bucket=BUCKET,
                          Delete={"Objects": [{"Key": k} for k in s3.keys(f"stale/{layout.step_dirname(2)}/")]})
    assert sorted(remote_infos(store, deadline)[0]) == [1, 3, 4]
    assert index_steps(s3, "stale") == [1, 3, 4]

    # An unreadable manifest of a step outside the index is reported, never listed as a step.
    client.put_object(Bucket=BUCKET, Key=f"stale/{layout.step_dirname(9)}/{layout.MANIFEST_NAME}", Body=b"\xff")
    infos, bad = remote_infos(store, deadline)
    assert sorted(infos) == [1, 3, 4] and list(bad) == [9] and "step" in bad[9]


@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_an_older_step_committing_late_stays_retired_and_readers_never_write_the_index(s3, tmp_path):
    """Steps waiting for a slow node are polled most-due first: step 1 may be ready after 2 and 3
    committed. Its commit must not bring it back past retention; and a reader's survey (another
    node's uploader, a restore) repairs in memory only: it cannot write back a step retired after
    it read the index."""
    url = f"s3://{BUCKET}/late"
    local_dir = tmp_path / "local"
    save_local_steps(local_dir, [1, 2, 3])
    store = stores.open_store(url, _opts())
    deadline = stores.Deadline(60)

    def push(step: int) -> str:
        return remote_commit.push_step(store, str(local_dir), step, node="n0", policy=KeepLast(2)).state

    assert push(2) == remote_commit.COMMITTED and push(3) == remote_commit.COMMITTED
    assert push(1) == remote_commit.SUPERSEDED
    assert remote_listing.remote_steps(store, deadline) == [2, 3] and index_steps(s3, "late") == [2, 3]
    assert not s3.keys(f"late/{layout.step_dirname(1)}/{layout.MANIFEST_NAME}")

    # The index lost an entry: readers find the step from its manifest and write nothing.
    s3.client().put_object(Bucket=BUCKET, Key=f"late/{remote_index.INDEX_NAME}",
                           Body=json.dumps({"format": remote_index.INDEX_FORMAT, "steps": {}}).encode())
    log = RequestLog(store)
    assert remote_listing.remote_steps(store, deadline) == [2, 3]
    assert sorted(remote_listing.remote_infos(store, deadline)[0]) == [2, 3]
    assert log.kinds["PUT"] == 0, log.kinds
    assert index_steps(s3, "late") == []
    # The committer's next pass writes the repair.
    remote_listing.apply_remote_retention(store, KeepLast(2), deadline)
    assert index_steps(s3, "late") == [2, 3]


@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_a_listing_that_lags_behind_the_commit_never_resumes_the_older_step(s3, tmp_path):
    """An S3-compatible store that lists a new prefix late (GET and HEAD see it at once).

    Step 2 is committed, then the listing stops showing it (a proxy in front of moto leaves
    it out of every listing: what a store whose listing lags shows right after the commit).
    The commit's index write and a retention pass keep its entry, and a restore on an empty
    disk resumes step 2, not step 1 (resuming 1 would let the run save 2 again over the
    committed step it never saw).
    """
    proxy = FaultProxy(s3.endpoint)
    try:
        url = f"s3://{BUCKET}/lag"
        opts = _opts(endpoint_url=proxy.endpoint)
        local_dir = tmp_path / "local"
        saved = save_local_steps(local_dir, [1, 2])
        assert uploader.Uploader(str(local_dir), stores.open_store(url, _opts()), node="n0", once=True,
                                 poll_s=0.05).run() == 0  # committed (straight to the server)
        proxy.unlisted = (f"{BUCKET}/lag/{layout.step_dirname(2)}/",)
        store = stores.open_store(url, opts)
        assert remote_index.step_dirs(store, stores.Deadline(60)) == [1]  # the listing lags behind the commit
        assert index_steps(s3, "lag") == [1, 2]
        manifest = layout.read_manifest(str(local_dir / layout.step_dirname(2)))
        remote_index.record(store, manifest, stores.Deadline(60))  # the commit's index write
        assert index_steps(s3, "lag") == [1, 2]
        remote_listing.apply_remote_retention(store, KeepLast(5), stores.Deadline(60))
        assert index_steps(s3, "lag") == [1, 2]  # the committer's retention pass keeps it too

        model = torch.nn.Linear(64, 64)
        with shardckpt.Checkpointer(local_dir=str(tmp_path / "fresh"), remote=url, endpoint_url=proxy.endpoint,
                                    uploader="off", preemption_signals=()) as ckpt:
            assert ckpt.load({"model": model}) == 2
        for name, value in saved[2].items():
            assert torch.equal(model.state_dict()[name], value), name

        # A step really gone (its manifest deleted under an index entry) is dropped all the same.
        s3.client().delete_object(Bucket=BUCKET, Key=f"lag/{layout.step_dirname(2)}/{layout.MANIFEST_NAME}")
        infos, _bad = remote_index.survey(store, stores.Deadline(60), write_back=True)
        assert sorted(infos) == [1] and index_steps(s3, "lag") == [1]
        store.close()
    finally:
        proxy.stop()


@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_a_restore_on_an_empty_disk_reads_the_steps_manifest_once(s3, tmp_path):
    """The survey reads the newest step's manifest (to check the index's entry); the fetch that follows
    takes that one rather than reading it again: one manifest GET per node per restore (the
    2- and 4-node counts are in benchmarks/bench_need_only.py)."""
    local_dir, store = one_real_step(tmp_path, "once")
    store.close()
    saved = save_local_steps(local_dir, [2])
    assert uploader.Uploader(str(local_dir), stores.open_store(f"s3://{BUCKET}/once", _opts()), node="n0", once=True,
                             poll_s=0.05).run() == 0
    proxy = FaultProxy(s3.endpoint)
    try:
        model = torch.nn.Linear(64, 64)
        with shardckpt.Checkpointer(local_dir=str(tmp_path / "fresh"), remote=f"s3://{BUCKET}/once",
                                    endpoint_url=proxy.endpoint, uploader="off", preemption_signals=()) as ckpt:
            assert ckpt.load({"model": model}) == 2
    finally:
        proxy.stop()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved[2].items())
    manifest_gets = [p for p, _n in proxy.got if p.endswith(f"/{layout.step_dirname(2)}/{layout.MANIFEST_NAME}")]
    assert len(manifest_gets) == 1, proxy.got
