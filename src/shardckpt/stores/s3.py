"""S3 and S3-compatible stores through boto3.

``s3://bucket/prefix``: concurrent multipart transfers, our own retry policy
(:class:`~shardckpt.stores.network.NetworkStore`), S3's checksum headers.
The credentials come from the standard boto3 chain; ``endpoint_url`` (or
``AWS_ENDPOINT_URL``) points it at MinIO, Ceph RGW, rclone or any
S3-compatible store.
"""

from __future__ import annotations

import base64
import concurrent.futures
import os
import threading
import zlib
from typing import Any, Callable, Iterable, Iterator

from shardckpt.format import layout
from shardckpt.errors import CorruptCheckpointError, RemoteError
from shardckpt.stores.base import Deadline, join, range_past_end
from shardckpt.stores.network import (
    NetworkStore,
    TransferOptions,
    _b64_crc32,
    _check_download,
    _copy_checked,
    _local_mismatch,
    _read_exact,
    _Transient,
    safe_url,
    split_url,
)

_RETRY_STATUS = {408, 429, 500, 502, 503, 504}
_RETRY_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "RequestLimitExceeded",
    # The store refused a body that arrived damaged (its checksum differs): sending it again helps.
    "BadDigest",
    "XAmzContentChecksumMismatch",
    "InvalidDigest",
}
_BAD_CREDENTIAL_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
    "TokenRefreshRequired",
    "InvalidClientTokenId",
}


