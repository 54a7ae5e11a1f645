"""Remote tier: an object store behind a small interface, with bounded retries.

Stores are chosen by URL scheme:

* ``s3://bucket/prefix``  -> :class:`S3Store`, boto3 directly (concurrent
  multipart transfers, our own retry policy, S3's checksum headers). The
  credentials come from the standard boto3 chain; ``endpoint_url`` (or
  ``AWS_ENDPOINT_URL``) points it at MinIO, Ceph RGW or any S3-compatible
  store.
* anything else (``file:///mnt/nfs/run``, ``gs://...``) -> :class:`FsspecStore`
  through fsspec, imported lazily with an install hint.

Keys are ``/``-separated and relative to the URL's prefix. Every call that
touches the network is retried with capped exponential backoff (full jitter)
on throttling (503 SlowDown, 429), 5xx and connection errors, up to
``max_attempts`` and never past the caller's :class:`Deadline`. Retry
decisions look at HTTP status codes, S3 error codes and exception types,
never at message text. Backend errors leave this module as
:class:`~shardckpt.errors.RemoteError` (an ``OSError``) with ``__cause__``
kept; messages name the object and the remedy and never carry credentials.
A ``RemoteError`` raised here carries ``retryable``: ``False`` when the store
refused the request for a reason retries do not fix (a missing bucket,
rejected credentials, no permission), ``True`` when a transient error
outlasted the attempts or the deadline.

Store interface (every method may be called from several threads)::

    put_file(path, key, size, checksum, deadline)  upload, then verify (size + checksum)
    get_file(key, path, size, checksum, deadline)  download to path, verify before returning
    read_checksum(key, like, deadline) -> (size, checksum) | None   stream an object through its checksum
    put_bytes(key, data, deadline) / get_bytes(key, deadline) -> bytes | None
    exists(key, deadline) -> bool
    list_dirs(prefix, deadline) -> names of the "directories" directly under prefix
    list_sizes(prefix, deadline) -> {name: size} of the objects under prefix
    delete_prefix(prefix, deadline)
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import logging
import os
import random
import re
import socket
import threading
import time
import uuid
import zlib
from typing import Any, Callable, TypeVar

from shardckpt import _failpoints
from shardckpt.format import layout
from shardckpt.errors import ConfigError, CorruptCheckpointError, RemoteError

log = logging.getLogger("shardckpt")

T = TypeVar("T")

_MiB = 1 << 20
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
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")


@dataclasses.dataclass(kw_only=True)
class TransferOptions:
    """How the remote tier moves bytes. Built from :class:`CheckpointConfig` fields."""

    endpoint_url: str | None = None
    """S3-compatible endpoint; ``None`` uses ``AWS_ENDPOINT_URL`` or AWS itself."""

    concurrency: int = 8
    """Requests in flight at once (across files and parts of one file)."""

    part_size: int = 32 * _MiB
    """Multipart part size (upload) and ranged-GET size (download) in bytes."""

    multipart_threshold: int = 64 * _MiB
    """Files at least this large go multipart / ranged; smaller ones in one request."""

    request_timeout_s: float = 60.0
    """Socket read timeout of one request (a stalled request is retried)."""

    connect_timeout_s: float = 10.0
    """Connect timeout of one request."""

    max_attempts: int = 8
    """Attempts per request, the first included."""

    backoff_base_s: float = 0.2
    """First retry waits up to this long (full jitter), doubling per attempt ..."""

    backoff_max_s: float = 10.0
    """... capped at this."""

    step_deadline_s: float = 1800.0
    """Upload or download of one step gives up (to be retried later) after this long."""

    storage_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Extra keyword arguments of the fsspec filesystem (non-S3 URLs)."""


class Deadline:
    """A point in time that bounds a whole operation (all requests and retries)."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self._end = None if seconds is None else time.monotonic() + seconds

    def remaining(self) -> float:
        return float("inf") if self._end is None else self._end - time.monotonic()

    def expired(self) -> bool:
        return self.remaining() <= 0


def redact(text: str) -> str:
    """Drop URL credentials and the values of secret environment variables from ``text``."""
    text = re.sub(r"(?<=://)[^/@\s:]+:[^/@\s]+@", "***@", text)
    for name in _SECRET_ENV + ("AWS_ACCESS_KEY_ID",):
        value = os.environ.get(name)
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return text


def safe_url(url: str) -> str:
    return redact(url)


def split_url(url: str) -> tuple[str, str]:
    """``scheme://rest`` -> (scheme, rest without trailing slash)."""
    if "://" not in url:
        raise ConfigError(f"remote must be a URL such as s3://bucket/prefix or file:///path, got {safe_url(url)!r}")
    scheme, rest = url.split("://", 1)
    return scheme.lower(), rest.rstrip("/")


