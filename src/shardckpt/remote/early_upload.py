"""Uploads that start while a save is still being written (before its local commit).

The writer knows each shard file's size and checksum when it closes it. It
publishes them for the node's uploader in a small sidecar inside the partial
save directory, written atomically::

    <local_dir>/.partial-step_<N>-<count>-<nonce>/.shardckpt-ready-<file>.json

and wakes the uploader. The uploader's early pass (:class:`EarlyUploads`,
run at the start of each of its passes) uploads every published file of a
partial save to its final key ``<remote>/step_<N>/<file>``, verified as any
upload, and remembers what it sent. What keeps the remote commit protocol
(:mod:`shardckpt.remote.commit`) whole:

* nothing is uploaded early into a step committed remotely (its manifest is
  there, whatever its version): a save of a committed number (a rollback, a
  restart) uploads only after its local commit, when the committer has
  retired the remote copy first;
* the manifest still goes up last, after the local commit, by the
  committer, once every node's marker covers its files; a node's marker is
  written only by the pass after the local commit, which checks each file
  against the final manifest: an early upload whose size and checksum equal
  the manifest's is not sent again, one that differs is;
* ``.metadata`` (written last, by the committer) is never uploaded early;
  each node uploads only the files its own local directory holds.

Where the node's uploads are compressed (``remote_compression``, with
``auto`` decided by :mod:`shardckpt.remote.auto_compress` while the first
save is written; :func:`shardckpt.remote.compressed.chooser`), early uploads are compressed and streamed like any other
(:func:`shardckpt.remote.compressed.put_compressed`, chunked as the writer
checksummed them: the sidecar names its chunk size); their stored forms go
into the node's marker after the local commit. Until ``auto`` has decided,
the pass leaves the files for a later pass.

A save abandoned before its local commit (the trainer killed) is not
uploaded any further (each sidecar names its writer's process; a partial save
whose writer is gone is skipped). What it sent before leaves at most
objects in ``step_<N>/`` without a manifest: nothing reads them (a remote
step exists only through its manifest); the next save of that step number
uploads over them (same file names), and the step's deletion by retention
or ``shardckpt gc`` removes the whole directory with them.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any, Mapping

from shardckpt._proc import pid_alive, proc_start
from shardckpt.format import layout
from shardckpt.remote import compressed
from shardckpt.remote.commit import withdraw_overwritten
from shardckpt.stores import Deadline, Store, join

log = logging.getLogger("shardckpt")

READY_PREFIX = ".shardckpt-ready-"
READY_FORMAT = "shardckpt-ready/1"


def publish(partial: str, *, step: int, save_id: str, rank: int, name: str, size: int, checksum: str) -> bool:
    """Record in ``partial`` that shard file ``name`` is complete (size, checksum); False when not published."""
    if name == layout.METADATA_NAME or not name.startswith("__") or name.endswith(".tmp"):
        return False
    pid = os.getpid()
    body = {"format": READY_FORMAT, "step": step, "save_id": save_id, "rank": rank, "name": name,
            "size": size, "checksum": checksum, "chunk": layout.CHUNK_BYTES, "pid": pid, "pid_start": proc_start(pid)}
    try:
        layout.atomic_write_text(os.path.join(partial, f"{READY_PREFIX}{name}.json"), json.dumps(body, sort_keys=True))
    except OSError as exc:  # the upload after the commit sends it
        log.debug("shardckpt: step %d: could not publish %s for an early upload: %s", step, name, exc)
        return False
    return True


def ready_files(partial: str) -> dict[str, dict[str, Any]]:
    """The published files of one partial save: ``{name: sidecar}`` (those still there with their size)."""
    out: dict[str, dict[str, Any]] = {}
    try:
        names = os.listdir(partial)
    except OSError:
        return out
    for sidecar in names:
        if not (sidecar.startswith(READY_PREFIX) and sidecar.endswith(".json")):
            continue
        try:
            with open(os.path.join(partial, sidecar), encoding="utf-8") as f:
                body = json.load(f)
            name = body["name"]
            if (body.get("format") != READY_FORMAT or sidecar != f"{READY_PREFIX}{name}.json"
                    or os.path.getsize(os.path.join(partial, name)) != body["size"]):
                continue
        except (OSError, ValueError, KeyError, TypeError):
            continue
        out[name] = body
    return out


def partial_saves(root: str) -> list[tuple[int, str]]:
    """``(step, path)`` of the saves being written in ``root`` (oldest step first)."""
    out = []
    try:
        names = os.listdir(root)
    except OSError:
        return out
    for name in names:
        parsed = layout.parse_partial_save(name)  # a fetch's holds no published file
        if parsed is not None:
            out.append((parsed[0], os.path.join(root, name)))
    return sorted(out)


def _writer_alive(sidecar: dict[str, Any]) -> bool:
    """Whether the process that published ``sidecar`` still runs: a save whose writer died can
    never commit, so its files are not uploaded (the next run removes the partial directory)."""
    pid = sidecar.get("pid")
    if not isinstance(pid, int):
        return True  # published before writers recorded themselves
    return pid_alive(pid, sidecar.get("pid_start"))


class EarlyUploads:
    """The uploader's early pass and what it sent: ``{(step, save_id): {name: (size, checksum)}}``."""

    def __init__(self) -> None:
        self.sent: dict[tuple[int, str], dict[str, tuple[int, str]]] = {}
        self.tags: dict[tuple[int, str], dict[str, str]] = {}
        """The store's tag of each file sent (its ETag on S3), for the node's marker."""
        self.forms: dict[tuple[int, str], dict[str, dict[str, Any]]] = {}
        """The stored form of each file sent compressed, for the node's marker."""
        self.sent_bytes: dict[int, int] = {}
        """Bytes sent per step (as stored: compressed where they were)."""
        self._count = threading.Lock()
        self._refused: set[tuple[int, str]] = set()

    def sent_for(self, step: int, save_id: str) -> Mapping[str, tuple[int, str]]:
        return self.sent.get((step, save_id), {})

    def forget(self, step: int) -> None:
        """The step's local commit was handled (committed, superseded, gone): drop what is known of it."""
        for key in [k for k in self.sent if k[0] == step]:
            del self.sent[key]
            self.tags.pop(key, None)
            self.forms.pop(key, None)
        self.sent_bytes.pop(step, None)
        self._refused = {k for k in self._refused if k[0] != step}

    def run(self, store: Store, root: str) -> int:
        """Upload the published files not sent yet; returns the bytes uploaded. Never raises."""
        total = 0
        saves = partial_saves(root)
        live = set()
        for step, partial in saves:
            ready = ready_files(partial)
            if not ready:
                continue
            first = next(iter(ready.values()))
            save_id = str(first.get("save_id", ""))
            key = (step, save_id)
            live.add(key)
            if key in self._refused or not _writer_alive(first):
                continue
            done = self.sent.setdefault(key, {})
            tags = self.tags.setdefault(key, {})
            forms = self.forms.setdefault(key, {})
            todo = sorted(n for n, b in ready.items()
                          if b.get("save_id") == save_id and done.get(n) != (b["size"], b["checksum"]))
            if not todo:
                continue
            compress = compressed.chooser(store, root)
            if compress is None:
                continue  # auto has not decided yet: a later pass sends them
            deadline = Deadline(store.options.step_deadline_s)
            try:
                if store.exists(join(layout.step_dirname(step), layout.MANIFEST_NAME), deadline):
                    self._refused.add(key)
                    log.info("shardckpt: step %d is committed on %s under another save: this save of it is "
                             "uploaded only after its local commit", step, store.where(layout.step_dirname(step)))
                    continue

                def send(name: str) -> int:
                    body = ready[name]
                    path, key_name = os.path.join(partial, name), join(layout.step_dirname(step), name)
                    sent = body["size"]
                    if compress(name, body["size"]):
                        entry = layout.FileEntry(body["size"], body["checksum"], int(body.get("rank", 0)))
                        form, tag = compressed.put_compressed(store, key_name, path, entry, step, deadline,
                                                              chunk=int(body.get("chunk") or layout.CHUNK_BYTES))
                        forms[name], sent = form.to_json(), form.size
                    else:
                        tag = store.put_file(path, key_name, body["size"], body["checksum"], deadline)
                        forms.pop(name, None)
                    done[name] = (body["size"], body["checksum"])
                    if tag:
                        tags[name] = tag
                    with self._count:  # counted file by file: a file renamed by the commit stops the rest
                        self.sent_bytes[step] = self.sent_bytes.get(step, 0) + sent
                    return sent

                before = self.sent_bytes.get(step, 0)
                try:
                    store.run_all([lambda n=n: send(n) for n in todo], files=True)
                finally:
                    total += self.sent_bytes.get(step, 0) - before
                # A commit of another save made while these went up may now hold them: withdrawn.
                withdraw_overwritten(store, step, {n: done[n] for n in todo}, "", deadline)
            except FileNotFoundError:
                continue  # committed (renamed) or removed meanwhile: the pass after the commit takes over
            except Exception as exc:  # noqa: BLE001 - the upload after the local commit sends what is missing
                log.warning("shardckpt: step %d: an early upload from %s failed (the files are uploaded after "
                            "the local commit): %s", step, partial, exc)
        # Saves no longer partial are committed (their pass reads what was sent) or gone.
        for key in [k for k in self._refused if k not in live]:
            self._refused.discard(key)
        return total
