"""The per-node uploader daemon: ``shardckpt sync``.

One process per node (per local directory) uploads every committed local
step to the remote and commits it there with the protocol of
:mod:`shardckpt.remote.commit`; the shard files of a save still being
written are uploaded as the writer publishes them (:mod:`shardckpt.remote.early_upload`). It is started by a
trainer (see
:mod:`shardckpt.node.uploader_client`), by a sidecar or by systemd, holds
``uploader.lock`` so that a second one exits at once, and reports through
``status.json`` (:mod:`shardckpt.node.node_registry`). It imports no torch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import select
import signal
import socket
import threading
import time
from typing import Any

from shardckpt.errors import RemoteError
from shardckpt.format import codec, layout
from shardckpt.format.node_state import make_state_dir, write_private
from shardckpt.format.retention import RetentionPolicy, policy_from
from shardckpt.node.node_registry import (
    acquire_lock,
    daemon_logging,
    lock_path,
    process_record,
    state_dir,
    trainers_alive,
)
from shardckpt.options import CheckpointConfig
from shardckpt.remote import auto_compress, node_markers
from shardckpt.remote import index as remote_index
from shardckpt.remote.commit import (
    COMMITTED,
    SUPERSEDED,
    WAITING,
    MarkerCache,
    local_bytes,
    pending_steps,
    present_files,
    push_step,
)
from shardckpt.remote.early_upload import EarlyUploads
from shardckpt.remote.listing import remote_steps
from shardckpt.stores import Deadline, Store, open_store, redact, safe_url

log = logging.getLogger("shardckpt")


@dataclasses.dataclass
class _StepState:
    attempts: int = 0
    next_try: float = 0.0
    error: str | None = None
    permanent: bool = False
    marker_digest: str | None = None
    waiting: str = ""
    waits: int = 0
    """Passes in a row that found the step waiting for other nodes (its poll backs off)."""
    waiting_since: float = 0.0
    failed: dict[str, Any] | None = None
    """Set once the step is past ``remote_commit_timeout_s`` uncommitted: what is missing."""
    committer: bool = False
    """This node commits the step."""


WAIT_MAX_S = 30.0
"""Cap of the backoff between two polls of one step that waits for other nodes. Below it a
step is polled again after half the time it has waited so far (at least ``poll_s``): a commit
is seen at most 50% later than it happened."""

YOUNG_S = 120.0
"""A step waiting for other nodes for less than this is *young*: the young steps share one
poll per ``poll_s`` (each at its own backoff). Older steps, blocked by a node that is gone,
share one poll per ``OLD_SLOT_S`` between them all: what a node sends while steps are blocked
does not grow with their number or with time."""

OLD_SLOT_S = 5.0
"""Spacing of the polls shared by all the steps waiting longer than ``YOUNG_S`` (a poll is at
most 4 requests: at most 0.8 requests/s per node)."""

COMMIT_POLL_S = 0.5
"""The committer polls the markers of a young step at least this often: the commit follows the
last node's marker by at most this plus the commit's own requests."""


class Uploader:
    """Uploads every committed step of one node's ``local_dir`` to the remote.

    ``exit_when_idle``: exit once nothing is pending and no trainer of this
    node is alive (how the trainer-started uploader ends). ``once``: exit
    once nothing is pending or every pending step failed once. Otherwise run
    until SIGTERM / SIGINT (a sidecar).
    """

    def __init__(
        self,
        root: str,
        store: Store,
        *,
        node: str,
        policy: RetentionPolicy | None = None,
        poll_s: float = 0.5,
        exit_when_idle: bool = False,
        once: bool = False,
        give_up_s: float = 600.0,
        commit_timeout_s: float = 1800.0,
    ) -> None:
        self.root = os.path.abspath(root)
        self.store = store
        self.node = node
        self.policy = policy
        self.poll_s = poll_s
        self.exit_when_idle = exit_when_idle
        self.once = once
        self.give_up_s = give_up_s
        self.commit_timeout_s = commit_timeout_s
        self._next_wait_poll = 0.0
        self._next_old_poll = 0.0
        self.markers = MarkerCache()
        """Node markers read by the committer's polls: each is read once per step."""
        self.steps: dict[int, _StepState] = {}
        self.latest_remote: int | None = None
        self.last_error: str | None = None
        self.last_error_step: int | None = None
        self.last_error_time: float | None = None
        self.uploaded_bytes = 0
        self._stop = threading.Event()
        self._stop_requested = False
        # Trainers wake the uploader with a signal. A signal handler that takes a lock (Event.set)
        # deadlocks when it interrupts the main thread holding that lock (in Event.wait/clear), so
        # the handler only writes a byte to a pipe, and the loop waits on the pipe.
        self._kick_r, self._kick_w = os.pipe()
        os.set_blocking(self._kick_r, False)
        os.set_blocking(self._kick_w, False)
        self._lock_fd: int | None = None
        self._last_status: dict[str, Any] = {}
        self._last_status_time = 0.0
        self._last_progress = time.monotonic()
        self.early = EarlyUploads()
        """Files of saves still being written, uploaded before their local commit."""

    # ---- lifecycle

    def acquire_lock(self, wait_s: float = 2.0) -> bool:
        make_state_dir(self.root)
        fd = acquire_lock(lock_path(self.root), wait_s)
        if fd is None:
            return False
        self._lock_fd = fd
        return True

    def stop(self, *_: Any) -> None:
        self._stop_requested = True
        self.wake()

    def wake(self, *_: Any) -> None:
        """A trainer committed a step (it sends ``KICK_SIGNAL``): look now rather than at the next poll."""
        try:
            os.write(self._kick_w, b"\0")
        except OSError:  # the pipe is full: a wake-up is pending already
            pass

    def _sleep(self) -> None:
        """Until the next poll, or a wake-up (whichever comes first)."""
        select.select([self._kick_r], [], [], self.poll_s)
        try:
            while os.read(self._kick_r, 4096):
                pass
        except OSError:  # drained (non-blocking)
            pass
        if self._stop_requested:
            self._stop.set()

    def run(self) -> int:
        if not self.acquire_lock():
            log.info("shardckpt: an uploader already serves %s; this one exits", self.root)
            return 0
        log.info("shardckpt: uploader (pid %d, node %s) syncing %s -> %s", os.getpid(), self.node, self.root,
                 safe_url(self.store.url))
        if getattr(self.store.options, "compression", "off") == "auto":
            # Measured now, while the first save is still being written: decided before its first upload.
            auto_compress.start(self.store, auto_compress.links_path(self.root))
        try:
            return self._loop()
        finally:
            auto_compress.settle(5.0)  # a probe in flight deletes its object before the store closes
            self.store.close()
            self._write_status("exited")
            if self._lock_fd is not None:
                os.close(self._lock_fd)
            for fd in (self._kick_r, self._kick_w):
                os.close(fd)

    def _loop(self) -> int:
        try:
            # The index (about 190 bytes a step), not a manifest: 1,000 nodes starting must not
            # read the newest manifest (MBs at that size) a thousand times. Without an index
            # (a remote written before it), the survey that rebuilds it.
            deadline = Deadline(self.store.options.step_deadline_s)
            indexed = remote_index.read(self.store, deadline)
            known = sorted(indexed) if indexed is not None else remote_steps(self.store, deadline)
            self.latest_remote = known[-1] if known else None
        except RemoteError as exc:
            self._record_error(None, exc)
        while not (self._stop.is_set() or self._stop_requested):
            pending = self.tick()
            self._write_status("running", pending)
            now = time.monotonic()
            if not pending:
                if self.once:
                    return 0
                if self.exit_when_idle and not trainers_alive(self.root):
                    log.info("shardckpt: uploader idle and no trainer left on this node; exiting")
                    return 0
            else:
                if self.once and (
                    all(s in self.steps and self.steps[s].attempts > 0 for s in pending)
                    or now - self._last_progress > self.give_up_s
                ):
                    log.error("shardckpt: steps %s are not committed on %s (last error: %s)", pending,
                              safe_url(self.store.url), self.last_error)
                    return 1
                if (
                    self.exit_when_idle
                    and not trainers_alive(self.root)
                    and now - self._last_progress > self.give_up_s
                ):
                    log.error(
                        "shardckpt: uploader gives up: steps %s are still not committed on %s after %.0f s "
                        "without progress and no trainer is left (last error: %s). Remedy: fix the cause, then "
                        "run `shardckpt sync --local %s --remote %s --once`.",
                        pending, safe_url(self.store.url), self.give_up_s, self.last_error, self.root,
                        safe_url(self.store.url),
                    )
                    return 1
            self._sleep()
        return 0

    def tick(self) -> list[int]:
        """One pass over the pending steps; returns the steps still pending."""
        sent_early = self.early.run(self.store, self.root)
        if sent_early:
            self.uploaded_bytes += sent_early
            self._last_progress = time.monotonic()
        pending = pending_steps(self.root, self.store.url)
        for step in list(self.steps):
            if step not in pending:
                del self.steps[step]
        now = time.monotonic()
        # Steps waiting for other nodes share polls (the most due one first): young ones one
        # per poll_s, the others one per OLD_SLOT_S: the requests a node sends while others
        # lag grow neither with the steps blocked nor with time.
        waiting = [s for s in pending if s in self.steps and self.steps[s].waits and now >= self.steps[s].next_try]
        young = sorted((self.steps[s].next_try, s) for s in waiting if now - self.steps[s].waiting_since < YOUNG_S)
        old = sorted((self.steps[s].next_try, s) for s in waiting if now - self.steps[s].waiting_since >= YOUNG_S)
        polled = {young[0][1] if young and now >= self._next_wait_poll else None,
                  old[0][1] if old and now >= self._next_old_poll else None}
        for step in pending:
            if self._stop.is_set() or self._stop_requested:
                break
            st = self.steps.setdefault(step, _StepState())
            if now < st.next_try or (st.waits and step not in polled):
                continue
            if st.waits and now - st.waiting_since < YOUNG_S:
                self._next_wait_poll = now + self.poll_s
            elif st.waits:
                self._next_old_poll = now + OLD_SLOT_S
            t0 = time.monotonic()
            try:
                result = push_step(
                    self.store, self.root, step, node=self.node, policy=self.policy,
                    skip_upload_digest=st.marker_digest, early=self.early.sent, early_tags=self.early.tags,
                    markers=self.markers, early_forms=self.early.forms,
                )
            except Exception as exc:  # noqa: BLE001 - reported and retried later
                st.attempts += 1
                st.error = redact(str(exc))
                st.permanent = getattr(exc, "retryable", True) is False
                delay = min(60.0, 1.0 * 2 ** min(st.attempts - 1, 6))
                st.next_try = time.monotonic() + delay
                self._record_error(step, exc)
                log.error("shardckpt: upload of step %d failed (attempt %d; retry in %.0f s): %s", step, st.attempts,
                          delay, st.error)
                self._check_deadline(step, st)
                continue
            st.permanent = False
            st.committer = result.committer
            early_bytes = self.early.sent_bytes.get(step, 0)
            if result.state != WAITING:
                self.early.forget(step)
                self.markers.forget(step)
            if result.uploaded_bytes:
                self.uploaded_bytes += result.uploaded_bytes
                self._last_progress = time.monotonic()
            if result.state == COMMITTED:
                self._last_progress = time.monotonic()
                self.latest_remote = max(step, self.latest_remote or step)
                if self.last_error_step == step:
                    self.last_error = None
                    self.last_error_step = None
                if st.failed is not None:
                    log.warning("shardckpt: step %d, reported failed, is now committed on %s after all",
                                step, safe_url(self.store.url))
                # Older steps still waiting may be superseded by this one now: look at them soon.
                for older, other in self.steps.items():
                    if older < step and other.waits:
                        other.next_try = min(other.next_try, time.monotonic())
                log.info("shardckpt: step %d committed on %s (%s, %.2f s)", step, safe_url(self.store.url),
                         _sent_text(result.uploaded_bytes, early_bytes, result.detail), time.monotonic() - t0)
                self.steps.pop(step, None)
            elif result.state == WAITING:
                st.marker_digest = result.marked
                st.waiting = result.detail
                st.waits += 1
                st.waiting_since = st.waiting_since or time.monotonic()
                delay = min(WAIT_MAX_S, max(self.poll_s, (time.monotonic() - st.waiting_since) / 2))
                if st.committer and time.monotonic() - st.waiting_since < YOUNG_S:
                    delay = min(delay, max(self.poll_s, COMMIT_POLL_S))
                if st.failed is None:  # poll again by the deadline, to report it in time
                    delay = min(delay, max(self.poll_s, self._until_deadline(step)))
                st.next_try = time.monotonic() + delay
                self._check_deadline(step, st)
            elif result.state == SUPERSEDED:
                self._last_progress = time.monotonic()
                log.info("shardckpt: step %d is not committed remotely but %s; not uploaded further", step,
                         result.detail)
                self.steps.pop(step, None)
            else:
                self.steps.pop(step, None)
        return pending_steps(self.root, self.store.url)

    def _created(self, step: int) -> float | None:
        try:
            manifest = layout.read_manifest(os.path.join(self.root, layout.step_dirname(step)))
        except Exception:  # noqa: BLE001 - the upload reports an unreadable manifest
            return None
        return manifest.created if manifest is not None else None

    def _until_deadline(self, step: int) -> float:
        """Seconds until ``step`` is past ``commit_timeout_s`` since its save (0 when past)."""
        created = self._created(step)
        return 0.0 if created is None else max(0.0, created + self.commit_timeout_s - time.time())

    def _check_deadline(self, step: int, st: _StepState) -> None:
        """Report ``step`` failed once it is not committed ``commit_timeout_s`` after its save."""
        created = self._created(step)
        if st.failed is not None and st.failed.get("saved") != created:
            st.failed = None  # saved again under this number: a new deadline
        if st.failed is not None and st.failed.get("awaiting_report"):
            self._failure_details(step, st.failed)
            if not st.failed.get("awaiting_report"):
                log.warning("shardckpt: %s", failure_text(step, st.failed, safe_url(self.store.url)))
            return
        if st.failed is not None or self._until_deadline(step) > 0:
            return
        created = created or time.time()
        failed: dict[str, Any] = {"saved": created, "timeout_s": self.commit_timeout_s,
                                  "ranks": [], "nodes": [], "detail": st.waiting or st.error or ""}
        if st.waits:
            self._failure_details(step, failed)
        else:
            failed["nodes"] = [self.node]
        st.failed = failed
        log.warning("shardckpt: %s", failure_text(step, failed, safe_url(self.store.url)))

    def _failure_details(self, step: int, failed: dict[str, Any]) -> None:
        """The missing ranks and their nodes, into ``failed``: from the step's report
        (``_failed.json``, one GET) when one of this save is there; else a node that writes
        reports (:func:`shardckpt.remote.node_markers.reporters`) reads the markers and writes
        it, and any other node waits for it (``awaiting_report``; looked for at its next polls)."""
        step_dir = os.path.join(self.root, layout.step_dirname(step))
        deadline = Deadline(60.0)
        try:
            manifest = layout.read_manifest(step_dir)
            if manifest is None:
                return
            report = node_markers.read_report(self.store, step, manifest, deadline)
            if report is None and set(node_markers.reporters(manifest)) & set(present_files(step_dir, manifest)):
                report = node_markers.missing_ranks(self.store, step, manifest, deadline, earlier=self.latest_remote,
                                                    cache=self.markers)
                node_markers.write_report(self.store, step, manifest, report, self.node, deadline)
            if report is None:
                failed["awaiting_report"] = True
                return
            failed.pop("awaiting_report", None)
            failed.update({k: report.get(k) or [] for k in ("ranks", "nodes", "present")})
        except Exception as exc:  # noqa: BLE001 - the failure is reported without the details
            failed["detail"] += f" (the missing ranks could not be listed: {redact(str(exc))})"

    def _record_error(self, step: int | None, exc: BaseException) -> None:
        self.last_error = redact(f"{type(exc).__name__}: {exc}")
        self.last_error_step = step
        self.last_error_time = time.time()

    def _write_status(self, state: str, pending: list[int] | None = None) -> None:
        pending = pending if pending is not None else pending_steps(self.root, self.store.url)
        steps = layout.committed_steps(self.root)
        body = {
            **process_record(state, self.node),
            "remote": safe_url(self.store.url),
            "latest_local": steps[-1] if steps else None,
            "latest_remote": self.latest_remote,
            "pending_steps": pending,
            "pending_bytes": sum(local_bytes(self.root, s) for s in pending
                                 if self.steps.get(s) is None or self.steps[s].marker_digest is None),
            "waiting": {str(s): st.waiting for s, st in self.steps.items() if st.waiting and s in pending},
            "failed": {str(s): st.error for s, st in self.steps.items() if st.error and s in pending},
            # Pending steps whose last attempt failed for a reason retries do not fix.
            "failed_permanently": sorted(s for s, st in self.steps.items() if st.permanent and s in pending),
            # Pending steps past remote_commit_timeout_s: what is missing (see failure_text).
            "failed_steps": {str(s): st.failed for s, st in self.steps.items() if st.failed and s in pending},
            "last_error": self.last_error,
            "last_error_step": self.last_error_step,
            "last_error_time": self.last_error_time,
            "uploaded_bytes": self.uploaded_bytes,
        }
        now = time.monotonic()
        if state == "running" and body == self._last_status and now - self._last_status_time < 5.0:
            return  # unchanged: spare the disk a write + fsync per poll
        self._last_status, self._last_status_time = dict(body), now
        body["updated"] = time.time()
        try:
            make_state_dir(self.root)
            write_private(os.path.join(state_dir(self.root), "status.json"), json.dumps(body, indent=1))
        except OSError as exc:
            log.warning("shardckpt: cannot write the uploader status under %s: %s", self.root, exc)


