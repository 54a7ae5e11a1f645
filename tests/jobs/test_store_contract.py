"""One contract, every store: the same cases over each implementation of ``stores.base.Store``.

Stores under test: S3 through boto3 against moto's and rclone's S3 servers
(real HTTP on 127.0.0.1, one server per module), any fsspec URL
(``file://``), a local directory, a replica directory, and a running peer
daemon (one daemon process for the whole module; it serves committed steps
read-only, so its objects are seeded through the directory it serves, and the
write cases check that it refuses writes and deletions and keeps the bytes).

The cases: a missing object raises the one typed error everywhere, ranges at
the edges of an object, a checksum (or size) mismatch on a verified fetch
leaves nothing behind, deletion, and concurrent use from several threads.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from s3server import BUCKET, apply_env, restore_env, start_server

from shardckpt import stores
from shardckpt.errors import (
    CorruptCheckpointError,
    ObjectNotFoundError,
    ObjectRangeError,
    PeerStoreReadOnly,
)
from shardckpt.format import layout
from shardckpt.node import node_registry, peer_daemon
from shardckpt.stores import s3 as s3_module
from shardckpt.stores import tls
from shardckpt.stores.peer import PeerStore
from shardckpt.stores.peer_client import PeerClient

WRITABLE = ("moto", "rclone", "fsspec", "local", "replica")
KINDS = WRITABLE + ("peer",)
DEADLINE = stores.Deadline(120)
S = {n: layout.step_dirname(n) for n in range(10)}
"""Step directory names, as every tier spells them."""


class _Servers:
    """The module's S3 servers, each started on first use and stopped at the end."""

    def __init__(self) -> None:
        self.running: dict[str, object] = {}

    def get(self, kind: str):
        if kind not in self.running:
            self.running[kind] = start_server(kind)
        return self.running[kind]

    def stop(self) -> None:
        for server in self.running.values():
            server.stop()


@pytest.fixture(scope="module")
def servers():
    found = _Servers()
    try:
        yield found
    finally:
        found.stop()