def check_remote_url(url: str) -> None:
    """Validate ``url`` and that its backend is importable; raises :class:`ConfigError`."""
    scheme, rest = split_url(url)
    if scheme in ("s3", "s3a"):
        bucket = rest.split("/", 1)[0]
        if not bucket:
            raise ConfigError(f"remote={safe_url(url)!r} names no bucket; use s3://bucket/prefix")
        try:
            import boto3  # noqa: F401
        except ImportError as exc:
            raise ConfigError(f"remote={safe_url(url)!r} needs boto3: pip install 'boto3' (see deploy/constraints.txt)") from exc
        return
    try:
        import fsspec
    except ImportError as exc:
        raise ConfigError(f"remote={safe_url(url)!r} needs fsspec: pip install fsspec") from exc
    try:
        fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError) as exc:
        raise ConfigError(
            f"remote={safe_url(url)!r}: no fsspec backend for {scheme!r} ({redact(str(exc))}); "
            f"install the package fsspec names for it"
        ) from exc


def open_store(url: str, options: TransferOptions | None = None) -> "Store":
    check_remote_url(url)
    options = options or TransferOptions()
    scheme, _ = split_url(url)
    if scheme in ("s3", "s3a"):
        return S3Store(url, options)
    return FsspecStore(url, options)


def join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


def _copy_checked(chunks: Any, dst: Any, like: str | None = None) -> tuple[int, str]:
    """Write ``chunks`` to the open file ``dst``; their total size and checksum (algorithm of ``like``)."""
    digest = layout.Checksum.like(like)
    n = 0
    for chunk in chunks:
        digest.update(chunk)
        dst.write(chunk)
        n += len(chunk)
    return n, digest.value()


def _file_chunks(f: Any, size: int = 8 << 20) -> Any:
    return iter(lambda: f.read(size), b"")


def _b64_crc32(value: int) -> str:
    return base64.b64encode(value.to_bytes(4, "big")).decode()


class _Transient(Exception):
    """A failure worth retrying that did not come as a backend exception."""