def _sent_text(after: int, early: int, detail: str) -> str:
    """What this node sent of a step: ``after`` bytes after its local commit, ``early`` while it was written."""
    if not after + early:
        return detail or "no bytes"
    while_written = f", {early / 2**20:.1f} MiB of it while the save was written" if early else ""
    return f"{(after + early) / 2**20:.1f} MiB uploaded by this node{while_written}"


def failure_text(step: int, failed: dict[str, Any], url: str) -> str:
    """The one-line report of a step not committed within ``remote_commit_timeout_s``."""
    ranks = failed.get("ranks") or []
    nodes = failed.get("nodes") or []
    if ranks:
        who = f"no upload of ranks {_ranges(ranks)}" + (f" (node {', '.join(nodes)})" if nodes else "")
    elif nodes:
        who = f"the upload of node {', '.join(nodes)} fails"
    else:
        who = failed.get("detail") or "not committed"
        if failed.get("awaiting_report"):
            who += (f"; the missing ranks are named in {url}/{layout.step_dirname(step)}/{node_markers.REPORT_NAME} "
                    f"by the committing node, and here once it is written")
    return (
        f"step {step} is not committed on {url} {failed.get('timeout_s', 0):.0f} s after its save "
        f"(remote_commit_timeout_s): {who}. It stays pending and may commit late; later steps commit as "
        f"usual and the newest committed step stays the newest. Remedy: check the uploader of that node "
        f"(`shardckpt status <local_dir>` there) and start it again (`shardckpt sync --local <local_dir> "
        f"--remote {url}`)."
    )