class _PeerSeed:
    """What the peer daemon serves: committed steps in its local_dir, written here (manifest last)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def reset(self) -> None:
        for entry in self.root.iterdir():
            if layout.parse_step_dirname(entry.name) is not None:
                shutil.rmtree(entry)

    def __call__(self, key: str, data: bytes) -> None:
        step_name, _, name = key.partition("/")
        step_dir = self.root / layout.step_dirname(layout.parse_step_dirname(step_name))
        (step_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (step_dir / name).write_bytes(data)
        files = {}
        for path in sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != layout.MANIFEST_NAME):
            body = path.read_bytes()
            files[str(path.relative_to(step_dir))] = layout.FileEntry(len(body), layout.checksum_bytes(body), 0)
        manifest = layout.Manifest(step=layout.parse_step_dirname(step_name), world_size=1, files=files,
                                   save_id=uuid.uuid4().hex)
        layout.atomic_write_text(str(step_dir / layout.MANIFEST_NAME), manifest.to_json())


@pytest.fixture(scope="module")
def peer_daemon_addr(tmp_path_factory):
    """One peer daemon process for the module (the node daemon trainers start), serving a directory."""
    root = tmp_path_factory.mktemp("peer-node")
    # The daemon's own key pair (made in its state directory, as a trainer's first launch makes it) and one
    # for this process, a member of the same job: both certificates are pinned through peers.json.
    os.makedirs(node_registry.state_dir(str(root)), exist_ok=True)
    served = tls.node_identity(node_registry.state_dir(str(root)), "contract:0")
    member = tls.node_identity(str(tmp_path_factory.mktemp("peer-member-keys")), "member:0")
    trainer = node_registry.register_trainer(str(root))  # this process stands for the node's trainer
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from shardckpt.node.peer_daemon import peer_main; "
         "sys.exit(peer_main(sys.argv[1:]))", "--local", str(root), "--node", "contract:0", "--host", "127.0.0.1",
         "--linger", "900"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    status = Path(node_registry.state_dir(str(root))) / peer_daemon.STATUS_NAME
    try:
        deadline = time.monotonic() + 60
        addr = None
        while addr is None:
            if proc.poll() is not None:
                raise RuntimeError(f"the peer daemon exited: {proc.stderr.read().decode(errors='replace')[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("the peer daemon did not report its address within 60 s")
            body = json.loads(status.read_text()) if status.exists() else {}
            addr = body.get("addr") if body.get("pid") == proc.pid else None
            time.sleep(0.05)
        nodes = [{"node": "contract:0", "addr": addr, "domain": None, "cert": served.cert_pem},
                 {"node": "member:0", "addr": "127.0.0.1:9", "domain": None, "cert": member.cert_pem}]
        layout.atomic_write_text(os.path.join(node_registry.state_dir(str(root)), peer_daemon.PEERS_NAME), json.dumps(
            {"nodes": nodes, "replicas": 0, "keep_last": 2, "tls": served.to_json(), "written": "contract"}))
        while (json.loads(status.read_text()) if status.exists() else {}).get("peers_loaded") != "contract":
            if time.monotonic() > deadline:
                raise RuntimeError("the peer daemon did not load peers.json within 60 s")
            time.sleep(0.05)
        context = tls.client_context(member, [served.cert_pem])
        yield addr, _PeerSeed(root), context, served.fingerprint
    finally:
        node_registry.unregister_trainer(trainer)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


@pytest.fixture
def peer_store(peer_daemon_addr):
    addr, seed, context, served = peer_daemon_addr
    seed.reset()
    store = PeerStore(PeerClient(addr, context, expect=served))
    store.seed = seed
    return store


def _options() -> stores.TransferOptions:
    # A small ranged-download threshold makes get_file of the larger objects go through ranged GETs.
    return stores.TransferOptions(
        multipart_threshold=256 << 10, part_size=96 << 10, max_attempts=3, backoff_base_s=0.05, step_deadline_s=120
    )


@pytest.fixture(params=KINDS)
def store(request, servers, tmp_path):
    kind = request.param
    if kind in ("moto", "rclone"):
        server = servers.get(kind)
        server.reset()
        previous = apply_env(server)
        opened = stores.open_store(f"s3://{BUCKET}/contract", _options())
        try:
            yield opened
        finally:
            opened.close()
            restore_env(previous)
        return
    if kind == "fsspec":
        opened = stores.open_store(f"file://{tmp_path}/fsspec-root", _options())
    elif kind == "local":
        opened = stores.LocalDirStore(str(tmp_path / "local-root"))
    elif kind == "replica":
        opened = stores.ReplicaDirStore(str(tmp_path / "replicas" / "node-b"), "node-b")
    else:
        opened = request.getfixturevalue("peer_store")
    try:
        yield opened
    finally:
        opened.close()


def _put(store, key: str, data: bytes, tmp_path) -> None:
    """Store ``data`` under ``key`` (through the directory a read-only peer serves)."""
    seed = getattr(store, "seed", None)
    if seed is not None:
        seed(key, data)
        return
    store.put_bytes(key, data, DEADLINE)


def _writable(store) -> bool:
    return getattr(store, "seed", None) is None


def _blob(n: int, salt: int = 0) -> bytes:
    return bytes((i * 131 + salt) % 251 for i in range(n))


def test_an_object_reads_back_whole_and_listed(store, tmp_path):
    data = _blob(300 << 10)
    _put(store, f"{S[1]}/a.bin", data, tmp_path)
    _put(store, f"{S[1]}/sub/b.bin", b"bee", tmp_path)
    assert store.exists(f"{S[1]}/a.bin", DEADLINE)
    assert store.get_bytes(f"{S[1]}/a.bin", DEADLINE) == data
    assert store.list_sizes(S[1], DEADLINE) == {"a.bin": len(data), "sub/b.bin": 3}
    assert S[1] in store.list_dirs("", DEADLINE)
    checksum = layout.checksum_bytes(data)
    assert store.read_checksum(f"{S[1]}/a.bin", checksum, DEADLINE) == (len(data), checksum)
    dest = tmp_path / "fetched.bin"
    seen = []
    store.get_file(f"{S[1]}/a.bin", str(dest), len(data), checksum, DEADLINE, on_bytes=seen.append)
    assert dest.read_bytes() == data
    assert sum(seen) == len(data)


def test_a_missing_object_is_the_same_typed_error_everywhere(store, tmp_path):
    _put(store, f"{S[1]}/present.bin", b"here", tmp_path)
    with pytest.raises(ObjectNotFoundError) as info:
        store.get_range(f"{S[1]}/absent.bin", 0, 4, DEADLINE)
    assert "absent.bin" in str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    dest = tmp_path / "never.bin"
    with pytest.raises(ObjectNotFoundError):
        store.get_file(f"{S[1]}/absent.bin", str(dest), 4, layout.checksum_bytes(b"here"), DEADLINE)
    assert not dest.exists()
    with pytest.raises(ObjectNotFoundError):
        store.get_range(f"{S[9]}/absent.bin", 0, 0, DEADLINE)  # even an empty range is refused
    assert store.get_bytes(f"{S[1]}/absent.bin", DEADLINE) is None
    assert store.read_checksum(f"{S[1]}/absent.bin", layout.checksum_bytes(b""), DEADLINE) is None
    assert not store.exists(f"{S[1]}/absent.bin", DEADLINE)


def test_ranges_at_the_edges_of_an_object(store, tmp_path):
    data = _blob(1000, salt=7)
    _put(store, f"{S[2]}/r.bin", data, tmp_path)
    assert store.get_range(f"{S[2]}/r.bin", 0, 1000, DEADLINE) == data
    assert store.get_range(f"{S[2]}/r.bin", 0, 1, DEADLINE) == data[:1]
    assert store.get_range(f"{S[2]}/r.bin", 999, 1, DEADLINE) == data[999:]
    assert store.get_range(f"{S[2]}/r.bin", 500, 0, DEADLINE) == b""
    assert store.get_range(f"{S[2]}/r.bin", 123, 456, DEADLINE) == data[123:579]
    for offset, length in ((999, 2), (1000, 1), (0, 1001)):
        with pytest.raises(ObjectRangeError) as info:
            store.get_range(f"{S[2]}/r.bin", offset, length, DEADLINE)
        assert "1000 bytes" in str(info.value)


def test_a_verified_fetch_refuses_a_checksum_or_size_mismatch_and_leaves_nothing(store, tmp_path):
    for n in (10 << 10, 300 << 10):  # one request, and ranged parts on the network stores
        data = _blob(n, salt=3)
        key = f"{S[3]}/m{n}.bin"
        _put(store, key, data, tmp_path)
        dest = tmp_path / f"m{n}.bin"
        wrong = layout.checksum_bytes(data[:-1] + bytes([data[-1] ^ 1]))
        with pytest.raises(CorruptCheckpointError):
            store.get_file(key, str(dest), n, wrong, DEADLINE)
        assert not dest.exists()
        with pytest.raises(CorruptCheckpointError):
            store.get_file(key, str(dest), n + 1, layout.checksum_bytes(data), DEADLINE)
        assert not dest.exists()


def test_put_file_refuses_bytes_that_differ_from_their_checksum(store, tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(_blob(5000))
    if not _writable(store):  # a peer takes replicas only whole (tests/jobs/test_peer.py): a single write is refused
        with pytest.raises(PeerStoreReadOnly):
            store.put_file(str(src), f"{S[4]}/x.bin", 5000, layout.checksum_bytes(src.read_bytes()), DEADLINE)
        assert not store.exists(f"{S[4]}/x.bin", DEADLINE)
        return
    with pytest.raises(CorruptCheckpointError):
        store.put_file(str(src), f"{S[4]}/x.bin", 5000, layout.checksum_bytes(b"something else"), DEADLINE)
    assert not store.exists(f"{S[4]}/x.bin", DEADLINE)
    store.put_file(str(src), f"{S[4]}/x.bin", 5000, layout.checksum_bytes(src.read_bytes()), DEADLINE)
    assert store.get_bytes(f"{S[4]}/x.bin", DEADLINE) == src.read_bytes()


def test_a_stream_is_stored_as_it_comes_and_a_failing_stream_leaves_nothing(store, tmp_path):
    """``put_stream``: what an iterator yields (parts of 5 MiB, S3's least, on the S3 servers), its size
    and checksum answered; an error raised by the iterator comes out as it is and leaves the key as it
    was (an earlier object whole, no new one); a stream within one part goes up in one request."""
    if hasattr(store, "options"):
        store.options = dataclasses.replace(store.options, part_size=5 << 20)
    pieces = [os.urandom(1 << 20) for _ in range(12)]
    data, key = b"".join(pieces), f"{S[7]}/s.bin"

    class Broken(Exception):
        pass

    def failing():
        yield from pieces[:8]  # a part sent already
        raise Broken("the producer failed")

    if not _writable(store):
        with pytest.raises(PeerStoreReadOnly):
            store.put_stream(key, iter(pieces), DEADLINE)
        return
    seen: list[int] = []
    size, checksum, _tag = store.put_stream(key, iter(pieces), DEADLINE, on_bytes=seen.append)
    assert (size, checksum, sum(seen)) == (len(data), layout.checksum_bytes(data), len(data))
    assert store.get_bytes(key, DEADLINE) == data
    for target in (key, f"{S[7]}/new.bin"):
        with pytest.raises(Broken):
            store.put_stream(target, failing(), DEADLINE)
    assert store.get_bytes(key, DEADLINE) == data and not store.exists(f"{S[7]}/new.bin", DEADLINE)
    small = store.put_stream(f"{S[7]}/small.bin", iter([b"ab", b"c"]), DEADLINE)
    assert small[:2] == (3, layout.checksum_bytes(b"abc"))
    assert store.list_sizes(S[7], DEADLINE) == {"s.bin": len(data), "small.bin": 3}


def test_deletion(store, tmp_path):
    if not _writable(store):  # the peer deletes nothing on request (its retention: tests/jobs/test_peer.py)
        store.seed(f"{S[5]}/a.bin", b"kept")
        with pytest.raises(PeerStoreReadOnly):
            store.delete(f"{S[5]}/a.bin", DEADLINE)
        with pytest.raises(PeerStoreReadOnly):
            store.delete_prefix(S[5], DEADLINE)
        assert store.get_bytes(f"{S[5]}/a.bin", DEADLINE) == b"kept"
        return
    for key in (f"{S[5]}/a.bin", f"{S[5]}/sub/b.bin", f"{S[6]}/c.bin"):
        store.put_bytes(key, key.encode(), DEADLINE)
    store.delete(f"{S[5]}/a.bin", DEADLINE)
    assert not store.exists(f"{S[5]}/a.bin", DEADLINE)
    with pytest.raises(ObjectNotFoundError):
        store.get_range(f"{S[5]}/a.bin", 0, 1, DEADLINE)
    store.delete(f"{S[5]}/a.bin", DEADLINE)  # absent: not an error
    store.delete_prefix(S[5], DEADLINE)
    assert store.list_sizes(S[5], DEADLINE) == {}
    assert store.get_bytes(f"{S[6]}/c.bin", DEADLINE) == f"{S[6]}/c.bin".encode()


def test_concurrent_use_from_several_threads(store, tmp_path):
    blobs = {f"{S[7]}/f{i}.bin": _blob(20_000 + i, salt=i) for i in range(8)}
    if _writable(store):
        srcs = {}
        for key, data in blobs.items():
            srcs[key] = tmp_path / key.replace("/", "_")
            srcs[key].write_bytes(data)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(
                lambda k: store.put_file(str(srcs[k]), k, len(blobs[k]), layout.checksum_bytes(blobs[k]), DEADLINE),
                blobs))
        # Writers racing on one key: the object is always one writer's bytes whole, never a mix.
        versions = [_blob(50_000, salt=100 + i) for i in range(4)]
        barrier = threading.Barrier(len(versions))

        def race(data: bytes) -> None:
            barrier.wait()
            store.put_bytes(f"{S[7]}/same.bin", data, DEADLINE)

        with concurrent.futures.ThreadPoolExecutor(len(versions)) as pool:
            list(pool.map(race, versions))
        assert store.get_bytes(f"{S[7]}/same.bin", DEADLINE) in versions
    else:
        for key, data in blobs.items():
            _put(store, key, data, tmp_path)

    def fetch(i: int, key: str) -> tuple[bytes, bytes]:
        # Each key is read by two threads at once, each into a file of its own (a destination is the caller's).
        dest = tmp_path / f"got_{i}_{key.replace('/', '_')}"
        store.get_file(key, str(dest), len(blobs[key]), layout.checksum_bytes(blobs[key]), DEADLINE)
        return dest.read_bytes(), store.get_range(key, 100, 1000, DEADLINE)

    keys = list(blobs) * 2
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(fetch, range(len(keys)), keys))
    for key, (whole, part) in zip(keys, results):
        assert whole == blobs[key] and part == blobs[key][100:1100]


def test_a_put_answers_the_tag_its_listing_shows_and_other_bytes_list_another(store, tmp_path, monkeypatch):
    """The committer's identity check rests on this: the tag a PUT answers (S3's ETag) is the
    one the listing shows for those bytes, and another upload of other bytes under the key lists
    another. The listing's pages are read concurrently (``StartAfter``); shares of 3 names here,
    pages of 3 keys, and every name is listed. Stores without tags say so."""
    if not _writable(store):
        pytest.skip("a peer daemon serves read-only")
    monkeypatch.setattr(s3_module, "_PAGE", 3)
    names = [f"__{i}_0.distcp" for i in range(10)]
    tags = {}
    for i, name in enumerate(names):
        data = _blob(100 + i, i)
        path = tmp_path / name
        path.write_bytes(data)
        tags[name] = store.put_file(str(path), f"{S[2]}/{name}", len(data), layout.checksum_bytes(data), DEADLINE)
    store.put_bytes(f"{S[2]}/_nodes/ranks-0-9-10.json", b"{}", DEADLINE)
    listed = store.list_tags(S[2], DEADLINE, names)
    if not isinstance(store, stores.S3Store):
        assert listed is None and set(tags.values()) == {None}
        return
    assert all(tags.values()) and len(set(tags.values())) == len(names), tags
    assert {n: listed[n] for n in names} == {n: (100 + i, tags[n]) for i, n in enumerate(names)}
    other = _blob(105, 77)
    path = tmp_path / "other"
    path.write_bytes(other)
    again = store.put_file(str(path), f"{S[2]}/{names[5]}", len(other), layout.checksum_bytes(other), DEADLINE)
    assert again != tags[names[5]]
    assert store.list_tags(S[2], DEADLINE, names)[names[5]] == (105, again)
    # A multipart upload too (rclone lists it under the MD5 of its bytes, not its completion's tag).
    monkeypatch.setattr(store, "options", dataclasses.replace(store.options, part_size=5 << 20))  # S3's least
    big = os.urandom((5 << 20) + 1000)
    path = tmp_path / "big"
    path.write_bytes(big)
    tag = store.put_file(str(path), f"{S[2]}/big.distcp", len(big), layout.checksum_bytes(big), DEADLINE)
    assert store.list_tags(S[2], DEADLINE, ["big.distcp"])["big.distcp"] == (len(big), tag)