class Store:
    """Common retry and verification logic; subclasses implement the raw calls."""

    retryable_types: tuple[type, ...] = (ConnectionError, TimeoutError, socket.timeout, _Transient)

    def __init__(self, url: str, options: TransferOptions) -> None:
        self.url = url.rstrip("/")
        self.options = options
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._file_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        # Bounds the multipart buffers in memory across all files at once.
        self.part_window = threading.BoundedSemaphore(max(2, options.concurrency))

    # ---- helpers shared by backends

    def where(self, key: str) -> str:
        return safe_url(f"{self.url}/{key}")

    def pool(self) -> concurrent.futures.ThreadPoolExecutor:
        """Threads for requests (parts and small objects)."""
        return self._lazy_pool("_pool", "shardckpt-xfer")

    def file_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        """Threads for whole files (each submits its parts to ``pool``)."""
        return self._lazy_pool("_file_pool", "shardckpt-file")

    def _lazy_pool(self, attr: str, prefix: str) -> concurrent.futures.ThreadPoolExecutor:
        with self._pool_lock:
            pool = getattr(self, attr)
            if pool is None:
                pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.options.concurrency, thread_name_prefix=prefix
                )
                setattr(self, attr, pool)
            return pool

    def close(self) -> None:
        with self._pool_lock:
            pools, self._pool, self._file_pool = (self._pool, self._file_pool), None, None
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    def is_retryable(self, exc: BaseException) -> bool:
        return isinstance(exc, self.retryable_types)

    def describe(self, exc: BaseException) -> str:
        return redact(f"{type(exc).__name__}: {exc}")

    def translate(self, exc: BaseException, what: str, key: str) -> RemoteError:
        err = RemoteError(f"{what} {self.where(key)} failed ({self.describe(exc)}). {self.remedy(exc)}")
        err.__cause__ = exc
        err.retryable = False  # a missing bucket, rejected credentials, ...: retrying as is will not help
        return err

    def remedy(self, exc: BaseException) -> str:
        return "Remedy: check that the remote is reachable and the credentials allow this operation."

    def exhausted_remedy(self, exc: BaseException) -> str:
        """What to do when a retryable error persisted through every attempt."""
        return (
            "Remedy: check the remote's health and network; raise remote_max_attempts / step_deadline_s "
            "for a slow store."
        )

    def retry(self, fn: Callable[[], T], what: str, key: str, deadline: Deadline) -> T:
        """Call ``fn`` until it succeeds, a non-retryable error, ``max_attempts`` or the deadline."""
        opts = self.options
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 - classified below
                if isinstance(exc, (RemoteError, CorruptCheckpointError)):
                    raise
                if not self.is_retryable(exc):
                    raise self.translate(exc, what, key) from exc
                delay = random.uniform(0, min(opts.backoff_max_s, opts.backoff_base_s * (2 ** (attempt - 1))))
                if attempt >= opts.max_attempts or deadline.remaining() <= delay:
                    reason = (
                        f"{attempt} attempts" if attempt >= opts.max_attempts
                        else f"the deadline of {deadline.seconds:.0f} s"
                    )
                    err = RemoteError(
                        f"{what} {self.where(key)} still failing after {reason} "
                        f"(last error {self.describe(exc)}). {self.exhausted_remedy(exc)} "
                        f"An upload is retried later; nothing is committed remotely until it succeeds."
                    )
                    err.retryable = True  # transient by kind; may succeed later
                    raise err from exc
                log.debug("shardckpt: %s %s: %s; retry %d in %.2f s", what, self.where(key), self.describe(exc), attempt, delay)
                time.sleep(delay)

    def run_all(self, jobs: list[Callable[[], Any]], *, files: bool = False) -> list[Any]:
        """Run ``jobs`` concurrently; the first error cancels the rest and is raised.

        ``files=True`` runs whole-file jobs on their own pool: a file job may
        itself wait for part jobs, which run on the transfer pool.
        """
        if not jobs:
            return []
        if len(jobs) == 1:
            return [jobs[0]()]
        pool = self.file_pool() if files else self.pool()
        futures = [pool.submit(job) for job in jobs]
        try:
            return [f.result() for f in futures]
        finally:
            for f in futures:
                f.cancel()
            concurrent.futures.wait(futures)

    # ---- interface

    def put_file(
        self, path: str, key: str, size: int, checksum: str, deadline: Deadline, on_bytes: Callable[[int], None] | None = None
    ) -> None:
        """Upload ``path``; ``on_bytes(n)`` is called as parts of it are confirmed stored."""
        raise NotImplementedError

    def get_file(
        self, key: str, path: str, size: int, checksum: str, deadline: Deadline, on_bytes: Callable[[int], None] | None = None
    ) -> None:
        """Download to ``path``; ``on_bytes(n)`` is called as parts of it arrive."""
        raise NotImplementedError

    def read_checksum(self, key: str, like: str, deadline: Deadline) -> tuple[int, str] | None:
        """Size and checksum (the algorithm of ``like``) of the stored object; ``None`` when absent."""
        raise NotImplementedError

    def recorded_checksum(self, key: str, like: str, deadline: Deadline) -> tuple[int, str] | None:
        """Size and checksum of the stored object as cheaply as the store can tell: the checksum
        recorded with it at upload (one HEAD), else computed from its bytes; ``None`` when absent."""
        return self.read_checksum(key, like, deadline)

    def put_bytes(self, key: str, data: bytes, deadline: Deadline) -> None:
        raise NotImplementedError

    def get_bytes(self, key: str, deadline: Deadline) -> bytes | None:
        raise NotImplementedError

    def get_range(self, key: str, offset: int, length: int, deadline: Deadline) -> bytes:
        """Bytes [offset, offset + length) of the stored object (one request, retried); a short
        answer is retried, a missing object is a :class:`RemoteError`."""
        raise NotImplementedError

    def exists(self, key: str, deadline: Deadline) -> bool:
        raise NotImplementedError

    def list_dirs(self, prefix: str, deadline: Deadline) -> list[str]:
        raise NotImplementedError

    def list_sizes(self, prefix: str, deadline: Deadline) -> dict[str, int]:
        raise NotImplementedError

    def delete_prefix(self, prefix: str, deadline: Deadline) -> None:
        raise NotImplementedError


