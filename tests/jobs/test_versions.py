"""A step is a version, not a number: two saves can share a number, and neither may pass for the other.

Each test here is a path on which a decision used to be made by the step
number alone and lost or mixed committed state without an error: a node's
disk lost, a stale copy on a machine that comes back, a step saved again while
two nodes upload it, `adopt` after a rollback, a second run on the same
remote, a loop that saves lower numbers than it loaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import PROGRAMS, ROOT, child_env, run_torchrun, run_two_nodes
from s3server import BUCKET, reset_if_used, stop_uploaders

import shardckpt
from shardckpt import _failpoints, cli, stores
from shardckpt import steps as steps_mod  # noqa: E402
from shardckpt.format import layout, retention
from shardckpt.remote import commit as remote_commit
from shardckpt.remote import listing as remote_listing

PROG = PROGRAMS / "multinode.py"
ONE_SERVER = pytest.mark.parametrize("s3", ["moto"], indirect=True)


@pytest.fixture(autouse=True)
def fresh_bucket(request, tmp_path):
    reset_if_used(request)
    yield
    stop_uploaders(tmp_path, grace_s=30.0)


def tree_digest(root) -> dict[str, str]:
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def set(self, value: float) -> None:
        with torch.no_grad():
            for p in self.parameters():
                p.fill_(value)

    def value(self) -> float:
        return float(self.lin.weight.detach()[0, 0])


def ckpt(local_dir, **kw) -> shardckpt.Checkpointer:
    kw.setdefault("preemption_signals", ())
    return shardckpt.Checkpointer(local_dir=str(local_dir), **kw)


def save_values(c: shardckpt.Checkpointer, net: Net, steps_values) -> None:
    for step, value in steps_values:
        net.set(value)
        c.save({"model": net}, step).wait()


# ------------------------------------------------------------ 1. a lost node


def test_a_lost_nodes_disk_makes_every_rank_raise_and_start_fresh_keeps_the_survivors_steps(tmp_path):
    """Node-local directories, no remote, no peer replicas: node 1's disk is gone and the job is relaunched."""
    base, out = tmp_path / "nvme", tmp_path / "out"
    out.mkdir()
    env = child_env(SHARDCKPT_PEER_REPLICAS="0")  # no copy of node 1's files anywhere
    run_two_nodes(1, PROG, "save", base, out, "--layout", "local", "--steps", "3", log_dir=tmp_path, env=env)
    before = tree_digest(base / "node0")

    # First, the job stopped between the two copies' commits of step 3: node 1 holds only that
    # save's partial directory (as the commit path leaves it, manifest written, not renamed).
    # That step never committed everywhere: the relaunch resumes step 2, not an error.
    step3 = base / "node1" / layout.step_dirname(3)
    nonce, count = layout.read_manifest(str(step3)).save_id.rsplit("-", 1)
    partial = base / "node1" / layout.partial_dirname(3, f"{count}-{nonce}")
    step3.rename(partial)
    out1 = tmp_path / "out1"
    out1.mkdir()
    logs = run_two_nodes(1, PROG, "resume", base, out1, "--layout", "local", "--no-fresh", log_dir=tmp_path, env=env)
    assert [json.loads((out1 / f"outcome.{r}.json").read_text()) for r in range(2)] == [{"restored": 2}] * 2
    assert "committed on some nodes only" in logs[0]

    # Then node 1's disk is gone.
    shutil.rmtree(base / "node1")

    out2 = tmp_path / "out2"
    out2.mkdir()
    logs = run_two_nodes(1, PROG, "resume", base, out2, "--layout", "local", log_dir=tmp_path, env=env)
    results = [json.loads((out2 / f"outcome.{r}.json").read_text()) for r in range(2)]
    for r, res in enumerate(results):
        error = res.get("error", "")
        assert error.startswith("CheckpointNotFoundError"), (r, res)  # every rank raised, nothing was loaded
        assert "step 3" in error and "cannot be assembled" in error and "rank(s) 1" in error, error
        assert "__1_0.distcp" in error, error  # the files that are missing
        assert "start_fresh=True" in error and "load(state, step=N)" in error, error
    # start_fresh=True is the deliberate new start: it loads nothing and saves 1 and 2 ...
    # (node 0 still lists the old step 3: kept, abandoned by the new history)
    assert ([(res["fresh_restored"], res["fresh_steps"]) for res in results]
            == [(None, [1, 2, 3]), (None, [1, 2])]), results
    # Starting fresh while committed steps exist is said at WARNING, naming them and why none is resumed.
    assert "WARNING shardckpt: committed steps exist" in logs[0] and "step 3 (not complete on every rank" in logs[0]
    # ... and every committed file of the surviving node is still there, byte for byte: the
    # earlier saves of steps 1 and 2 were set aside, never replaced.
    after = tree_digest(base / "node0")
    kept = {}
    for rel, digest in after.items():
        top = rel.split(os.sep)[0]
        if top.startswith(layout.KEPT_PREFIX):
            kept[os.path.join(top[len(layout.KEPT_PREFIX):].split("-")[0], *rel.split(os.sep)[1:])] = digest
    for rel, digest in before.items():
        if rel.startswith(layout.step_dirname(3)):
            assert after[rel] == digest, rel
        elif rel.startswith("step_"):
            assert kept[rel] == digest, rel


