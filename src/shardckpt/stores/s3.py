"""S3 and S3-compatible stores through boto3.

``s3://bucket/prefix``: concurrent multipart transfers, our own retry policy
(:class:`~shardckpt.stores.network.NetworkStore`), S3's checksum headers.
The credentials come from the standard boto3 chain; ``endpoint_url`` (or
``AWS_ENDPOINT_URL``) points it at MinIO, Ceph RGW, rclone or any
S3-compatible store.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Any, Callable

from shardckpt.errors import CorruptCheckpointError
from shardckpt.format import layout
from shardckpt.stores.base import Deadline, join, range_past_end
from shardckpt.stores.network import NetworkStore, TransferOptions, safe_url, split_url
from shardckpt.stores.s3_upload import S3Uploads, etag_of, recorded_checksum_of
from shardckpt.stores.transfer import (
    Transient,
    check_download,
    copy_checked,
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


class S3Store(S3Uploads, NetworkStore):
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
                return ("Remedy: the credentials lack permission for this bucket/prefix "
                        "(s3:GetObject, PutObject, ListBucket, DeleteObject).")
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
                raise Transient(f"short ranged read of {self.where(key)}")
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
        self, key: str, path: str, size: int, checksum: str, deadline: Deadline,
        on_bytes: Callable[[int], None] | None = None
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
                    return copy_checked(resp["Body"].iter_chunks(chunk_size=1 << 20), f, like=checksum)

            got_size, got_sha = self.retry(call, "download of", key, deadline)
            check_download(path, self.where(key), size, checksum, got_size, got_sha)
            if on_bytes is not None:
                on_bytes(got_size)
            return
        with open(path, "wb") as f:
            f.truncate(size)
        got_size, got_sum = self._get_ranges(key, path, size, checksum, deadline, on_bytes)
        check_download(path, self.where(key), size, checksum, got_size, got_sum)

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
                    raise Transient(f"short ranged read of {self.where(key)}")
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
            return int(head.get("ContentLength") or 0), str(recorded_checksum_of(head) or "")

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
                        got[obj["Key"][len(base):]] = (int(obj["Size"]), etag_of(obj) or "")
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
        self.retry(lambda: self.client.delete_object(Bucket=self.bucket, Key=self.full_key(key)), "deletion of", key,
                   deadline)


_PAGE = 1000
"""Keys per listing page (S3's maximum)."""


def _total_of(resp: dict) -> int | None:
    """The object's whole size from a ranged GET's ``Content-Range: bytes a-b/total``."""
    total = str(resp.get("ContentRange") or "").rpartition("/")[2]
    return int(total) if total.isdigit() else None
