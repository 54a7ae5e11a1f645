"""The trainer's side of the uploader: start it, read its status, wait for it to drain.

The uploader itself (:mod:`shardckpt.node.uploader`) is a separate process per
node; the trainer never talks to it directly. It registers itself as a live
trainer of the node (so the uploader knows when to exit), starts the
uploader when none runs (``uploader="auto"``), reads ``status.json`` for
``Checkpointer.status()``, and on ``close()`` waits, bounded, until this
node's committed steps are committed remotely.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from typing import Any

from shardckpt import _dist
from shardckpt._text import fmt_bytes
from shardckpt.format import layout
from shardckpt.node.node_registry import (
    pid_alive,
    read_status,
    register_trainer,
    spawn_node_daemon,
    state_dir,
    unregister_trainer,
    uploader_running,
)
from shardckpt.node.uploader import failure_text
from shardckpt.options import CheckpointConfig, UploaderMode
from shardckpt.remote import commit as remote_commit
from shardckpt.stores import safe_url

log = logging.getLogger("shardckpt")

HEALTH_EVERY_S = 10.0
"""How often ``save()`` looks at the uploader's status file."""
WARN_EVERY_S = 60.0
"""Upload trouble is repeated in the trainer's log at most this often."""
ANNOUNCE_AFTER_S = 1.0
"""``close()`` logs its wait for uploads at INFO once it has waited this long (before: DEBUG)."""




def spawn_uploader(root: str, url: str, args: list[str]) -> None:
    """Start the uploader for ``root`` detached from the trainer (it outlives it).

    Returns once the uploader is forked; it reports through ``status.json``.
    """
    spawn_node_daemon(root, "node.uploader:sync_main", ["--local", root, "--remote", url, *args], "uploader.log")