def _ranges(ranks: list[int]) -> str:
    out: list[str] = []
    start = prev = ranks[0]
    for r in ranks[1:] + [None]:  # type: ignore[list-item]
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(out)


KICK_SIGNAL = signal.SIGUSR1
"""Sent by a trainer of the node after each commit, so that an upload starts at once."""


def run_uploader(uploader: Uploader) -> int:
    handlers = {signal.SIGTERM: uploader.stop, signal.SIGINT: uploader.stop, KICK_SIGNAL: uploader.wake}
    for signum, handler in handlers.items():
        try:
            signal.signal(signum, handler)
        except ValueError:
            pass
    return uploader.run()


def _env(field: str, default: Any = None, cast: Any = str) -> Any:
    """The default of an option: ``SHARDCKPT_<FIELD>`` when set (as for a Checkpointer), else ``default``."""
    raw = os.environ.get("SHARDCKPT_" + field.upper())
    if raw is None or not raw.strip():
        return default
    try:
        return cast(raw.strip())
    except ValueError:
        raise SystemExit(f"shardckpt: error: SHARDCKPT_{field.upper()}={raw!r} is not a valid value") from None


def add_transfer_args(p: Any) -> None:
    """Arguments shared by ``shardckpt sync | push | pull``; each defaults to its SHARDCKPT_* variable."""
    local, url = _env("local_dir"), _env("remote")
    p.add_argument("--local", required=local is None, default=local,
                   help="the node's local checkpoint directory, the local_dir (default: SHARDCKPT_LOCAL_DIR)")
    p.add_argument("--remote", required=url is None, default=url,
                   help="remote URL: s3://bucket/prefix, file:///mnt/nfs/run, ... (default: SHARDCKPT_REMOTE)")
    p.add_argument("--endpoint-url", default=_env("endpoint_url"),
                   help="S3-compatible endpoint (default: SHARDCKPT_ENDPOINT_URL, AWS_ENDPOINT_URL, or AWS)")
    p.add_argument("--node", help="this node's name in its upload markers (default: hostname)")
    p.add_argument("--concurrency", type=int, default=_env("transfer_concurrency", 8, int),
                   help="requests in flight (default 8)")
    p.add_argument("--part-size", type=int, default=_env("part_size", 32 << 20, int),
                   help="multipart part size in bytes (default 32 MiB)")
    p.add_argument("--request-timeout", type=float, default=_env("request_timeout_s", 60.0, float),
                   help="seconds per request (default 60)")
    p.add_argument("--max-attempts", type=int, default=_env("remote_max_attempts", 8, int),
                   help="attempts per request (default 8)")
    p.add_argument("--backoff-max", type=float, default=_env("backoff_max_s", 10.0, float),
                   help="cap of the retry backoff in seconds (default 10)")
    p.add_argument("--step-deadline", type=float, default=_env("step_deadline_s", 1800.0, float),
                   help="seconds per step before it is retried later (default 1800)")
    p.add_argument("--compression", choices=list(codec.MODES), default=_env("remote_compression", "auto"),
                   help="compress uploads: auto (when it pays on the measured link), off, or the codec "
                        "(default: SHARDCKPT_REMOTE_COMPRESSION, else auto)")