def _read_exact(path: str, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(length)
    return data


def _local_mismatch(path: str, key_where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"local file {path} {what} than its manifest entry, so it was not uploaded to {key_where}. "
        f"Remedy: the local copy is damaged; run `shardckpt verify` on its directory and save a new step."
    )


def _check_download(path: str, where: str, size: int, checksum: str, got_size: int, got_sum: str) -> None:
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


class S3Store(Store):
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
        self.retryable_types = Store.retryable_types + (
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

    def _is_missing(self, exc: BaseException) -> bool:
        if isinstance(exc, self._bexc.ClientError):
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = exc.response.get("Error", {}).get("Code")
            return status == 404 and code in ("404", "NoSuchKey", "NotFound")
        return False

    # ---- upload

    def put_bytes(self, key: str, data: bytes, deadline: Deadline) -> None:
        crc = _b64_crc32(zlib.crc32(data))
        self.retry(
            lambda: self.client.put_object(Bucket=self.bucket, Key=self.full_key(key), Body=data, ChecksumCRC32=crc),
            "upload of", key, deadline,
        )

    def put_file(
        self, path: str, key: str, size: int, checksum: str, deadline: Deadline, on_bytes: Callable[[int], None] | None = None
    ) -> None:
        opts = self.options
        fk = self.full_key(key)
        if size < opts.multipart_threshold:
            data = _read_exact(path, 0, size + 1)
            if len(data) != size or layout.checksum_bytes(data, like=checksum) != checksum:
                raise _local_mismatch(path, self.where(key), "differs (size or checksum)")
            crc = _b64_crc32(zlib.crc32(data))
            resp = self.retry(
                lambda: self.client.put_object(
                    Bucket=self.bucket, Key=fk, Body=data, ChecksumCRC32=crc, Metadata={"checksum": checksum}
                ),
                "upload of", key, deadline,
            )
            if resp.get("ChecksumCRC32") != crc:
                # The store did not confirm the checksum of what it stored: look.
                self._verify_upload(key, size, checksum, crc, deadline)
            if on_bytes is not None:
                on_bytes(size)
            return
        self._put_multipart(path, key, size, checksum, deadline, on_bytes)

    def _put_multipart(
        self, path: str, key: str, size: int, checksum: str, deadline: Deadline, on_bytes: Callable[[int], None] | None
    ) -> None:
        opts = self.options
        fk = self.full_key(key)
        created = self.retry(
            lambda: self.client.create_multipart_upload(
                Bucket=self.bucket, Key=fk, Metadata={"checksum": checksum}, ChecksumAlgorithm="CRC32"
            ),
            "start of multipart upload", key, deadline,
        )
        upload_id = created["UploadId"]
        nparts = (size + opts.part_size - 1) // opts.part_size
        digest = layout.Checksum.like(checksum)
        crcs: list[bytes] = [b""] * nparts
        etags: list[str] = [""] * nparts
        window = self.part_window
        futures: list[concurrent.futures.Future] = []

        def send(number: int, data: bytes) -> None:
            try:
                crc = zlib.crc32(data).to_bytes(4, "big")
                crcs[number - 1] = crc
                resp = self.retry(
                    lambda: self.client.upload_part(
                        Bucket=self.bucket, Key=fk, UploadId=upload_id, PartNumber=number, Body=data,
                        ChecksumCRC32=base64.b64encode(crc).decode(),
                    ),
                    f"upload of part {number}/{nparts} of", key, deadline,
                )
                etags[number - 1] = resp["ETag"]
                if on_bytes is not None:
                    on_bytes(len(data))
            finally:
                window.release()

        try:
            with open(path, "rb") as f:
                for number in range(1, nparts + 1):
                    data = f.read(opts.part_size)
                    digest.update(data)
                    window.acquire()
                    futures.append(self.pool().submit(send, number, data))
                    if any(fut.done() and fut.exception() for fut in futures):
                        break
                tail = f.read(1)
            for fut in futures:
                fut.result()
            if digest.value() != checksum or tail or len(futures) != nparts:
                raise _local_mismatch(path, self.where(key), "differs (size or checksum)")
            parts = [
                {"PartNumber": i + 1, "ETag": etags[i], "ChecksumCRC32": base64.b64encode(crcs[i]).decode()}
                for i in range(nparts)
            ]
            self.retry(
                lambda: self.client.complete_multipart_upload(
                    Bucket=self.bucket, Key=fk, UploadId=upload_id, MultipartUpload={"Parts": parts}
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
        composite = _b64_crc32(zlib.crc32(b"".join(crcs)))
        self._verify_upload(key, size, checksum, composite, deadline)

    def _verify_upload(self, key: str, size: int, checksum: str, crc: str, deadline: Deadline) -> None:
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

    # ---- download

    def _get_object(self, key: str) -> Any:
        """GetObject's answer, or ``None`` when there is no such object (one request, no retry)."""
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self.full_key(key))
        except self._bexc.ClientError as exc:
            if self._is_missing(exc):
                return None
            raise

    def get_bytes(self, key: str, deadline: Deadline) -> bytes | None:
        def call() -> bytes | None:
            resp = self._get_object(key)
            return None if resp is None else resp["Body"].read()

        return self.retry(call, "download of", key, deadline)

    def get_range(self, key: str, offset: int, length: int, deadline: Deadline) -> bytes:
        def call() -> bytes:
            resp = self.client.get_object(
                Bucket=self.bucket, Key=self.full_key(key), Range=f"bytes={offset}-{offset + length - 1}"
            )
            data = resp["Body"].read()
            if len(data) != length:
                raise _Transient(f"short ranged read of {self.where(key)}")
            return data

        return self.retry(call, "download of", key, deadline)

    def exists(self, key: str, deadline: Deadline) -> bool:
        def call() -> bool:
            try:
                self.client.head_object(Bucket=self.bucket, Key=self.full_key(key))
            except self._bexc.ClientError as exc:
                if self._is_missing(exc):
                    return False
                raise
            return True

        return self.retry(call, "lookup of", key, deadline)

    def get_file(
        self, key: str, path: str, size: int, checksum: str, deadline: Deadline, on_bytes: Callable[[int], None] | None = None
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
                if self._is_missing(exc):
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


def _recorded(head: dict) -> str | None:
    """The checksum an object was uploaded with, from a HEAD answer. User metadata names are
    case-insensitive (rclone answers "Checksum")."""
    return {k.lower(): v for k, v in (head.get("Metadata") or {}).items()}.get("checksum")


_XATTR = "user.shardckpt.checksum"
"""Extended attribute of a ``file://`` remote object: the checksum it was uploaded with."""


class FsspecStore(Store):
    """Any fsspec filesystem (``file://`` for NFS-style mounts, ``gs://``, ...)."""

    def __init__(self, url: str, options: TransferOptions) -> None:
        super().__init__(url, options)
        import fsspec

        scheme, rest = split_url(url)
        self.fs = fsspec.filesystem(scheme, **options.storage_options)
        self.root = rest if scheme != "file" else "/" + rest.lstrip("/")
        self.retryable_types = Store.retryable_types
        self.local = scheme in ("file", "local")
        """A filesystem path (``file://``, e.g. an NFS mount): writes go to a temporary name,
        are fsynced and renamed, so a crash never leaves a partial object under its name."""

    def is_retryable(self, exc: BaseException) -> bool:
        if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
            return False
        return isinstance(exc, (OSError, _Transient)) or super().is_retryable(exc)

    def path(self, key: str) -> str:
        return self.root + ("/" + key.strip("/") if key.strip("/") else "")

    def _write(
        self, key: str, chunks: Callable[[], Any], like: str | None = None, expect: tuple[int, str] | None = None
    ) -> tuple[int, str]:
        """Write an object; returns the size and checksum of what was written.

        With ``expect`` (size, checksum), an object whose bytes differ is not
        put in place (on a local filesystem; object stores replace whole objects anyway).
        """
        target = self.path(key)
        parent = target.rsplit("/", 1)[0]
        self.fs.makedirs(parent, exist_ok=True)
        if not self.local:
            with self.fs.open(target, "wb") as f:
                return _copy_checked(chunks(), f, like=like)
        tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                got = _copy_checked(chunks(), f, like=like)
                _failpoints.hit("remote.file_written")
                f.flush()
                os.fsync(f.fileno())
            if expect is None or got == expect:
                os.replace(tmp, target)
                layout.fsync_dir(parent)
            return got
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def put_bytes(self, key: str, data: bytes, deadline: Deadline) -> None:
        self.retry(lambda: self._write(key, lambda: [data]), "upload of", key, deadline)

    def put_file(
        self, path: str, key: str, size: int, checksum: str, deadline: Deadline, on_bytes: Callable[[int], None] | None = None
    ) -> None:
        def chunks():
            with open(path, "rb") as f:
                yield from _file_chunks(f)

        n, digest = self.retry(lambda: self._write(key, chunks, like=checksum, expect=(size, checksum)), "upload of", key, deadline)
        if n != size or digest != checksum:
            raise _local_mismatch(path, self.where(key), "differs (size or checksum)")
        if self.local:
            # The checksum goes with the file (its inode: a file written over it by anyone
            # else has none), so that the commit's identity check need not read it again.
            try:
                os.setxattr(self.path(key), _XATTR, checksum.encode())
            except (OSError, AttributeError):
                pass
        got = self.retry(lambda: self.fs.info(self.path(key))["size"], "verification of", key, deadline)
        if got != size:
            raise RemoteError(f"uploaded object {self.where(key)} is {got} bytes, expected {size}; it will be retried")
        if on_bytes is not None:
            on_bytes(size)

    def get_bytes(self, key: str, deadline: Deadline) -> bytes | None:
        def call() -> bytes | None:
            try:
                with self.fs.open(self.path(key), "rb") as f:
                    return f.read()
            except FileNotFoundError:
                return None

        return self.retry(call, "download of", key, deadline)

    def exists(self, key: str, deadline: Deadline) -> bool:
        return self.retry(lambda: self.fs.exists(self.path(key)), "lookup of", key, deadline)

    def get_range(self, key: str, offset: int, length: int, deadline: Deadline) -> bytes:
        def call() -> bytes:
            with self.fs.open(self.path(key), "rb") as f:
                f.seek(offset)
                data = f.read(length)
            if len(data) != length:
                raise _Transient(f"short ranged read of {self.where(key)}")
            return data

        return self.retry(call, "download of", key, deadline)

    def recorded_checksum(self, key: str, like: str, deadline: Deadline) -> tuple[int, str] | None:
        if self.local:
            try:
                path = self.path(key)
                recorded = os.getxattr(path, _XATTR).decode()
                return os.path.getsize(path), recorded
            except FileNotFoundError:
                return None
            except (OSError, AttributeError, UnicodeDecodeError):
                pass  # no extended attributes here: hash the bytes
        return self.read_checksum(key, like, deadline)

    def read_checksum(self, key: str, like: str, deadline: Deadline) -> tuple[int, str] | None:
        def call() -> tuple[int, str] | None:
            digest = layout.Checksum.like(like)
            n = 0
            try:
                with self.fs.open(self.path(key), "rb") as f:
                    for chunk in _file_chunks(f):
                        digest.update(chunk)
                        n += len(chunk)
            except FileNotFoundError:
                return None
            return n, digest.value()

        return self.retry(call, "verification of", key, deadline)

    def get_file(
        self, key: str, path: str, size: int, checksum: str, deadline: Deadline, on_bytes: Callable[[int], None] | None = None
    ) -> None:
        def call() -> tuple[int, str]:
            with self.fs.open(self.path(key), "rb") as src, open(path, "wb") as dst:
                return _copy_checked(_file_chunks(src), dst, like=checksum)

        got_size, got_sha = self.retry(call, "download of", key, deadline)
        _check_download(path, self.where(key), size, checksum, got_size, got_sha)
        if on_bytes is not None:
            on_bytes(got_size)

    def _ls(self, prefix: str) -> list[dict]:
        try:
            return self.fs.ls(self.path(prefix), detail=True)
        except FileNotFoundError:
            return []

    def list_dirs(self, prefix: str, deadline: Deadline) -> list[str]:
        entries = self.retry(lambda: self._ls(prefix), "listing of", prefix, deadline)
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory")

    def list_sizes(self, prefix: str, deadline: Deadline) -> dict[str, int]:
        base = self.path(prefix).rstrip("/")

        def call() -> dict[str, int]:
            try:
                found = self.fs.find(base, detail=True)
            except FileNotFoundError:
                return {}
            out = {}
            for name, info in found.items():
                name = name if name.startswith("/") or not base.startswith("/") else name
                rel = name[len(base):].lstrip("/") if name.startswith(base) else name.rsplit("/", 1)[-1]
                out[rel] = int(info.get("size") or 0)
            return out

        return self.retry(call, "listing of", prefix, deadline)

    def delete_prefix(self, prefix: str, deadline: Deadline) -> None:
        def call() -> None:
            try:
                self.fs.rm(self.path(prefix), recursive=True)
            except FileNotFoundError:
                pass

        self.retry(call, "deletion under", prefix, deadline)

    def delete(self, key: str, deadline: Deadline) -> None:
        def call() -> None:
            try:
                self.fs.rm(self.path(key))
            except FileNotFoundError:
                pass

        self.retry(call, "deletion of", key, deadline)
