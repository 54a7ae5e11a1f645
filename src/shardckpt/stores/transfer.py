"""What moving a file over the network needs besides retries: checked copies and downloads, upload chunks,
CRC32 headers, the transient-failure and stream-error types the network stores raise and tell apart.
"""

from __future__ import annotations

import base64
import os
from typing import Any, Iterable, Iterator

from shardckpt.errors import CorruptCheckpointError
from shardckpt.format import layout


def copy_checked(chunks: Any, dst: Any, like: str | None = None) -> tuple[int, str]:
    """Write ``chunks`` to the open file ``dst``; their total size and checksum (algorithm of ``like``)."""
    digest = layout.Checksum.like(like)
    n = 0
    for chunk in chunks:
        digest.update(chunk)
        dst.write(chunk)
        n += len(chunk)
    return n, digest.value()


def file_chunks(f: Any, size: int = 8 << 20) -> Any:
    return iter(lambda: f.read(size), b"")


def b64_crc32(value: int) -> str:
    return base64.b64encode(value.to_bytes(4, "big")).decode()


class Transient(Exception):
    """A failure worth retrying that did not come as a backend exception."""


class StreamError(Exception):
    """An error raised by the iterator a stream upload reads; its ``__cause__`` is raised again as it is."""


def guarded(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The pieces of ``chunks``, its errors wrapped in :class:`StreamError` (told apart from the store's
    own); the iterator is closed when this one is (a generator holding a lock lets it go)."""
    it = iter(chunks)
    try:
        while True:
            try:
                piece = next(it)
            except StopIteration:
                return
            except Exception as exc:  # noqa: BLE001 - raised again by the store as it is
                raise StreamError() from exc
            yield piece
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


def read_exact(path: str, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(length)
    return data


def local_mismatch(path: str, key_where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"local file {path} {what} than its manifest entry, so it was not uploaded to {key_where}. "
        f"Remedy: the local copy is damaged; run `shardckpt verify` on its directory and save a new step."
    )


def check_download(path: str, where: str, size: int, checksum: str, got_size: int, got_sum: str) -> None:
    if got_size != size or got_sum != checksum:
        try:
            os.unlink(path)
        except OSError:
            pass
        detail = f"{got_size} bytes, expected {size}" if got_size != size else "checksum differs from the manifest"
        raise CorruptCheckpointError(
            f"remote object {where} is corrupt ({detail}); it was not loaded. Remedy: load an earlier "
            f"step (load(step=...)) or set on_corrupt='fallback'; repair it from a node that still has "
            f"the step (`shardckpt push --local LOCAL_DIR --remote URL --step N` checks the remote copy and "
            f"uploads again what fails)."
        )
