"""``remote_compression="auto"``: whether compressing pays on this node's link, known before the first upload.

The uploader starts measuring when it starts (:func:`start`, a thread of its
own, while the trainer's first save is still being written): one PUT of
:data:`PROBE_BYTES` incompressible bytes to the remote (then deleted) gives
the upload rate; encoding a sample shaped like a training state (bf16
weights, fp32 moments) on one thread gives this node's compression rate and
ratio. Uploads are streamed (each file's chunks encoded while the parts
before them upload), so a compressed upload takes about the longer of
encoding and sending the smaller bytes: compressing pays where the
compression threads outrun the link with room to spare for the trainer
(:data:`HEADROOM`) and the sample shrinks. One PUT measures one
connection: where a link's connections together carry much more than one
(some object stores far away), set ``remote_compression`` explicitly.

The decision is kept per link (the bucket and the endpoint, not the prefix)
in this process and in a small file only this user can read,
``<local_dir>/.shardckpt-remote/links.json``, for :data:`MAX_AGE_S`: a job
restarted on the node decides at once, without a request. An older entry is
measured again; a probe that fails decides nothing (uploads go up as they
are until a later probe succeeds).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
import uuid
from typing import Any

import numpy as np

from shardckpt.format import codec, layout
from shardckpt.format.node_state import private_dir, state_dir, write_private
from shardckpt.stores import Deadline, Store, join, safe_url

log = logging.getLogger("shardckpt")

PROBE_BYTES = 4 << 20
"""The probe's one PUT: small enough to cost a fraction of a second on a slow link."""
PROBE_PREFIX = ".shardckpt-probe"
MAX_AGE_S = 12 * 3600.0
"""A kept decision is measured again after this long."""
HEADROOM = 3.0
"""Compressing pays when this node compresses at least this many times faster than the link sends.
Streamed, a compressed upload takes about the longer of encoding and sending the smaller bytes, so a
free core would pay from 1x on; but the uploader shares the cores with the trainer (its data loading,
the next save's write). Measured on 2 shared cores (``benchmarks/bench_compress.py``): through a
40 MB/s link (compression ~8x the link) the first save was remote-durable in 0.76x the time of
``off``; on the loopback link to the S3 server (~1.5-3x) compressing cost 8 %."""
RETRY_S = 30.0
"""After a failed probe, the next one starts no sooner than this."""
LINKS_NAME = "links.json"
LINKS_FORMAT = "shardckpt-links/1"
WORKERS = max(1, (os.cpu_count() or 1) // 2)
"""Threads compressing on a node: half its cores (the trainer's data loading keeps the rest)."""


@dataclasses.dataclass
class Decision:
    compress: bool
    upload_mb_s: float
    compress_mb_s: float
    ratio: float
    measured: float = 0.0
    """When (seconds since the epoch)."""
    workers: int = WORKERS

    def text(self) -> str:
        verdict = "compressing" if self.compress else "not compressing"
        return (f"{verdict} uploads: measured upload {self.upload_mb_s:.0f} MB/s, compression "
                f"{self.compress_mb_s:.0f} MB/s on {self.workers} thread(s) to {self.ratio:.2f}x of the bytes")

    def fresh(self, now: float) -> bool:
        return 0 <= now - self.measured < MAX_AGE_S and self.workers == WORKERS


def link_of(store: Store) -> str:
    """What a decision is about: the bucket (or host) and the endpoint, not the prefix."""
    bucket = store.url.split("/")[2] if store.url.count("/") >= 2 else store.url
    endpoint = getattr(store, "endpoint", None) or getattr(getattr(store, "options", None), "endpoint_url", None)
    return f"{bucket} {endpoint or ''}".strip()


def links_path(root: str) -> str:
    return os.path.join(state_dir(root), LINKS_NAME)


def _sample() -> bytes:
    """8 MiB shaped like a training state: bf16 weights (4 MiB), fp32 Adam moments (4 MiB)."""
    rng = np.random.default_rng(0)
    weights = (rng.standard_normal(1 << 21, dtype=np.float32) * 0.02).view(np.uint32) >> 16
    moments = rng.standard_normal(1 << 20, dtype=np.float32) * 1e-3
    return weights.astype(np.uint16).tobytes() + moments.tobytes()


def measure(store: Store, deadline: Deadline) -> Decision:
    """The upload rate (one PUT of incompressible bytes, then deleted) and, meanwhile, this node's
    compression rate and ratio on :func:`_sample`: the probe takes the longer of the two, not their sum."""
    noise = os.urandom(PROBE_BYTES)
    key = join(PROBE_PREFIX, f"rate-{uuid.uuid4().hex}.bin")
    sent: dict[str, Any] = {}

    def put() -> None:
        t0 = time.perf_counter()
        try:
            store.put_bytes(key, noise, deadline)
            sent["mb_s"] = PROBE_BYTES / max(time.perf_counter() - t0, 1e-6) / 1e6
            store.delete(key, deadline)
        except Exception as exc:  # noqa: BLE001 - raised below, in the measuring thread
            sent["error"] = exc

    thread = threading.Thread(target=put, name="shardckpt-link-put", daemon=True)
    thread.start()
    data = _sample()
    step = layout.CHUNK_BYTES
    t0 = time.perf_counter()
    out = sum(len(codec.encode_chunk(data[i : i + step])) for i in range(0, len(data), step))
    took = max(time.perf_counter() - t0, 1e-6)
    thread.join()
    if "error" in sent:
        raise sent["error"]
    ratio = out / len(data)
    compress = len(data) / took * WORKERS / 1e6
    pays = ratio <= 1 - codec.MIN_SAVING and sent["mb_s"] * HEADROOM <= compress
    return Decision(pays, sent["mb_s"], compress, ratio, time.time())


class _Links:
    """This process's decisions and the probes in flight, per link."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.decided: dict[str, Decision] = {}
        self.running: dict[str, threading.Thread] = {}
        self.failed_at: dict[str, float] = {}


_links = _Links()


def _read_kept(path: str | None, link: str) -> Decision | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            body = json.load(f)
        if body.get("format") != LINKS_FORMAT:
            return None
        entry = body["links"][link]
        decision = Decision(bool(entry["compress"]), float(entry["upload_mb_s"]), float(entry["compress_mb_s"]),
                            float(entry["ratio"]), float(entry["measured"]), int(entry["workers"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return decision if decision.fresh(time.time()) else None


def _keep(path: str | None, link: str, decision: Decision) -> None:
    """Into the node's file (only this user can read it: it names the remote's bucket and endpoint)."""
    if path is None:
        return
    try:
        with open(path, encoding="utf-8") as f:
            links = dict(json.load(f).get("links") or {})
    except (OSError, ValueError, AttributeError):
        links = {}
    links[link] = dataclasses.asdict(decision)
    try:
        private_dir(os.path.dirname(path))
        write_private(path, json.dumps({"format": LINKS_FORMAT, "links": links}, indent=1, sort_keys=True))
    except OSError as exc:
        log.warning("shardckpt: cannot keep the compression decision in %s (measured again next time): %s", path, exc)


def _probe(store: Store, path: str | None, link: str) -> None:
    try:
        decision = measure(store, Deadline(min(60.0, store.options.step_deadline_s)))  # type: ignore[attr-defined]
    except Exception as exc:  # noqa: BLE001 - nothing decided: uploads go up as they are meanwhile
        with _links.lock:
            _links.failed_at[link] = time.monotonic()
            _links.running.pop(link, None)
        log.warning("shardckpt: remote_compression=auto for %s: the link could not be measured (%s); uploads "
                    "are not compressed until it is", safe_url(store.url), exc)
        return
    _keep(path, link, decision)
    with _links.lock:
        _links.decided[link] = decision
        _links.running.pop(link, None)
    log.info("shardckpt: remote_compression=auto for %s: %s", safe_url(store.url), decision.text())


def start(store: Store, path: str | None) -> None:
    """Decide for ``store``'s link in the background (``path``: the node's file of decisions); nothing
    when decided already, kept fresh in ``path``, being measured, or after a failure within :data:`RETRY_S`."""
    link = link_of(store)
    with _links.lock:
        if link in _links.decided or link in _links.running:
            return
        kept = _read_kept(path, link)
        if kept is not None:
            _links.decided[link] = kept
            log.info("shardckpt: remote_compression=auto for %s: %s (measured %s)", safe_url(store.url), kept.text(),
                     time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(kept.measured)))
            return
        if time.monotonic() - _links.failed_at.get(link, -RETRY_S) < RETRY_S:
            return
        thread = threading.Thread(target=_probe, args=(store, path, link), name="shardckpt-link-probe", daemon=True)
        _links.running[link] = thread
    thread.start()


def decision(store: Store, path: str | None, wait_s: float = 0.0) -> Decision | None:
    """The decision for ``store``'s link, measured when there is none (waiting at most ``wait_s``
    for it); ``None``: not decided (yet)."""
    link = link_of(store)
    start(store, path)
    with _links.lock:
        thread = _links.running.get(link)
    if thread is not None and wait_s > 0:
        thread.join(wait_s)
    with _links.lock:
        return _links.decided.get(link)


def wanted(store: Store, path: str | None, wait_s: float = 0.0) -> bool | None:
    """Whether uploads to ``store`` are compressed (``remote_compression``); ``None``: ``auto`` has not
    decided yet (within ``wait_s``)."""
    mode = getattr(getattr(store, "options", None), "compression", "off")
    if mode == "off":
        return False
    if mode != "auto":
        return True
    found = decision(store, path, wait_s)
    return None if found is None else found.compress


def settle(timeout_s: float) -> None:
    """Let the probes in flight finish (their object deleted) before the process exits."""
    end = time.monotonic() + timeout_s
    with _links.lock:
        threads = list(_links.running.values())
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()))


def forget() -> None:
    """This process's decisions (the node's file stays): the next use decides again."""
    with _links.lock:
        _links.decided.clear()
        _links.failed_at.clear()
