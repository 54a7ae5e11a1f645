"""S3 uploads: single PUTs, multipart uploads of files and streams, and the check of what was stored.

A mixin of :class:`~shardckpt.stores.s3.S3Store`: it uses the store's client, retries and options.
"""

from __future__ import annotations

import base64
import concurrent.futures
import zlib
from typing import Any, Callable, Iterable, Iterator

from shardckpt.errors import RemoteError
from shardckpt.format import layout
from shardckpt.stores.base import Deadline
from shardckpt.stores.transfer import (
    b64_crc32,
    local_mismatch,
    read_exact,
)


def etag_of(resp: dict) -> str | None:
    """The ETag of a PUT, a completed multipart upload or a listed object, without its quotes."""
    tag = str(resp.get("ETag") or "").strip('"')
    return tag or None


def recorded_checksum_of(head: dict) -> str | None:
    """The checksum an object was uploaded with, from a HEAD answer. User metadata names are
    case-insensitive (rclone answers "Checksum")."""
    return {k.lower(): v for k, v in (head.get("Metadata") or {}).items()}.get("checksum")


class S3Uploads:
    """The upload half of :class:`~shardckpt.stores.s3.S3Store`."""


    def put_bytes(self, key: str, data: bytes, deadline: Deadline) -> None:
        crc = b64_crc32(zlib.crc32(data))
        self.retry(
            lambda: self.client.put_object(Bucket=self.bucket, Key=self.full_key(key), Body=data, ChecksumCRC32=crc),
            "upload of", key, deadline,
        )

    def put_file(
        self, path: str, key: str, size: int, checksum: str, deadline: Deadline,
        on_bytes: Callable[[int], None] | None = None
    ) -> str | None:
        opts = self.options
        if size < opts.multipart_threshold:
            data = read_exact(path, 0, size + 1)
            if len(data) != size or layout.checksum_bytes(data, like=checksum) != checksum:
                raise local_mismatch(path, self.where(key), "differs (size or checksum)")
            tag = self._put_small(key, data, checksum, deadline)
            if on_bytes is not None:
                on_bytes(size)
            return tag
        return self._put_multipart(path, key, size, checksum, deadline, on_bytes)

    def _put_small(self, key: str, data: bytes, checksum: str, deadline: Deadline) -> str | None:
        """One PUT of ``data`` (its checksum recorded with it); the object's tag."""
        crc = b64_crc32(zlib.crc32(data))
        resp = self.retry(
            lambda: self.client.put_object(
                Bucket=self.bucket, Key=self.full_key(key), Body=data, ChecksumCRC32=crc,
                Metadata={"checksum": checksum},
            ),
            "upload of", key, deadline,
        )
        if resp.get("ChecksumCRC32") != crc:
            # The store did not confirm the checksum of what it stored: look.
            self._verify_upload(key, len(data), checksum, crc, deadline)
        return etag_of(resp)

    def _put_multipart(
        self, path: str, key: str, size: int, checksum: str, deadline: Deadline, on_bytes: Callable[[int], None] | None
    ) -> str | None:
        part = self.options.part_size
        nparts = (size + part - 1) // part
        digest = layout.Checksum.like(checksum)
        tail: list[bytes] = []

        def parts() -> Iterator[bytes]:
            with open(path, "rb") as f:
                for _ in range(nparts):
                    data = f.read(part)
                    digest.update(data)
                    yield data
                tail.append(f.read(1))

        def check(count: int) -> None:  # before the completion: the file is what the manifest says
            if digest.value() != checksum or tail != [b""] or count != nparts:
                raise local_mismatch(path, self.where(key), "differs (size or checksum)")

        _sent, composite, completed = self._put_parts(key, parts(), {"checksum": checksum}, deadline, on_bytes, check)
        # The tag as listings show it: some S3-compatible servers (rclone's) list a multipart object
        # under the MD5 of its bytes, not under the tag its completion answered.
        return self._verify_upload(key, size, checksum, composite, deadline) or etag_of(completed)

    def put_stream(self, key: str, chunks: Iterable[bytes], deadline: Deadline,
                   on_bytes: Callable[[int], None] | None = None,
                   like: str | None = None) -> tuple[int, str, str | None]:
        """Parts of ``part_size`` go up as soon as the stream has given them, ``concurrency`` in
        flight; a stream that ends within the first part goes up in one PUT. The checksum is known
        only at the end: a multipart object records none (readers hash its bytes)."""
        part = self.options.part_size
        digest = layout.Checksum.like(like)
        it = iter(chunks)
        head = bytearray()
        for piece in it:
            digest.update(piece)
            head += piece
            if len(head) >= part:
                break
        else:
            data = bytes(head)
            tag = self._put_small(key, data, digest.value(), deadline)
            if on_bytes is not None:
                on_bytes(len(data))
            return len(data), digest.value(), tag

        def parts() -> Iterator[bytes]:
            buf = head
            while True:
                while len(buf) >= part:
                    yield bytes(buf[:part])
                    del buf[:part]
                piece = next(it, None)
                if piece is None:
                    break
                digest.update(piece)
                buf += piece
            if buf:
                yield bytes(buf)

        size, composite, completed = self._put_parts(key, parts(), {}, deadline, on_bytes)
        return size, digest.value(), self._verify_upload(key, size, "", composite, deadline) or etag_of(completed)

    def _put_parts(
        self, key: str, parts: Iterable[bytes], metadata: dict[str, str], deadline: Deadline,
        on_bytes: Callable[[int], None] | None, check: Callable[[int], None] | None = None,
    ) -> tuple[int, str, Any]:
        """One multipart upload of the pieces ``parts`` yields (every one but the last at least 5 MiB),
        each sent as soon as it is read while the next is read, at most ``part_window`` in memory;
        ``check(parts)`` before the completion. An error (of the stream too) aborts the upload and is
        raised. Returns the bytes sent, the composite CRC32 and the completion's answer."""
        fk = self.full_key(key)
        created = self.retry(
            lambda: self.client.create_multipart_upload(
                Bucket=self.bucket, Key=fk, Metadata=metadata, ChecksumAlgorithm="CRC32"
            ),
            "start of multipart upload", key, deadline,
        )
        upload_id = created["UploadId"]
        crcs: dict[int, bytes] = {}
        etags: dict[int, str] = {}
        window = self.part_window
        futures: list[concurrent.futures.Future] = []
        sent = 0

        def send(number: int, data: bytes) -> None:
            try:
                crc = zlib.crc32(data).to_bytes(4, "big")
                crcs[number] = crc
                resp = self.retry(
                    lambda: self.client.upload_part(
                        Bucket=self.bucket, Key=fk, UploadId=upload_id, PartNumber=number, Body=data,
                        ChecksumCRC32=base64.b64encode(crc).decode(),
                    ),
                    f"upload of part {number} of", key, deadline,
                )
                etags[number] = resp["ETag"]
                if on_bytes is not None:
                    on_bytes(len(data))
            finally:
                window.release()

        try:
            for data in parts:
                sent += len(data)
                window.acquire()
                futures.append(self.pool().submit(send, len(futures) + 1, data))
                if any(fut.done() and fut.exception() for fut in futures):
                    break
            for fut in futures:
                fut.result()
            if check is not None:
                check(len(futures))
            numbers = range(1, len(futures) + 1)
            listed = [{"PartNumber": i, "ETag": etags[i], "ChecksumCRC32": base64.b64encode(crcs[i]).decode()}
                      for i in numbers]
            completed = self.retry(
                lambda: self.client.complete_multipart_upload(
                    Bucket=self.bucket, Key=fk, UploadId=upload_id, MultipartUpload={"Parts": listed}
                ),
                "completion of multipart upload", key, deadline,
            )
        except BaseException:
            for fut in futures:
                if fut.cancel():
                    window.release()  # its send() never ran
            concurrent.futures.wait(futures)
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=fk, UploadId=upload_id)
            except Exception:  # noqa: BLE001 - best effort; lifecycle rules clean the rest
                pass
            raise
        return sent, b64_crc32(zlib.crc32(b"".join(crcs[i] for i in numbers))), completed

    def _verify_upload(self, key: str, size: int, checksum: str, crc: str, deadline: Deadline) -> str | None:
        """Check the stored object against what was sent (one HEAD); its tag."""
        head = self.retry(
            lambda: self.client.head_object(Bucket=self.bucket, Key=self.full_key(key), ChecksumMode="ENABLED"),
            "verification of", key, deadline,
        )
        got_crc = (head.get("ChecksumCRC32") or "").split("-")[0]
        problems = []
        if head.get("ContentLength") != size:
            problems.append(f"{head.get('ContentLength')} bytes, expected {size}")
        recorded = recorded_checksum_of(head)
        if recorded not in (None, checksum):
            problems.append("its recorded checksum differs")
        if got_crc and got_crc != crc:
            problems.append("the store's CRC32 differs from the bytes sent")
        if problems:
            raise RemoteError(
                f"uploaded object {self.where(key)} failed verification ({', '.join(problems)}); "
                f"the step is not committed and will be uploaded again"
            )
        return etag_of(head)
