"""Source 5 of a restore: other nodes of the job over the process group (node-local copies, no remote).

Every rank computes the same plan from what each copy holds; only the
committer of a copy that has a file and the committer of a copy that lacks it
take part in its transfer, point to point over the ``ctl`` side group, in the
plan's order. A received file is checked against the manifest before it is
renamed into place; one that fails (a chunk damaged on the way) is not kept.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import torch
import torch.distributed as dist

from shardckpt import _failpoints
from shardckpt.errors import CorruptCheckpointError
from shardckpt.format import layout

PEER_CHUNK = 64 << 20
"""Bytes per message when a node-local copy receives a file from another node."""


def send_file(path: str, size: int, dst: int, group: Any) -> None:
    """Send ``size`` bytes of ``path`` to ``dst`` in chunks; never stops early (the receiver counts on them).

    A file that cannot be read is sent as zeros: the receiver's checksum refuses it.
    """
    try:
        f = open(path, "rb", buffering=0)
    except OSError:
        f = None
    try:
        sent = 0
        while sent < size:
            n = min(PEER_CHUNK, size - sent)
            buf = torch.zeros(n, dtype=torch.uint8)
            if f is not None:
                try:
                    f.readinto(memoryview(buf.numpy()))
                except OSError:
                    f.close()
                    f = None
            _failpoints.hit("peer.chunk_read", memoryview(buf.numpy()))
            dist.send(buf, dst=dst, group=group)
            sent += n
    finally:
        if f is not None:
            f.close()


def receive_file(path: str, entry: layout.FileEntry, src: int, group: Any, step: int) -> None:
    """Receive one file from ``src``, check it against the manifest, rename it into place.

    Every chunk is received even when writing fails (the sender goes on
    sending); the failure is raised afterwards.
    """
    tmp = f"{path}.peer-{uuid.uuid4().hex[:8]}"
    checksum = layout.Checksum.like(entry.checksum)
    write_error: OSError | None = None
    f = None
    try:
        try:
            f = open(tmp, "wb")
        except OSError as exc:
            write_error = exc
        received = 0
        while received < entry.size:
            n = min(PEER_CHUNK, entry.size - received)
            buf = torch.empty(n, dtype=torch.uint8)
            dist.recv(buf, src=src, group=group)
            view = memoryview(buf.numpy())
            checksum.update(view)
            if f is not None and write_error is None:
                try:
                    f.write(view)
                except OSError as exc:
                    write_error = exc
            received += n
        if f is not None and write_error is None:
            try:
                f.flush()
                os.fsync(f.fileno())
            except OSError as exc:
                write_error = exc
        if write_error is not None:
            raise CorruptCheckpointError(
                f"step {step}: could not write {path} received from rank {src} ({write_error}). Remedy: free "
                f"disk space under {os.path.dirname(os.path.dirname(path))}, then load again."
            ) from write_error
        if checksum.value() != entry.checksum:
            raise CorruptCheckpointError(
                f"step {step}: {os.path.basename(path)} from rank {src}'s copy fails its checksum; it was not "
                f"used. Remedy: run `shardckpt verify` on that node's local_dir, or load an earlier step."
            )
        f.close()
        f = None
        os.replace(tmp, path)
    finally:
        if f is not None:
            f.close()
        if os.path.exists(tmp):
            os.unlink(tmp)