class UploaderClient:
    """This trainer process's view of its node's uploader (``remote`` set)."""

    def __init__(self, config: CheckpointConfig, root: str) -> None:
        self.config = config
        self.root = root
        self.url = config.remote
        self._spawned_at: float | None = None
        self._trainer_file: str | None = None
        self.drain_report: dict[str, Any] | None = None
        self._next_check = 0.0
        self._warned: dict[str, float] = {}
        self._failed_warned: set[tuple[int, float]] = set()
        self.committer = _dist.local_rank() == 0
        """This rank looks after the uploader of its directory copy (set by :meth:`launch`)."""

    @property
    def active(self) -> bool:
        return self.config.uploader != UploaderMode.OFF

    def register(self) -> None:
        """Record this process as a live trainer of the node (the uploader exits once none is left)."""
        if not self.active:
            return
        os.makedirs(self.root, exist_ok=True)
        self._trainer_file = register_trainer(self.root)

    def launch(self, committer: bool) -> None:
        """At the first save or load: the committer of each directory copy starts its uploader (``auto``)."""
        self.committer = committer
        if not self.starts_uploader:
            return
        running = uploader_running(self.root)
        if running is not None:
            log.info("shardckpt: uploader pid %d already serves %s", running, self.root)
            return
        spawn_uploader(self.root, self.url, self.uploader_args())
        self._spawned_at = time.monotonic()
        log.info(
            "shardckpt: started the uploader for %s -> %s; log in %s",
            self.root, safe_url(self.url), os.path.join(state_dir(self.root), "uploader.log"),
        )

    @property
    def starts_uploader(self) -> bool:
        """This process starts (and restarts) its directory's uploader: ``auto`` mode, the copy's committer."""
        return self.config.uploader == UploaderMode.AUTO and self.committer

    def check_health(self, now: float | None = None) -> None:
        """Surface upload trouble in the trainer's own log (called by ``save()``; cheap, rate-limited).

        Reads the uploader's status file at most every ``HEALTH_EVERY_S``; warns
        when uploads fail (with the cause) or when no uploader runs while
        steps wait, at most once per ``WARN_EVERY_S`` per kind of trouble.
        An ``auto`` uploader that died is started again.
        """
        if not self.active or not self.committer:
            return
        now = time.monotonic() if now is None else now
        if now < self._next_check:
            return
        self._next_check = now + HEALTH_EVERY_S
        pending = remote_commit.pending_steps(self.root, self.url)
        if not pending:
            return
        info = read_status(self.root)
        running = uploader_running(self.root)
        if running is None and self.starts_uploader and (self._spawned_at is None or now - self._spawned_at > 60.0):
            self._warn(
                "restart", now,
                "shardckpt: the uploader of %s is not running while steps %s wait for %s; starting it again "
                "(its log: %s)", self.root, pending, safe_url(self.url),
                os.path.join(state_dir(self.root), "uploader.log"),
            )
            spawn_uploader(self.root, self.url, self.uploader_args())
            self._spawned_at = now
            return
        if running is None and not self.starts_uploader and self._spawned_at is None:
            self._warn(
                "absent", now,
                "shardckpt: steps %s of %s wait for upload to %s, but no uploader is running on this node. "
                "Remedy: start the sidecar (`shardckpt sync --local %s --remote %s`), or set uploader='auto'.",
                pending, self.root, safe_url(self.url), self.root, safe_url(self.url),
            )
            return
        self._warn_failed(info, pending)
        error = info.get("last_error")
        if error:
            self._warn(
                "error", now,
                "shardckpt: uploads to %s are failing: %s. Steps %s (%s) wait on the local disk; the uploader "
                "keeps retrying (its log: %s)",
                safe_url(self.url), error, pending,
                fmt_bytes(sum(remote_commit.local_bytes(self.root, s) for s in pending)),
                os.path.join(state_dir(self.root), "uploader.log"),
            )

    def _warn_failed(self, info: dict[str, Any], pending: list[int]) -> None:
        """Once per step the uploader reports not committed within ``remote_commit_timeout_s``."""
        for key, failed in sorted((info.get("failed_steps") or {}).items()):
            if not key.isdigit() or int(key) not in pending or not isinstance(failed, dict):
                continue
            tag = (int(key), failed.get("saved"))
            if tag in self._failed_warned:
                continue
            self._failed_warned.add(tag)
            log.warning("shardckpt: %s", failure_text(int(key), failed, safe_url(self.url)))

    def kick(self) -> None:
        """A step was committed here: wake the uploader (same host and PID namespace; else it polls)."""
        if not self.active or not self.committer:
            return
        self.wake()

    def wake(self) -> None:
        """Signal this directory's uploader to look now; any rank of the node may (a file is complete)."""
        if not self.active:
            return
        info = read_status(self.root)
        pid = uploader_running(self.root)
        # Only a process that is the uploader by pid *and* start time (in another PID
        # namespace the same number may be another process): else it polls anyway.
        if not pid or info.get("host") != socket.gethostname() or not pid_alive(pid, info.get("pid_start")):
            return
        try:
            os.kill(pid, signal.SIGUSR1)
        except (ProcessLookupError, PermissionError):
            pass

    def _warn(self, kind: str, now: float, message: str, *args: Any) -> None:
        if now - self._warned.get(kind, -WARN_EVERY_S) < WARN_EVERY_S:
            return
        self._warned[kind] = now
        log.warning(message, *args)

    def uploader_args(self) -> list[str]:
        cfg = self.config
        args = [
            "--exit-when-idle",
            "--node", _dist.node_id(),
            "--concurrency", str(cfg.transfer_concurrency),
            "--part-size", str(cfg.part_size),
            "--request-timeout", str(cfg.request_timeout_s),
            "--max-attempts", str(cfg.remote_max_attempts),
            "--backoff-max", str(cfg.backoff_max_s),
            "--step-deadline", str(cfg.step_deadline_s),
            "--compression", cfg.remote_compression,
            "--commit-timeout", str(cfg.remote_commit_timeout_s),
        ]
        if cfg.endpoint_url:
            args += ["--endpoint-url", cfg.endpoint_url]
        if cfg.remote_keep_last is not None:
            args += ["--keep-last", str(cfg.remote_keep_last)]
        if cfg.remote_keep_every is not None:
            args += ["--keep-every", str(cfg.remote_keep_every)]
        if cfg.keep_best is not None and cfg.best_metric:
            args += ["--keep-best", str(cfg.keep_best), "--best-metric", cfg.best_metric, "--best-mode", cfg.best_mode]
        return args

    def status(self, known_remote: set[int]) -> dict[str, Any]:
        """The ``Checkpointer.status()`` fields of the remote tier (no remote request)."""
        url = self.url
        info = read_status(self.root)
        pending = remote_commit.pending_steps(self.root, url) if self.active else []
        marked = [
            s for s in layout.committed_steps(self.root)
            if remote_commit.is_uploaded(os.path.join(self.root, layout.step_dirname(s)), url)
        ]
        known = [s for s in (info.get("latest_remote"), marked[-1] if marked else None) if isinstance(s, int)]
        known += list(known_remote)
        pid = uploader_running(self.root)
        return {
            "remote": safe_url(url),
            "latest_remote": max(known) if known else None,
            "pending_upload_steps": pending,
            "pending_upload_bytes": sum(remote_commit.local_bytes(self.root, s) for s in pending),
            "last_upload_error": info.get("last_error"),
            "failed_commits": {int(k): v for k, v in (info.get("failed_steps") or {}).items()
                               if k.isdigit() and int(k) in pending},
            "uploader": {"pid": pid, "running": pid is not None, "state": info.get("state"),
                         "mode": self.config.uploader.value},
            "drain": self.drain_report,
        }

    def close(self, timeout: float | None) -> None:
        try:
            if self.active and self.committer:
                self.drain_report = self.drain(timeout)
        finally:
            unregister_trainer(self._trainer_file)
            self._trainer_file = None

    def drain(self, timeout: float | None) -> dict[str, Any]:
        """Wait until this node's committed steps are committed remotely (bounded).

        Ends early when the uploader reports every pending step as failed for a
        reason retries cannot fix (see ``errors.RemoteError.retryable``); the
        report's ``ended`` says why the wait stopped.
        """
        url = self.url
        limit = self.config.drain_timeout_s if timeout is None else min(timeout, self.config.drain_timeout_s)
        t0 = time.monotonic()
        last_log = t0
        ended = "uploaded"
        first = remote_commit.pending_steps(self.root, url)
        announced = not first

        def announce(level: int, steps: list[int]) -> None:
            log.log(
                level,
                "shardckpt: close() waits up to %.0f s for steps %s (%s) to be committed on %s; set "
                "drain_timeout_s or pass close(timeout=...) to wait less (the uploader goes on after this "
                "process exits, unless the machine goes away)",
                limit, steps, fmt_bytes(sum(remote_commit.local_bytes(self.root, s) for s in steps)), safe_url(url),
            )

        if first:
            announce(logging.DEBUG, first)  # a wait of a moment is normal: INFO only once it lasts
        while True:
            pending = remote_commit.pending_steps(self.root, url)
            if not announced and pending and time.monotonic() - t0 > ANNOUNCE_AFTER_S:
                announced = True
                announce(logging.INFO, pending)
            running = uploader_running(self.root)
            starting = (
                running is None
                and self._spawned_at is not None
                and read_status(self.root).get("state") is None
                and time.monotonic() - self._spawned_at < 60.0
            )
            waited = time.monotonic() - t0
            if not pending:
                break
            if running is None and not starting and waited > 5.0:
                ended = "no uploader running"
                break
            if waited >= limit:
                ended = "drain_timeout_s"
                break
            # The uploader found that retrying will not help (a missing bucket, rejected
            # credentials): waiting out drain_timeout_s would only delay the report.
            if running is not None and set(pending) <= set(read_status(self.root).get("failed_permanently") or []):
                ended = "permanent upload error"
                break
            # Every pending step is past remote_commit_timeout_s: another node's part is missing.
            if (running is not None
                    and {str(s) for s in pending} <= set(read_status(self.root).get("failed_steps") or {})):
                ended = "remote_commit_timeout_s"
                break
            if time.monotonic() - last_log >= 10.0:
                last_log = time.monotonic()
                log.info(
                    "shardckpt: close() still waits for steps %s to be committed on %s (%.0f of %.0f s)%s",
                    pending, safe_url(url), waited, limit,
                    f"; last upload error: {read_status(self.root).get('last_error')}"
                    if read_status(self.root).get("last_error") else "",
                )
            time.sleep(0.2)
        info = read_status(self.root)
        report = {
            "pending_steps": pending,
            "pending_bytes": sum(remote_commit.local_bytes(self.root, s) for s in pending),
            "uploader_running": running is not None,
            "last_error": info.get("last_error"),
            "waited_s": round(time.monotonic() - t0, 3),
            "ended": ended,
        }
        if pending:
            if running is not None:
                what = (
                    f"the uploader (pid {running}) keeps working on them after this process exits; "
                    f"its log is {os.path.join(state_dir(self.root), 'uploader.log')}"
                )
            else:
                what = (
                    f"no uploader is running: run `shardckpt sync --local {self.root} --remote "
                    f"{safe_url(url)} --once` to upload them"
                )
            log.warning(
                "shardckpt: close(): steps %s (%s) of %s are not yet committed on %s after %.0f s; %s. "
                "Last upload error: %s",
                pending, fmt_bytes(report["pending_bytes"]), self.root, safe_url(url), report["waited_s"], what,
                report["last_error"],
            )
        return report
