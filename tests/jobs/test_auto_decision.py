"""``remote_compression="auto"`` decides from the measured link: off on a fast link, compressing on a slow one.

Each decision is asserted on a link whose speed is known from the measure
itself, both ways: a decision that ignores the link (compressing wherever the
sample shrinks) fails the fast case, one that never compresses fails the slow
case.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest
from faultproxy import FaultProxy
from s3server import BUCKET, reset_if_used, transfer_options

from shardckpt import stores
from shardckpt.remote import auto_compress, compressed

BIG = 64 << 20
"""A shard file's size well over ``AUTO_MIN_FILE_BYTES``: auto compresses it when it decided to compress."""


@pytest.fixture(autouse=True)
def fresh_decisions(request):
    reset_if_used(request)
    auto_compress.forget()
    yield
    auto_compress.settle(60)
    auto_compress.forget()


def _decide(store: stores.Store, root: str) -> tuple[auto_compress.Decision, dict]:
    """A decision measured now for ``store``'s link (none kept), with what the node's file keeps of it."""
    path = auto_compress.links_path(root)
    if os.path.exists(path):
        os.unlink(path)
    auto_compress.forget()
    found = auto_compress.decision(store, path, wait_s=60)
    assert found is not None, "auto did not decide within 60 s"
    with open(path, encoding="utf-8") as f:
        kept = json.load(f)["links"][auto_compress.link_of(store)]
    return found, kept


def test_auto_does_not_compress_over_a_link_faster_than_compressing(tmp_path):
    """A remote in this machine's memory (``file://`` on tmpfs) takes the probe several times faster than one
    thread compresses: ``auto`` decides off, keeps "off" in the node's file, and uploads every file plain. The
    machine is shared, so a measure can come out slow: up to six are taken, and each one that measured the
    link fast (upload x HEADROOM over the compression rate, with a margin) must have decided off."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("needs /dev/shm for a remote faster than compressing")
    base = tempfile.mkdtemp(dir="/dev/shm", prefix="shardckpt-test-link-")
    try:
        store = stores.open_store(f"file://{base}/remote", transfer_options(compression="auto"))
        seen = []
        for _ in range(6):
            found, kept = _decide(store, str(tmp_path / "local"))
            seen.append(found.text())
            if found.upload_mb_s * auto_compress.HEADROOM >= 1.5 * found.compress_mb_s:
                break
        else:
            pytest.fail(f"the tmpfs link never measured fast on this machine: {seen}")
        assert found.ratio <= 0.9, found  # the sample shrinks: only the link's speed speaks against compressing
        assert not found.compress and not kept["compress"], seen
        assert auto_compress.wanted(store, auto_compress.links_path(str(tmp_path / "local"))) is False
        choose = compressed.chooser(store, str(tmp_path / "local"))
        assert choose is not None and not choose("__0_0.distcp", BIG)
        assert not [n for n in os.listdir(f"{base}/remote") if n != auto_compress.PROBE_PREFIX] and not os.listdir(
            f"{base}/remote/{auto_compress.PROBE_PREFIX}")  # the probe cleaned up after itself
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_auto_compresses_over_a_link_slower_than_compressing(s3, tmp_path):
    """The S3 server behind a proxy capped at 5 MB/s, far below what one thread compresses: ``auto``
    decides to compress, keeps it in the node's file, and compresses a large shard file (never
    ``.metadata``, never a small file)."""
    proxy = FaultProxy(s3.endpoint)
    proxy.cap_bytes_per_s = 5e6
    try:
        store = stores.open_store(f"s3://{BUCKET}/slow", transfer_options(compression="auto",
                                                                         endpoint_url=proxy.endpoint))
        found, kept = _decide(store, str(tmp_path / "local"))
        assert found.upload_mb_s < 6 and found.ratio <= 0.9, found.text()
        assert found.compress and kept["compress"], found.text()
        choose = compressed.chooser(store, str(tmp_path / "local"))
        assert choose is not None and choose("__0_0.distcp", BIG)
        assert not choose(".metadata", BIG) and not choose("__0_0.distcp", 1 << 20)
    finally:
        proxy.stop()
