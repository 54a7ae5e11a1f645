"""A remote with many committed steps, built cheaply, and a count of the S3 requests a store sends.

``clone_steps`` copies the objects of one real committed step under other
step numbers, each with its own manifest (step, time of creation and save id
rewritten), as the committing node would have written them; without index
entries (a bucket written before the index, or a crash between a manifest and
its entry). ``RequestLog`` counts the HTTP requests boto3 sends for an
``S3Store`` (botocore's own event hooks: nothing is replaced) with the bytes
of each answer.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import urllib.parse
import uuid
from typing import Any

from shardckpt import stores
from shardckpt.format import layout
from shardckpt.remote import commit as remote_commit


def clone_steps(store: stores.Store, source: int, steps: list[int]) -> None:
    """Commit copies of remote step ``source`` under ``steps`` (objects first, manifest last)."""
    deadline = stores.Deadline(120)
    manifest = remote_commit.remote_manifest(store, source, deadline)
    assert manifest is not None, f"step {source} is not committed on {store.url}"
    blobs = {n: store.get_bytes(remote_commit.step_key(source, n), deadline) for n in manifest.files}

    def one(step: int) -> None:
        for name, data in blobs.items():
            store.put_bytes(remote_commit.step_key(step, name), data, deadline)
        copy = dataclasses.replace(manifest, step=step, created=manifest.created + (step - source) * 1e-3,
                                   save_id=uuid.uuid4().hex if manifest.save_id else manifest.save_id)
        store.put_bytes(remote_commit.step_key(step, layout.MANIFEST_NAME), copy.to_json().encode(), deadline)

    store.run_all([lambda s=s: one(s) for s in steps], files=True)


class RequestLog:
    """Counts requests by kind (LIST, GET, HEAD, PUT, DELETE) and, for GETs, by object name."""

    def __init__(self, store: stores.Store) -> None:
        self._lock = threading.Lock()
        self.clear()
        events = store.client.meta.events
        events.register("before-send.s3", self._sent)
        events.register("after-call.s3", self._answered)

    def clear(self) -> None:
        with self._lock:
            self.kinds: collections.Counter[str] = collections.Counter()
            self.gets: collections.Counter[str] = collections.Counter()
            self.bytes_in = 0

    def _sent(self, request: Any, **_: Any) -> None:
        url = urllib.parse.urlsplit(request.url)
        query = urllib.parse.parse_qs(url.query, keep_blank_values=True)
        method = request.method
        if method == "GET" and "list-type" in query:
            kind = "LIST"
        elif method == "POST" and "delete" in query:
            kind = "DELETE"
        else:
            kind = method
        with self._lock:
            self.kinds[kind] += 1
            if kind == "GET":
                self.gets[url.path.rsplit("/", 1)[-1]] += 1

    def _answered(self, http_response: Any, parsed: Any, model: Any, **_: Any) -> None:
        if model.name == "GetObject":
            n = int(parsed.get("ContentLength") or 0)
        else:
            n = len(http_response.content or b"") if not model.has_streaming_output else 0
        with self._lock:
            self.bytes_in += n

    @property
    def manifest_gets(self) -> int:
        return self.gets[layout.MANIFEST_NAME]

    def requests(self) -> int:
        return sum(self.kinds.values())