@ONE_SERVER
@pytest.mark.parametrize("damage", ["tampered", "unreadable"])
def test_a_remote_step_that_cannot_be_used_is_an_error_not_a_fresh_start(s3, tmp_path, damage, caplog):
    url = f"s3://{BUCKET}/damaged"
    net = Net()
    with ckpt(tmp_path / "a", remote=url, drain_timeout_s=60) as c:
        save_values(c, net, [(1, 1.0), (2, 2.0)])
    key = f"damaged/{layout.step_dirname(2)}/{layout.MANIFEST_NAME}"
    client = s3.client()
    body = json.loads(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    if damage == "tampered":
        body["files"]["../../escape"] = body["files"].pop(".metadata")
        data = json.dumps(body).encode()
    else:
        data = b"\x00not a manifest"
    client.put_object(Bucket=BUCKET, Key=key, Body=data)

    fresh = Net()
    fresh.set(0.0)
    with ckpt(tmp_path / "empty", remote=url, uploader="off") as c:
        with pytest.raises(shardckpt.CorruptCheckpointError, match="step 2") as err:
            c.load({"model": fresh})
    assert "damaged/step_0000000002" in str(err.value) and "Remedy" in str(err.value)
    assert fresh.value() == 0.0  # nothing of step 2 was applied
    # With on_corrupt="fallback": the older readable step, said in a warning.
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        with ckpt(tmp_path / "empty2", remote=url, uploader="off", on_corrupt="fallback") as c:
            assert c.load({"model": fresh}) == 1
    assert fresh.value() == 1.0
    assert "step 2 failed verification, falling back" in caplog.text


# ------------------------------------------------------------ 2. a stale local copy


@ONE_SERVER
def test_a_stale_local_copy_never_beats_the_live_version(s3, tmp_path, caplog, capsys):
    url = f"s3://{BUCKET}/stale"
    net = Net()
    opts = dict(remote=url, drain_timeout_s=60, keep_last=None)
    with ckpt(tmp_path / "machine-a", **opts) as a:  # machine A: steps 1-3
        save_values(a, net, [(1, 1.0), (2, 2.0), (3, 3.0)])
    stale = layout.version_of(layout.read_manifest(str(tmp_path / "machine-a" / layout.step_dirname(2))))
    with ckpt(tmp_path / "machine-b", **opts) as b:  # machine B, empty disk: rolls back to 1, saves 2 again
        assert b.load({"model": net}, step=1) == 1
        save_values(b, net, [(2, 20.0)])
    # A comes back with its old disk: the live version of step 2 is B's, and its bytes are what A restores.
    back = Net()
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        with ckpt(tmp_path / "machine-a", **opts) as a:
            assert a.load({"model": back}) == 2
            assert back.value() == 20.0  # B's save of step 2, not A's stale 2.0 beside it
            save_values(a, back, [(4, 40.0)])
    assert "kept aside" in caplog.text
    # What it loaded was B's 20.0, and its stale step 2 is kept aside, not read as the step.
    local2 = layout.read_manifest(str(tmp_path / "machine-a" / layout.step_dirname(2)))
    with ckpt(tmp_path / "machine-c", remote=url, uploader="off") as c:
        check = Net()
        assert c.load({"model": check}, step=2) == 2 and check.value() == 20.0
    remote2 = remote_commit.remote_manifest(stores.open_store(url), 2, stores.Deadline(30))
    assert layout.version_of(local2) == layout.version_of(remote2)
    kept = [n for n in os.listdir(tmp_path / "machine-a") if n.startswith(layout.KEPT_PREFIX)]
    assert kept and kept[0].startswith(f"{layout.KEPT_PREFIX}{layout.step_dirname(2)}-"), kept
    # What was kept aside is A's own earlier save, whole: nothing of it was mixed into the live step.
    aside = layout.read_manifest(str(tmp_path / "machine-a" / kept[0]))
    assert layout.version_of(aside) == stale != layout.version_of(local2)
    layout.verify_files(str(tmp_path / "machine-a" / kept[0]), aside)
    # `ls` lists it and `gc` (the remedy the log names) removes it; the live steps stay.
    capsys.readouterr()
    assert cli.main(["ls", str(tmp_path / "machine-a")]) == 0
    assert "kept aside" in capsys.readouterr().out
    assert cli.main(["gc", str(tmp_path / "machine-a"), "--keep-last", "10"]) == 0
    assert not [n for n in os.listdir(tmp_path / "machine-a") if n.startswith(layout.KEPT_PREFIX)]
    assert 2 in layout.committed_steps(str(tmp_path / "machine-a"))
    # The history A continued is B's branch: step 3 (before the rollback) is abandoned.
    with ckpt(tmp_path / "machine-d", remote=url, uploader="off") as d:
        assert d.load({"model": check}) == 4 and check.value() == 40.0


# ------------------------------------------------------------ 3. a step saved again while two nodes upload it


@ONE_SERVER
def test_a_step_saved_again_while_two_nodes_upload_it_is_never_committed_mixed(s3, tmp_path):
    base, out, out2 = tmp_path / "nvme", tmp_path / "out", tmp_path / "out2"
    out.mkdir()
    out2.mkdir()
    # Two directory copies (one per rank, as two nodes have), steps 4 and 5; uploads by hand below.
    run_torchrun(2, PROG, "save", base, out, "--layout", "rank", "--steps", "5")
    url = f"s3://{BUCKET}/mixed"
    store = stores.open_store(url)
    one = retention.policy_from(1, None)
    node_a, node_b = str(base / "rank0"), str(base / "rank1")  # A holds rank 0's file: it commits
    for step in (1, 2, 3, 4):
        assert remote_commit.push_step(store, node_b, step, node="b", policy=one).state == remote_commit.WAITING
        assert remote_commit.push_step(store, node_a, step, node="a", policy=one).state == remote_commit.COMMITTED
    assert remote_commit.push_step(store, node_b, 5, node="b", policy=one).state == remote_commit.WAITING
    first = layout.read_manifest(os.path.join(node_a, layout.step_dirname(5)))

    def saved_again_and_uploaded_by_b() -> None:
        # Between A's check of the node markers and its commit: the job rolls back to 4 and
        # saves 5 again, and B uploads the new save's objects over the same keys.
        run_torchrun(2, PROG, "resave", base, out2, "--layout", "rank", "--steps", "5")
        assert remote_commit.push_step(store, node_b, 5, node="b", policy=one).state == remote_commit.WAITING

    _failpoints.arm("upload.markers_checked", saved_again_and_uploaded_by_b)
    try:
        result = remote_commit.push_step(store, node_a, 5, node="a", policy=one)
    finally:
        _failpoints._SPEC.pop("upload.markers_checked", None)
    second = layout.read_manifest(os.path.join(node_a, layout.step_dirname(5)))
    assert layout.version_of(first) != layout.version_of(second)
    deadline = stores.Deadline(30)
    # A's pass did not commit its manifest over B's objects, and retention did not run on it:
    # the previous step is still there, whole.
    assert result.state == remote_commit.WAITING and "another save" in result.detail, result
    assert remote_commit.remote_manifest(store, 5, deadline) is None
    assert remote_commit.remote_manifest(store, 4, deadline) is not None
    # The next passes commit the new save, every object its own.
    remote_commit.push_step(store, node_b, 5, node="b", policy=one)
    assert remote_commit.push_step(store, node_a, 5, node="a", policy=one).state == remote_commit.COMMITTED
    committed = remote_commit.remote_manifest(store, 5, deadline)
    assert layout.version_of(committed) == layout.version_of(second)
    fetched = tmp_path / "fetched"
    steps_mod.fetch_step(store, str(fetched), 5)  # every file checked against the manifest
    subprocess.run([sys.executable, str(PROGRAMS / "single_restore.py"), str(fetched), str(out2 / "restored.pt")],
                   env=child_env(), check=True, cwd=str(ROOT), timeout=120)
    saved, restored = torch.load(out2 / "saved.pt"), torch.load(out2 / "restored.pt")
    assert restored["step"] == 5
    for key, value in saved["tensors"].items():
        assert torch.equal(value, restored["tensors"][key]), key

    # Later: B's upload of yet another save lands after A's commit has passed both its checks
    # (B started while the step was not committed). B's own check after its uploads withdraws
    # that commit: a step never stays committed with an object of another save.
    out3, out4, base4 = tmp_path / "out3", tmp_path / "out4", tmp_path / "nvme4"
    out3.mkdir()
    out4.mkdir()
    run_torchrun(2, PROG, "resave", base, out3, "--layout", "rank", "--steps", "5")  # a third save, both nodes
    assert remote_commit.push_step(store, node_b, 5, node="b", policy=one).state == remote_commit.WAITING
    assert remote_commit.push_step(store, node_a, 5, node="a", policy=one).state == remote_commit.WAITING  # retired
    assert remote_commit.push_step(store, node_b, 5, node="b", policy=one).state == remote_commit.WAITING
    third = layout.read_manifest(os.path.join(node_a, layout.step_dirname(5)))
    b_started, b_go, b_result = threading.Event(), threading.Event(), []

    def fourth_save_starts_uploading_on_b() -> None:
        # B's node saves 5 a fourth time (its own disk only: A's save of it has not landed yet)
        # and B's uploader starts; it is held after its check that the step is not committed.
        shutil.copytree(base, base4)
        run_torchrun(2, PROG, "resave", base4, out4, "--layout", "rank", "--steps", "5", "--seed", "1")

        def hold() -> None:
            b_started.set()
            b_go.wait(120)

        _failpoints.arm("upload.checked_remote", hold)
        thread = threading.Thread(target=lambda: b_result.append(
            remote_commit.push_step(store, str(base4 / "rank1"), 5, node="b", policy=None)))
        thread.start()
        b_started.wait(120)
        b_threads.append(thread)

    def b_uploads_land() -> None:
        b_go.set()
        b_threads[0].join(120)

    b_threads: list[threading.Thread] = []
    _failpoints.arm("upload.markers_checked", fourth_save_starts_uploading_on_b)
    _failpoints.arm("upload.identity_confirmed", b_uploads_land)
    try:
        result = remote_commit.push_step(store, node_a, 5, node="a", policy=one)
    finally:
        for name in ("upload.markers_checked", "upload.checked_remote", "upload.identity_confirmed"):
            _failpoints._SPEC.pop(name, None)
    # A committed the third save (its checks passed), then B's objects of the fourth landed and
    # B withdrew that commit: no manifest, and its step record alone does not count.
    assert result.state == remote_commit.COMMITTED, result
    assert b_result and b_result[0].state == remote_commit.WAITING, b_result
    assert remote_commit.remote_manifest(store, 5, deadline) is None
    assert remote_listing.committed_record(store, 5, deadline) is None
    # The fourth save commits once A's node has it too; every object is its own.
    fourth = layout.read_manifest(str(base4 / "rank0" / layout.step_dirname(5)))
    assert layout.version_of(fourth) not in (layout.version_of(third), layout.version_of(second))
    assert (remote_commit.push_step(store, str(base4 / "rank0"), 5, node="a", policy=one).state
            == remote_commit.COMMITTED)
    assert layout.version_of(remote_commit.remote_manifest(store, 5, deadline)) == layout.version_of(fourth)
    steps_mod.fetch_step(store, str(tmp_path / "fetched4"), 5)
    store.close()


# ------------------------------------------------------------ 4. adopt after a rollback


def test_adopt_after_a_rollback_joins_the_live_branch(tmp_path, capsys):
    root = tmp_path / "ck"
    net = Net()
    with ckpt(root, keep_last=None) as c:
        save_values(c, net, [(100, 1.0), (200, 2.0), (300, 3.0)])
    with ckpt(root, keep_last=None) as c:
        assert c.load({"model": net}, step=100) == 100
        save_values(c, net, [(110, 11.0), (120, 12.0), (130, 13.0)])
    stock = tmp_path / "stock"
    net.set(50.0)
    dcp.save({"model": net.state_dict()}, storage_writer=dcp.FileSystemWriter(str(stock)), no_dist=True)
    assert cli.main(["adopt", str(stock), "--into", str(root), "--step", "140"]) == 0
    fresh = Net()
    with ckpt(root) as c:
        assert c.load({"model": fresh}) == 140  # not the abandoned 300
    assert fresh.value() == 50.0
    capsys.readouterr()
    assert cli.main(["gc", str(root), "--keep-last", "10", "--dry-run"]) == 0
    said = capsys.readouterr().out
    doomed = sorted(int(line.split()[3]) for line in said.splitlines() if line.startswith("would delete step"))
    assert doomed == [200, 300], said


# ------------------------------------------------------------ 5. another run on the same remote


@ONE_SERVER
def test_a_run_that_saves_without_loading_never_takes_over_another_runs_remote_steps(s3, tmp_path, capsys):
    url = f"s3://{BUCKET}/shared-prefix"
    net = Net()
    opts = dict(remote=url, drain_timeout_s=60, keep_last=None)
    with ckpt(tmp_path / "run-a", **opts) as a:
        save_values(a, net, [(1, 1.0), (2, 2.0)])
    # Run B: an empty local_dir, the same remote, saves without loading: refused.
    b = ckpt(tmp_path / "run-b", **opts)
    with pytest.raises(shardckpt.ConfigError, match="already holds committed steps") as err:
        b.save({"model": net}, 1)
    b.close()
    assert "shared-prefix" in str(err.value) and "load(state)" in str(err.value) and "start_fresh" in str(err.value)
    capsys.readouterr()
    assert cli.main(["ls", url, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [row["step"] for row in listed["steps"]] == [1, 2]
    with pytest.raises(shardckpt.ConfigError, match="already holds committed steps"):
        with ckpt(tmp_path / "run-b", **opts) as b:  # refused again, not only once
            b.save({"model": net}, 1)

    # Two instances of one job on the same prefix: both resume step 2 and save 3. The first
    # commits; the second's uploader refuses to replace it and says why.
    one = ckpt(tmp_path / "instance-1", **opts)
    two = ckpt(tmp_path / "instance-2", remote=url, drain_timeout_s=8, keep_last=None)
    net_two = Net()
    assert one.load({"model": net}) == 2 and two.load({"model": net_two}) == 2
    save_values(one, net, [(3, 30.0)])
    one.close()
    save_values(two, net_two, [(3, 31.0)])
    try:
        two.close()
    except Exception:  # noqa: BLE001 - the drain may report the refused upload
        pass
    log = (tmp_path / "instance-2" / ".shardckpt-remote" / "uploader.log").read_text()
    assert "committed by another save" in log and "two instances" in log, log[-3000:]
    stop_uploaders(tmp_path / "instance-2")  # it would retry that step for as long as it runs
    with ckpt(tmp_path / "check", remote=url, uploader="off") as c:
        check = Net()
        assert c.load({"model": check}) == 3 and check.value() == 30.0

    # The remedy it names: start_fresh=True starts a new history there deliberately.
    with ckpt(tmp_path / "run-b2", start_fresh=True, **opts) as b:
        save_values(b, Net(), [(7, 7.0)])
    with ckpt(tmp_path / "check-b", remote=url, uploader="off") as c:
        assert c.load({"model": check}) == 7 and check.value() == 7.0
    with ckpt(tmp_path / "check-a", remote=url, uploader="off") as c:  # run A's steps are still there
        assert c.load({"model": check}, step=2) == 2 and check.value() == 2.0


@ONE_SERVER
def test_a_step_an_earlier_run_committed_late_is_superseded_by_the_run_that_resumed(s3, tmp_path):
    """The trainer died after saving step 3 locally; its node's uploader commits it only after a new
    instance resumed step 2 from the bucket. That orphan is replaced by the new run's step 3 (it was
    saved before the new run loaded: not another instance writing beside it)."""
    url = f"s3://{BUCKET}/orphan"
    net = Net()
    with ckpt(tmp_path / "old", remote=url, drain_timeout_s=60, keep_last=None) as a:
        save_values(a, net, [(1, 1.0), (2, 2.0)])
    from test_remote import wait_uploader_exit

    wait_uploader_exit(tmp_path / "old")  # gone (no trainer left), or it would commit step 3 at once
    with ckpt(tmp_path / "old", remote=url, uploader="off", keep_last=None) as a:  # its upload comes late
        assert a.load({"model": net}) == 2
        save_values(a, net, [(3, 3.0)])
    resumed = Net()
    b = ckpt(tmp_path / "new", remote=url, drain_timeout_s=60, keep_last=None)
    assert b.load({"model": resumed}) == 2
    assert cli.main(["push", "--local", str(tmp_path / "old"), "--remote", url]) == 0  # the orphan commits now
    save_values(b, resumed, [(3, 30.0)])
    b.close()
    with ckpt(tmp_path / "check", remote=url, uploader="off") as c:
        check = Net()
        assert c.load({"model": check}) == 3 and check.value() == 30.0
    log = (tmp_path / "new" / ".shardckpt-remote" / "uploader.log").read_text()
    assert "two instances" not in log, log[-3000:]


# ------------------------------------------------------------ issue 17.1: a lower step number than the head


def test_saving_lower_step_numbers_than_the_head_starts_a_branch_and_retention_keeps_them(tmp_path, caplog):
    root = tmp_path / "ck"
    net = Net()
    with ckpt(root, keep_last=3) as c:
        save_values(c, net, [(275, 1.0), (300, 2.0), (301, 3.0)])
    with caplog.at_level(logging.INFO, logger="shardckpt"):
        with ckpt(root, keep_last=3) as c:
            assert c.load({"model": net}) == 301
            save_values(c, net, [(25, 25.0), (50, 50.0), (75, 75.0), (100, 100.0)])
    said = caplog.text
    assert "step 25 is not above step 301" in said and "restore its step counter from load()" in said
    assert said.count("is not above step") == 1  # one warning, at the fork
    assert "retention removed step 25" in said  # each deletion is logged
    steps = layout.committed_steps(str(root))
    assert steps == [50, 75, 100, 275, 300, 301], steps  # the new branch's newest 3, the old kept
    fresh = Net()
    with ckpt(root) as c:
        assert c.load({"model": fresh}) == 100 and fresh.value() == 100.0
    _live, abandoned = cli.open_location(cli.build_parser().parse_args(["ls", str(root)])).live(
        {s: layout.read_manifest(str(root / layout.step_dirname(s))) for s in steps})
    assert sorted(abandoned) == [275, 300, 301]