def add_sync_args(p: Any) -> None:
    add_transfer_args(p)
    p.add_argument("--keep-last", type=int, default=_env("remote_keep_last", None, int), help="remote retention: "
                   "keep the newest N live steps (default: SHARDCKPT_REMOTE_KEEP_LAST, else all)")
    p.add_argument("--keep-every", type=int, default=_env("remote_keep_every", None, int),
                   help="remote retention: also keep every multiple of K (default: SHARDCKPT_REMOTE_KEEP_EVERY)")
    add_best_args(p)
    p.add_argument("--once", action="store_true", help="exit when nothing is pending (status 1 if a step failed)")
    p.add_argument("--exit-when-idle", action="store_true",
                   help="exit when nothing is pending and no trainer of this node is alive")
    p.add_argument("--poll", type=float, default=0.5, help="seconds between scans of the local directory")
    p.add_argument("--give-up", type=float, default=600.0,
                   help="with --exit-when-idle/--once: exit after this many seconds without progress")
    p.add_argument("--commit-timeout", type=float, default=_env("remote_commit_timeout_s", 1800.0, float),
                   help="report a step failed when it is not committed this many seconds after its save "
                        "(default: SHARDCKPT_REMOTE_COMMIT_TIMEOUT_S, else 1800)")


def add_best_args(p: Any) -> None:
    """Remote retention by metric, as the trainer's ``keep_best`` / ``best_metric`` / ``best_mode``."""
    p.add_argument("--keep-best", type=int, default=_env("keep_best", None, int),
                   help="remote retention: also keep the K best steps by --best-metric (default: SHARDCKPT_KEEP_BEST)")
    p.add_argument("--best-metric", default=_env("best_metric"),
                   help="the metric recorded at save that ranks steps (default: SHARDCKPT_BEST_METRIC)")
    p.add_argument("--best-mode", choices=["min", "max"], default=_env("best_mode", "min"),
                   help="lower (min, default) or higher is better")


