"""What the network stores share: transfer options, bounded retries, thread pools, redaction.

Every call that touches the network is retried with capped exponential
backoff (full jitter) on throttling (503 SlowDown, 429), 5xx and connection
errors, up to ``max_attempts`` and never past the caller's
:class:`~shardckpt.stores.base.Deadline`. Retry decisions look at HTTP status
codes, S3 error codes and exception types, never at message text. Backend
errors leave as :class:`~shardckpt.errors.RemoteError` (an ``OSError``) with
``__cause__`` kept; messages name the object and the remedy and never carry
credentials. A ``RemoteError`` raised here carries ``retryable``: ``False``
when the store refused the request for a reason retries do not fix (a
missing bucket or object, rejected credentials, no permission), ``True`` when
a transient error outlasted the attempts or the deadline.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import random
import re
import socket
import threading
import time
from typing import Any, Callable, TypeVar

from shardckpt.errors import (
    ConfigError,
    CorruptCheckpointError,
    ObjectNotFoundError,
    RemoteError,
)
from shardckpt.stores.base import Deadline, Store, run_in_pool
from shardckpt.stores.transfer import StreamError, Transient

log = logging.getLogger("shardckpt")

T = TypeVar("T")

_MiB = 1 << 20
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

    compression: str = "off"
    """What the uploader does to the bytes it sends: ``auto``, ``off`` or a codec name
    (``CheckpointConfig.remote_compression``; the store itself moves bytes as they are)."""


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
            raise ConfigError(
                f"remote={safe_url(url)!r} needs boto3: pip install 'boto3' (see deploy/constraints.txt)"
            ) from exc
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


class NetworkStore(Store):
    """Retries, thread pools and error translation shared by the network stores; subclasses
    implement the raw calls."""

    retryable_types: tuple[type, ...] = (ConnectionError, TimeoutError, socket.timeout, Transient)

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

    def is_missing(self, exc: BaseException) -> bool:
        """Whether ``exc`` says there is no object under the key."""
        return isinstance(exc, FileNotFoundError)

    def translate(self, exc: BaseException, what: str, key: str) -> RemoteError:
        if self.is_missing(exc):
            err: RemoteError = ObjectNotFoundError(
                f"{what} {self.where(key)} failed: there is no such object. Remedy: check the URL and "
                f"that the step is committed there (`shardckpt ls`)."
            )
            err.__cause__ = exc
            return err
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
                log.debug("shardckpt: %s %s: %s; retry %d in %.2f s", what, self.where(key), self.describe(exc),
                          attempt, delay)
                time.sleep(delay)

    def once(self, fn: Callable[[], T], what: str, key: str) -> T:
        """``fn`` once (a stream cannot be sent again; the step's next attempt sends it anew), its errors
        translated as :meth:`retry` translates them; an error of the stream it reads (:func:`guarded`)
        is raised as it is."""
        try:
            return fn()
        except StreamError as exc:
            raise exc.__cause__  # type: ignore[misc]
        except (RemoteError, CorruptCheckpointError):
            raise
        except Exception as exc:  # noqa: BLE001 - classified below
            if not self.is_retryable(exc):
                raise self.translate(exc, what, key) from exc
            err = RemoteError(f"{what} {self.where(key)} failed ({self.describe(exc)}). {self.exhausted_remedy(exc)} "
                              f"An upload is retried later; nothing is committed remotely until it succeeds.")
            err.retryable = True
            raise err from exc

    def run_all(self, jobs: list[Callable[[], Any]], *, files: bool = False) -> list[Any]:
        """Run ``jobs`` concurrently; the first error cancels the rest and is raised.

        ``files=True`` runs whole-file jobs on their own pool: a file job may
        itself wait for part jobs, which run on the transfer pool.
        """
        if not jobs:
            return []
        if len(jobs) == 1:
            return [jobs[0]()]
        return run_in_pool(self.file_pool() if files else self.pool(), jobs)