class S3Store(NetworkStore):
    """S3 and S3-compatible stores through boto3."""

    def __init__(self, url: str, options: TransferOptions) -> None:
        super().__init__(url, options)
        import boto3
        import botocore.config
        import botocore.exceptions as bexc

        _, rest = split_url(url)
        self.bucket, _, self.prefix = rest.partition("/")
        self.prefix = self.prefix.strip("/")
        self._bexc = bexc
        self.retryable_types = NetworkStore.retryable_types + (
            bexc.HTTPClientError,
            bexc.ConnectionError,
            bexc.IncompleteReadError,
        )
        config = botocore.config.Config(
            connect_timeout=min(options.connect_timeout_s, options.request_timeout_s),
            read_timeout=options.request_timeout_s,
            retries={"max_attempts": 1, "mode": "standard"},  # retries are ours
            max_pool_connections=max(10, options.concurrency * 2),
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        endpoint = options.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        session = boto3.session.Session()
        kwargs: dict[str, Any] = {"config": config}
        self.endpoint = safe_url(endpoint) if endpoint else None
        if endpoint:
            kwargs["endpoint_url"] = endpoint
        if session.region_name is None:
            kwargs["region_name"] = "us-east-1"
        self.client = session.client("s3", **kwargs)

    def full_key(self, key: str) -> str:
        return join(self.prefix, key)

    def is_retryable(self, exc: BaseException) -> bool:
        if isinstance(exc, self._bexc.ClientError):
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = exc.response.get("Error", {}).get("Code")
            return status in _RETRY_STATUS or code in _RETRY_CODES
        return super().is_retryable(exc)

    def describe(self, exc: BaseException) -> str:
        if isinstance(exc, self._bexc.ClientError):
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = exc.response.get("Error", {}).get("Code")
            return f"HTTP {status} {code}"
        if isinstance(exc, self._bexc.NoCredentialsError):
            return "no credentials"
        return super().describe(exc)

    def remedy(self, exc: BaseException) -> str:
        if isinstance(exc, self._bexc.NoCredentialsError):
            return (
                "Remedy: no AWS credentials were found by the boto3 chain; set AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or an instance/pod role."
            )
        if isinstance(exc, self._bexc.ClientError):
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = exc.response.get("Error", {}).get("Code")
            if code in _BAD_CREDENTIAL_CODES:
                return (
                    f"Remedy: the store rejected the credentials ({code}); check AWS_ACCESS_KEY_ID / "
                    f"AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN or AWS_PROFILE, and that endpoint_url "
                    f"({self.endpoint or 'AWS'}) is the store those credentials belong to."
                )
            if status == 403:
                return "Remedy: the credentials lack permission for this bucket/prefix (s3:GetObject, PutObject, ListBucket, DeleteObject)."
            if code == "NoSuchBucket":
                return f"Remedy: create the bucket {self.bucket!r} or fix the remote URL."
        if isinstance(exc, (self._bexc.EndpointConnectionError, self._bexc.ConnectTimeoutError)):
            return (
                f"Remedy: nothing answers at the endpoint {self.endpoint or 'of AWS S3'}; check endpoint_url / "
                f"AWS_ENDPOINT_URL, that the store is up, and the network (proxy, firewall, DNS)."
            )
        return super().remedy(exc)

    def exhausted_remedy(self, exc: BaseException) -> str:
        if isinstance(exc, (self._bexc.EndpointConnectionError, self._bexc.ConnectTimeoutError)):
            return self.remedy(exc)
        return super().exhausted_remedy(exc)

    def is_missing(self, exc: BaseException) -> bool:
        if isinstance(exc, self._bexc.ClientError):
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = exc.response.get("Error", {}).get("Code")
            return status == 404 and code in ("404", "NoSuchKey", "NotFound")
        return super().is_missing(exc)

    # ---- upload

    def put_bytes(self, key: str, data: bytes, deadline: Deadline) -> None:
        crc = _b64_crc32(zlib.crc32(data))
        self.retry(
            lambda: self.client.put_object(Bucket=self.bucket, Key=self.full_key(key), Body=data, ChecksumCRC32=crc),
            "upload of", key, deadline,
        )

    def put_file(
        self, path: str, key: str, size: int, checksum: str, deadline: Deadline, on_bytes: Callable[[int], None] | None = None
    ) -> str | None:
        opts = self.options
        if size < opts.multipart_threshold:
            data = _read_exact(path, 0, size + 1)
            if len(data) != size or layout.checksum_bytes(data, like=checksum) != checksum:
                raise _local_mismatch(path, self.where(key), "differs (size or checksum)")
            tag = self._put_small(key, data, checksum, deadline)
            if on_bytes is not None:
                on_bytes(size)
            return tag
        return self._put_multipart(path, key, size, checksum, deadline, on_bytes)

    def _put_small(self, key: str, data: bytes, checksum: str, deadline: Deadline) -> str | None:
        """One PUT of ``data`` (its checksum recorded with it); the object's tag."""
        crc = _b64_crc32(zlib.crc32(data))
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
        return _tag(resp)

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
                raise _local_mismatch(path, self.where(key), "differs (size or checksum)")

        _sent, composite, completed = self._put_parts(key, parts(), {"checksum": checksum}, deadline, on_bytes, check)
        # The tag as listings show it: some S3-compatible servers (rclone's) list a multipart object
        # under the MD5 of its bytes, not under the tag its completion answered.
        return self._verify_upload(key, size, checksum, composite, deadline) or _tag(completed)

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
        return size, digest.value(), self._verify_upload(key, size, "", composite, deadline) or _tag(completed)

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
        return sent, _b64_crc32(zlib.crc32(b"".join(crcs[i] for i in numbers))), completed

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
        recorded = _recorded(head)
        if recorded not in (None, checksum):
            problems.append("its recorded checksum differs")
        if got_crc and got_crc != crc:
            problems.append("the store's CRC32 differs from the bytes sent")
        if problems:
            raise RemoteError(
                f"uploaded object {self.where(key)} failed verification ({', '.join(problems)}); "
                f"the step is not committed and will be uploaded again"
            )
        return _tag(head)

    # ---- download

    def _get_object(self, key: str) -> Any:
        """GetObject's answer, or ``None`` when there is no such object (one request, no retry)."""
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self.full_key(key))
        except self._bexc.ClientError as exc:
            if self.is_missing(exc):
                return None
            raise

    def get_bytes(self, key: str, deadline: Deadline) -> bytes | None:
        def call() -> bytes | None:
            resp = self._get_object(key)
            return None if resp is None else resp["Body"].read()

        return self.retry(call, "download of", key, deadline)

    def get_range(self, key: str, offset: int, length: int, deadline: Deadline) -> bytes:
        if length <= 0:
            if not self.exists(key, deadline):
                raise self.translate(FileNotFoundError(key), "download of", key)
            return b""

        def call() -> bytes:
            try:
                resp = self.client.get_object(
                    Bucket=self.bucket, Key=self.full_key(key), Range=f"bytes={offset}-{offset + length - 1}"
                )
            except self._bexc.ClientError as exc:
                if exc.response.get("Error", {}).get("Code") == "InvalidRange":
                    head = self.client.head_object(Bucket=self.bucket, Key=self.full_key(key))
                    raise range_past_end(self.where(key), offset, length, int(head.get("ContentLength") or 0)) from exc
                raise
            data = resp["Body"].read()
            if len(data) != length:
                total = _total_of(resp)
                if total is not None and offset + length > total:
                    raise range_past_end(self.where(key), offset, length, total)
                raise _Transient(f"short ranged read of {self.where(key)}")
            return data

        return self.retry(call, "download of", key, deadline)

    def exists(self, key: str, deadline: Deadline) -> bool:
        def call() -> bool:
            try:
                self.client.head_object(Bucket=self.bucket, Key=self.full_key(key))
            except self._bexc.ClientError as exc:
                if self.is_missing(exc):
                    return False
                raise
            return True

        return self.retry(call, "lookup of", key, deadline)

    def get_file(
        self, key: str, path: str, size: int, checksum: str, deadline: Deadline, on_bytes: Callable[[int], None] | None = None
    ) -> None:
        try:
            self._get_file(key, path, size, checksum, deadline, on_bytes)
        except BaseException:
            try:
                os.unlink(path)
            except OSError:
                pass
            raise

    def _get_file(
        self, key: str, path: str, size: int, checksum: str, deadline: Deadline, on_bytes: Callable[[int], None] | None
    ) -> None:
        opts = self.options
        fk = self.full_key(key)
        if size < opts.multipart_threshold:
            def call() -> tuple[int, str]:
                resp = self.client.get_object(Bucket=self.bucket, Key=fk)
                with open(path, "wb") as f:
                    return _copy_checked(resp["Body"].iter_chunks(chunk_size=1 << 20), f, like=checksum)

            got_size, got_sha = self.retry(call, "download of", key, deadline)
            _check_download(path, self.where(key), size, checksum, got_size, got_sha)
            if on_bytes is not None:
                on_bytes(got_size)
            return
        with open(path, "wb") as f:
            f.truncate(size)
        got_size, got_sum = self._get_ranges(key, path, size, checksum, deadline, on_bytes)
        _check_download(path, self.where(key), size, checksum, got_size, got_sum)

    def _get_ranges(
        self, key: str, path: str, size: int, checksum: str, deadline: Deadline, on_bytes: Callable[[int], None] | None
    ) -> tuple[int, str]:
        """Ranged GETs in parallel, written in place and hashed in order as they arrive.

        A part waits in memory until the parts before it are hashed; each part
        holds a slot of ``part_window`` from its request until it is hashed,
        which bounds that memory to ``concurrency`` parts.
        """
        opts = self.options
        fk = self.full_key(key)
        digest = layout.Checksum.like(checksum)
        window = self.part_window
        lock = threading.Lock()
        waiting: dict[int, bytes] = {}
        hashed = [0]

        def absorb(off: int, data: bytes) -> None:
            with lock:
                waiting[off] = data
                while hashed[0] in waiting:
                    chunk = waiting.pop(hashed[0])
                    digest.update(chunk)
                    hashed[0] += len(chunk)
                    window.release()

        def fetch(off: int, length: int) -> None:
            def call() -> bytes:
                resp = self.client.get_object(Bucket=self.bucket, Key=fk, Range=f"bytes={off}-{off + length - 1}")
                total = _total_of(resp)
                if total is not None and total != size:
                    raise CorruptCheckpointError(
                        f"remote object {self.where(key)} is corrupt ({total} bytes, expected {size}); it was not "
                        f"loaded. Remedy: load an earlier step (load(step=...)) or set on_corrupt='fallback'; repair "
                        f"it from a node that still has the step (`shardckpt push`)."
                    )
                data = resp["Body"].read()
                if len(data) != length:
                    raise _Transient(f"short ranged read of {self.where(key)}")
                fd = os.open(path, os.O_WRONLY)
                try:
                    os.pwrite(fd, data, off)
                finally:
                    os.close(fd)
                return data

            try:
                data = self.retry(call, "download of", key, deadline)
            except BaseException:
                window.release()
                raise
            absorb(off, data)
            if on_bytes is not None:
                on_bytes(length)

        futures: list[concurrent.futures.Future] = []
        try:
            for off in range(0, size, opts.part_size):
                window.acquire()
                futures.append(self.pool().submit(fetch, off, min(opts.part_size, size - off)))
                if any(fut.done() and fut.exception() for fut in futures):
                    break
            for fut in futures:
                fut.result()
        finally:
            for fut in futures:
                if fut.cancel():
                    window.release()  # never ran
            concurrent.futures.wait(futures)
            with lock:
                for _ in waiting:
                    window.release()  # parts never hashed (an earlier one failed)
                waiting.clear()
        return hashed[0], digest.value()

    def recorded_checksum(self, key: str, like: str, deadline: Deadline) -> tuple[int, str] | None:
        def call() -> tuple[int, str] | None:
            try:
                head = self.client.head_object(Bucket=self.bucket, Key=self.full_key(key))
            except self._bexc.ClientError as exc:
                if self.is_missing(exc):
                    return None
                raise
            return int(head.get("ContentLength") or 0), str(_recorded(head) or "")

        got = self.retry(call, "lookup of", key, deadline)
        if got is not None and not got[1]:  # written without our metadata: hash its bytes
            return self.read_checksum(key, like, deadline)
        return got

    def read_checksum(self, key: str, like: str, deadline: Deadline) -> tuple[int, str] | None:
        def call() -> tuple[int, str] | None:
            resp = self._get_object(key)
            if resp is None:
                return None
            digest = layout.Checksum.like(like)
            n = 0
            for chunk in resp["Body"].iter_chunks(chunk_size=1 << 20):
                digest.update(chunk)
                n += len(chunk)
            return n, digest.value()

        return self.retry(call, "verification of", key, deadline)

    # ---- listing and deletion

    def _list(self, prefix: str, deadline: Deadline, delimiter: bool) -> tuple[list[str], dict[str, int]]:
        base = join(self.prefix, prefix) + "/" if join(self.prefix, prefix) else ""
        dirs: list[str] = []
        sizes: dict[str, int] = {}

        def call() -> None:
            dirs.clear()
            sizes.clear()
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": base}
            if delimiter:
                kwargs["Delimiter"] = "/"
            while True:
                resp = self.client.list_objects_v2(**kwargs)
                for cp in resp.get("CommonPrefixes", []):
                    dirs.append(cp["Prefix"][len(base):].rstrip("/"))
                for obj in resp.get("Contents", []):
                    sizes[obj["Key"][len(base):]] = int(obj["Size"])
                if not resp.get("IsTruncated"):
                    return
                kwargs["ContinuationToken"] = resp["NextContinuationToken"]

        self.retry(call, "listing of", prefix, deadline)
        return dirs, sizes

    def list_dirs(self, prefix: str, deadline: Deadline) -> list[str]:
        return sorted(self._list(prefix, deadline, True)[0])

    def list_sizes(self, prefix: str, deadline: Deadline) -> dict[str, int]:
        return self._list(prefix, deadline, False)[1]

    def list_tags(self, prefix: str, deadline: Deadline,
                  names: list[str] | None = None) -> dict[str, tuple[int, str]] | None:
        """One listing with ETags. Given ``names`` beyond one page (1,000 keys), the pages are read
        concurrently, each from the name before its share (``StartAfter``), not one after another."""
        base = join(self.prefix, prefix) + "/" if join(self.prefix, prefix) else ""
        wanted = sorted(names or [])
        starts: list[tuple[str | None, str | None]] = [(None, None)]
        if len(wanted) > _PAGE:
            starts = [(None if i == 0 else base + wanted[i - 1], base + wanted[min(i + _PAGE, len(wanted)) - 1])
                      for i in range(0, len(wanted), _PAGE)]

        def share(after: str | None, until: str | None) -> dict[str, tuple[int, str]]:
            def call() -> dict[str, tuple[int, str]]:
                got: dict[str, tuple[int, str]] = {}
                kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": base, "MaxKeys": _PAGE}
                if after is not None:
                    kwargs["StartAfter"] = after
                while True:
                    resp = self.client.list_objects_v2(**kwargs)
                    contents = resp.get("Contents", [])
                    for obj in contents:
                        got[obj["Key"][len(base):]] = (int(obj["Size"]), _tag(obj) or "")
                    if not resp.get("IsTruncated") or (until is not None and contents and contents[-1]["Key"] >= until):
                        return got
                    kwargs["ContinuationToken"] = resp["NextContinuationToken"]

            return self.retry(call, "listing of", prefix, deadline)

        out: dict[str, tuple[int, str]] = {}
        for part in self.run_all([lambda a=a, u=u: share(a, u) for a, u in starts]):
            out.update(part)
        return out

    def delete_prefix(self, prefix: str, deadline: Deadline) -> None:
        names = list(self.list_sizes(prefix, deadline))
        for i in range(0, len(names), 1000):
            batch = [{"Key": self.full_key(join(prefix, n))} for n in names[i : i + 1000]]
            self.retry(
                lambda b=batch: self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": b, "Quiet": True}),
                "deletion under", prefix, deadline,
            )

    def delete(self, key: str, deadline: Deadline) -> None:
        self.retry(lambda: self.client.delete_object(Bucket=self.bucket, Key=self.full_key(key)), "deletion of", key, deadline)


_PAGE = 1000
"""Keys per listing page (S3's maximum)."""


def _tag(resp: dict) -> str | None:
    """The ETag of a PUT, a completed multipart upload or a listed object, without its quotes."""
    tag = str(resp.get("ETag") or "").strip('"')
    return tag or None


def _recorded(head: dict) -> str | None:
    """The checksum an object was uploaded with, from a HEAD answer. User metadata names are
    case-insensitive (rclone answers "Checksum")."""
    return {k.lower(): v for k, v in (head.get("Metadata") or {}).items()}.get("checksum")


def _total_of(resp: dict) -> int | None:
    """The object's whole size from a ranged GET's ``Content-Range: bytes a-b/total``."""
    total = str(resp.get("ContentRange") or "").rpartition("/")[2]
    return int(total) if total.isdigit() else None