def store_from_args(args: Any) -> Store:
    cfg = CheckpointConfig(
        local_dir=args.local,
        remote=args.remote,
        endpoint_url=args.endpoint_url,
        transfer_concurrency=args.concurrency,
        part_size=args.part_size,
        request_timeout_s=args.request_timeout,
        remote_max_attempts=args.max_attempts,
        backoff_max_s=args.backoff_max,
        step_deadline_s=args.step_deadline,
        remote_compression=getattr(args, "compression", "auto"),
        preemption_signals=(),
    )
    return open_store(args.remote, cfg.transfer_options())


def policy_from_args(args: Any) -> RetentionPolicy | None:
    if getattr(args, "keep_last", None) is None:
        return None
    return policy_from(args.keep_last, args.keep_every, keep_best=getattr(args, "keep_best", None),
                       best_metric=getattr(args, "best_metric", None), best_mode=getattr(args, "best_mode", "min"))


def sync_from_args(args: Any) -> int:
    uploader = Uploader(args.local, store_from_args(args), node=args.node or socket.gethostname(),
                        policy=policy_from_args(args), poll_s=args.poll, exit_when_idle=args.exit_when_idle,
                        once=args.once, give_up_s=args.give_up, commit_timeout_s=args.commit_timeout)
    return run_uploader(uploader)


def sync_main(argv: list[str]) -> int:
    """Entry point of the uploader process started by a trainer (no torch import)."""
    import argparse

    daemon_logging()
    parser = argparse.ArgumentParser(prog="shardckpt sync")
    add_sync_args(parser)
    return sync_from_args(parser.parse_args(argv))
