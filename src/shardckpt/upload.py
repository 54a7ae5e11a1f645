"""The per-node uploader and the remote commit protocol.

Remote layout (``<remote>`` is the URL given as ``remote=``)::

    <remote>/step_<N>/.metadata, __<rank>_<i>.distcp ...   the step's files
    <remote>/step_<N>/_nodes/ranks-<a>-<b>-<n>.json          one marker per node
    <remote>/step_<N>/shardckpt.json                         the manifest, LAST

Protocol for one step, run by every node's uploader on its own (uploaders
coordinate through the remote store and local files only, never through the
trainer's process group):

1. The node's files of the locally committed step (the manifest's files
   present in its local step directory) are uploaded concurrently, each
   verified after upload (size, the SHA-256 from the manifest, and the
   store's own CRC32 checksum headers where it returns them).
2. The node writes its marker: the ranks it holds files for and the SHA-256
   of each file it uploaded.
3. Exactly one node, the *committer* (the one holding ``.metadata``, rank
   0's file), waits until the markers' files cover every file of the
   manifest with matching checksums and the listing shows every object
   with its size; then it uploads the manifest. From that moment the step
   exists remotely; before, it does not exist for anyone.
4. The committer applies the remote retention policy (never the newest
   step, only after a newer step is committed). Every node marks its local
   copy as committed remotely (``step_<N>/.shardckpt-uploaded.json``); only
   then may local retention delete it.

A step that fails (after the store's per-request retries, or past the
step's deadline) is logged, reported in the status file and retried later
with capped backoff; it is never half-committed.

Local files the uploader shares with trainers (``<local_dir>/.shardckpt-remote/``)::

    uploader.lock         flock held by the running uploader (one per local_dir)
    status.json           what it is doing: pending steps and bytes, last error
    uploader.log          its log
    trainers/<host>-<pid>.json   one per live trainer process of this node
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

from . import _failpoints, layout
from .errors import CorruptCheckpointError, RemoteError
from .remote import Deadline, Store, join, redact, safe_url
from .retention import RetentionPolicy, plan_deletions

log = logging.getLogger("shardckpt")

STATE_DIR = ".shardckpt-remote"
UPLOADED_NAME = ".shardckpt-uploaded.json"
NODES_DIR = "_nodes"
MARKER_FORMAT = "shardckpt-node/1"
COMMITTED = "committed"
SUPERSEDED = "superseded"
WAITING = "waiting"
GONE = "gone"


# ------------------------------------------------------------ small helpers

PROGRESS_S = 10.0
"""Seconds between progress lines of one long upload or download."""


class Progress:
    """Logs ``<what>: x of y MiB (r MiB/s)`` every ``every_s`` while a transfer runs.

    Used as a context manager around the transfer; the store calls :meth:`add`
    as parts of files are confirmed. Short transfers (under ``every_s``) log
    nothing here.
    """

    def __init__(self, what: str, total: int, every_s: float) -> None:
        self.what, self.total, self.every_s = what, total, every_s
        self._done = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread: threading.Thread | None = None

    def add(self, nbytes: int) -> None:
        with self._lock:
            self._done += nbytes

    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def _report(self) -> None:
        while not self._stop.wait(self.every_s):
            with self._lock:
                done = self._done
            log.info(
                "shardckpt: %s: %.1f of %.1f MiB (%.1f MiB/s)",
                self.what, done / 2**20, self.total / 2**20, done / 2**20 / max(1e-9, self.elapsed()),
            )

    def __enter__(self) -> "Progress":
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._report, name="shardckpt-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def files_digest(manifest: layout.Manifest) -> str:
    """Identity of a step's content: the names and checksums of its files."""
    h = hashlib.sha256()
    for name in sorted(manifest.files):
        h.update(f"{name}\0{manifest.files[name].checksum}\n".encode())
    return h.hexdigest()


def state_dir(root: str) -> str:
    return os.path.join(root, STATE_DIR)


def step_key(step: int, name: str = "") -> str:
    return join(layout.step_dirname(step), name)


def present_files(step_dir: str, manifest: layout.Manifest) -> list[str]:
    """Manifest files present in ``step_dir`` with their recorded size."""
    missing = set(layout.missing_files(step_dir, manifest))
    return sorted(n for n in manifest.files if n not in missing)


def mark_uploaded(step_dir: str, url: str, manifest: layout.Manifest, superseded_by: int | None = None) -> None:
    body = {"remote": safe_url(url), "files_digest": files_digest(manifest), "time": time.time()}
    if superseded_by is not None:
        body["superseded_by"] = superseded_by
    try:
        layout.atomic_write_text(os.path.join(step_dir, UPLOADED_NAME), json.dumps(body))
    except FileNotFoundError:
        pass  # the step was deleted meanwhile


def is_uploaded(step_dir: str, url: str) -> bool:
    """True when the local step carries a mark that it is committed on ``url``."""
    try:
        with open(os.path.join(step_dir, UPLOADED_NAME), encoding="utf-8") as f:
            body = json.load(f)
    except (OSError, ValueError):
        return False
    return body.get("remote") == safe_url(url)


def pending_steps(root: str, url: str) -> list[int]:
    return [s for s in layout.committed_steps(root) if not is_uploaded(os.path.join(root, layout.step_dirname(s)), url)]


def local_bytes(root: str, step: int) -> int:
    step_dir = os.path.join(root, layout.step_dirname(step))
    try:
        manifest = layout.read_manifest(step_dir)
    except CorruptCheckpointError:
        return 0
    if manifest is None:
        return 0
    return sum(manifest.files[n].size for n in present_files(step_dir, manifest))


def read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            body = json.load(f)
        return body if isinstance(body, dict) else {}
    except (OSError, ValueError):
        return {}


def read_status(root: str) -> dict[str, Any]:
    return read_json(os.path.join(state_dir(root), "status.json"))


# ------------------------------------------------------------ process liveness


def _proc_start(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


def pid_alive(pid: int, start: str | None = None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    now = _proc_start(pid)
    if os.path.exists("/proc/self/stat"):
        if now is None:
            return False  # a zombie
        if start is not None and now != start:
            return False  # the pid was reused
    return True


def register_trainer(root: str) -> str:
    """Record this process as a live trainer of the node; returns the file to remove."""
    directory = os.path.join(state_dir(root), "trainers")
    os.makedirs(directory, exist_ok=True)
    pid = os.getpid()
    path = os.path.join(directory, f"{socket.gethostname()}-{pid}.json")
    body = {"pid": pid, "host": socket.gethostname(), "start": _proc_start(pid), "time": time.time()}
    layout.atomic_write_text(path, json.dumps(body))
    return path


def unregister_trainer(path: str | None) -> None:
    if path:
        try:
            os.unlink(path)
        except OSError:
            pass


def trainers_alive(root: str) -> list[int]:
    directory = os.path.join(state_dir(root), "trainers")
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    alive = []
    host = socket.gethostname()
    for name in names:
        body = read_json(os.path.join(directory, name))
        pid = body.get("pid")
        if not isinstance(pid, int) or body.get("host") != host:
            continue
        if pid_alive(pid, body.get("start")):
            alive.append(pid)
        else:
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass
    return alive


def uploader_running(root: str) -> int | None:
    """Pid of the uploader serving ``root`` (it holds the lock), else ``None``."""
    status = read_status(root)
    pid = status.get("pid")
    if status.get("state") == "running" and isinstance(pid, int) and pid_alive(pid, status.get("pid_start")):
        return pid
    return None


# ------------------------------------------------------------ remote listing


def remote_steps(store: Store, deadline: Deadline) -> list[int]:
    """Steps committed on the remote (their manifest exists), oldest first."""
    candidates = []
    for name in store.list_dirs("", deadline):
        step = layout.parse_step_dirname(name)
        if step is not None:
            candidates.append(step)
    if not candidates:
        return []
    found = store.run_all(
        [lambda s=s: (s, store.exists(step_key(s, layout.MANIFEST_NAME), deadline)) for s in candidates], files=True
    )
    return sorted(s for s, ok in found if ok)


def remote_manifest(store: Store, step: int, deadline: Deadline) -> layout.Manifest | None:
    key = step_key(step, layout.MANIFEST_NAME)
    data = store.get_bytes(key, deadline)
    if data is None:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptCheckpointError(f"remote manifest {store.where(key)} is not UTF-8 text; the step cannot be trusted") from exc
    manifest = layout.Manifest.from_json(text, store.where(key))
    if manifest.step != step:
        raise CorruptCheckpointError(
            f"remote manifest {store.where(key)} describes step {manifest.step}, not {step}; the step cannot be trusted"
        )
    return manifest


def delete_remote_step(store: Store, step: int, deadline: Deadline) -> None:
    """Un-commit first (manifest away), then delete the rest."""
    store.delete(step_key(step, layout.MANIFEST_NAME), deadline)
    _failpoints.hit("upload.retention_hidden")
    store.delete_prefix(layout.step_dirname(step), deadline)


# ------------------------------------------------------------ push (upload side)


@dataclasses.dataclass
class PushResult:
    state: str
    uploaded_bytes: int = 0
    detail: str = ""


def _marker_name(ranks: list[int]) -> str:
    return f"ranks-{ranks[0]}-{ranks[-1]}-{len(ranks)}.json"


def _committer_file(manifest: layout.Manifest) -> str:
    if ".metadata" in manifest.files:
        return ".metadata"
    return min(manifest.files, key=lambda n: (manifest.files[n].rank, n))


def push_step(
    store: Store,
    root: str,
    step: int,
    *,
    node: str,
    policy: RetentionPolicy | None,
    skip_upload_digest: str | None = None,
    progress_s: float = PROGRESS_S,
) -> PushResult:
    """One pass of the protocol for one step of this node (see the module docstring)."""
    step_dir = os.path.join(root, layout.step_dirname(step))
    manifest = layout.read_manifest(step_dir)
    if manifest is None:
        return PushResult(GONE)
    digest = files_digest(manifest)
    deadline = Deadline(store.options.step_deadline_s)
    mine = present_files(step_dir, manifest)
    committer = bool(mine) and _committer_file(manifest) in mine
    committed = remote_manifest(store, step, deadline)
    if committed is not None:
        if files_digest(committed) == digest:
            mark_uploaded(step_dir, store.url, manifest)
            return PushResult(COMMITTED, detail="already committed")
        if committed.created >= manifest.created:
            raise RemoteError(
                f"step {step}: {store.where(layout.step_dirname(step))} is already committed with different, "
                f"newer content (another run writing to the same prefix?); it is not overwritten. Remedy: point "
                f"remote= at a prefix of its own, or delete that remote step if it is stale."
            )
        # This step was saved again locally (e.g. after a rollback): the
        # committer retires the remote copy of the earlier save first (its
        # manifest away: the step stops existing remotely), then all nodes
        # upload the new files as for any step.
        if not committer:
            return PushResult(WAITING, detail="waiting for the committing node to retire an earlier save of this step")
        log.warning(
            "shardckpt: step %d was saved again locally; retiring its earlier remote copy at %s",
            step, store.where(layout.step_dirname(step)),
        )
        store.delete(step_key(step, layout.MANIFEST_NAME), deadline)
    if not mine:
        return _superseded_or(
            store, step_dir, step, manifest, PushResult(WAITING, detail="this node holds no file of the step"), deadline
        )
    ranks = sorted({manifest.files[n].rank for n in mine})
    marker_key = step_key(step, f"{NODES_DIR}/{_marker_name(ranks)}")
    marker = {
        "format": MARKER_FORMAT,
        "node": node,
        "ranks": ranks,
        "files": {n: manifest.files[n].checksum for n in mine},
        "files_digest": digest,
    }
    sent = 0
    if skip_upload_digest != digest:
        existing = store.get_bytes(marker_key, deadline)
        if existing is None or _parse_marker(existing).get("files") != marker["files"]:
            total = sum(manifest.files[n].size for n in mine)
            progress = Progress(f"uploading step {step} to {safe_url(store.url)}", total, progress_s)

            def send(name: str) -> None:
                entry = manifest.files[name]
                path = os.path.join(step_dir, name)
                store.put_file(path, step_key(step, name), entry.size, entry.checksum, deadline, progress.add)

            try:
                with progress:
                    store.run_all([lambda n=n: send(n) for n in mine], files=True)
            except FileNotFoundError:
                if layout.read_manifest(step_dir) is None:
                    return PushResult(GONE)
                raise
            sent = total
            _failpoints.hit("upload.files_sent")
            store.put_bytes(marker_key, json.dumps(marker, sort_keys=True).encode(), deadline)
            _failpoints.hit("upload.marker_written")
    if not committer:
        return _superseded_or(store, step_dir, step, manifest, PushResult(WAITING, sent, "waiting for the committing node"), deadline)
    ready, why = _all_markers_present(store, step, manifest, digest, deadline)
    if not ready:
        return _superseded_or(store, step_dir, step, manifest, PushResult(WAITING, sent, why), deadline)
    with open(os.path.join(step_dir, layout.MANIFEST_NAME), "rb") as f:
        manifest_bytes = f.read()
    store.put_bytes(step_key(step, layout.MANIFEST_NAME), manifest_bytes, deadline)
    _failpoints.hit("upload.manifest_written")
    mark_uploaded(step_dir, store.url, manifest)
    if policy is not None:
        apply_remote_retention(store, policy, deadline)
    return PushResult(COMMITTED, sent)


def _superseded_or(
    store: Store, step_dir: str, step: int, manifest: layout.Manifest, waiting: PushResult, deadline: Deadline
) -> PushResult:
    """A step still waiting while a newer step is committed remotely is superseded.

    (Its commit may have come and gone: remote retention may have removed it
    before this node looked.) It is marked done locally, which lets local
    retention drop it; the newer step is the one that is safe remotely.
    """
    newer = [s for s in remote_steps(store, deadline) if s > step]
    if not newer:
        return waiting
    latest = remote_manifest(store, newer[-1], deadline)
    if latest is None or latest.created < manifest.created:
        return waiting  # an older timeline's step (this one was saved after a rollback)
    mark_uploaded(step_dir, store.url, manifest, superseded_by=newer[-1])
    return PushResult(SUPERSEDED, waiting.uploaded_bytes, f"superseded by step {newer[-1]}, committed remotely")


def _parse_marker(data: bytes) -> dict[str, Any]:
    try:
        body = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return {}
    return body if isinstance(body, dict) and body.get("format") == MARKER_FORMAT else {}


def _all_markers_present(
    store: Store, step: int, manifest: layout.Manifest, digest: str, deadline: Deadline
) -> tuple[bool, str]:
    names = [n for n in store.list_sizes(step_key(step, NODES_DIR), deadline) if n.endswith(".json")]
    bodies = store.run_all(
        [lambda n=n: store.get_bytes(step_key(step, f"{NODES_DIR}/{n}"), deadline) for n in names], files=True
    )
    covered: set[str] = set()
    for body in bodies:
        marker = _parse_marker(body or b"")
        if marker.get("files_digest") != digest:
            continue  # a stale marker of another save of this step number
        for name, sha in marker.get("files", {}).items():
            entry = manifest.files.get(name)
            if entry is not None and entry.checksum == sha:
                covered.add(name)
    missing = sorted(set(manifest.files) - covered)
    if missing:
        return False, f"waiting for node markers covering {len(missing)} file(s), e.g. {missing[0]}"
    sizes = store.list_sizes(layout.step_dirname(step), deadline)
    wrong = [n for n, e in manifest.files.items() if sizes.get(n) != e.size]
    if wrong:
        return False, f"object {store.where(step_key(step, wrong[0]))} is missing or has the wrong size"
    return True, ""


def apply_remote_retention(store: Store, policy: RetentionPolicy, deadline: Deadline) -> list[int]:
    steps = remote_steps(store, deadline)
    doomed = plan_deletions(steps, policy)
    for old in doomed:
        delete_remote_step(store, old, deadline)
        log.info("shardckpt: remote retention removed step %d from %s", old, safe_url(store.url))
    return doomed


# ------------------------------------------------------------ pull (restore side)


def fetch_step(
    store: Store,
    root: str,
    step: int,
    *,
    names: list[str] | None = None,
    manifest: layout.Manifest | None = None,
    progress_s: float = PROGRESS_S,
) -> set[str]:
    """Bring the remote ``step`` into ``root``; return the names fetched (each verified).

    When ``root`` already holds the committed step, only ``names`` (default:
    the files missing locally) are fetched into it. Otherwise the step is
    fetched into a partial directory and committed locally (manifest last)
    only after every file passed its checksum.
    """
    deadline = Deadline(store.options.step_deadline_s)
    step_dir = os.path.join(root, layout.step_dirname(step))
    local_manifest = layout.read_manifest(step_dir)
    remote = manifest or remote_manifest(store, step, deadline)
    if remote is None:
        raise RemoteError(
            f"step {step} is not committed on {safe_url(store.url)} (no manifest). "
            f"Remedy: pick a committed step (shardckpt ls on the remote) or check the URL."
        )
    if local_manifest is not None:
        if files_digest(local_manifest) != files_digest(remote):
            raise CorruptCheckpointError(
                f"step {step}: the local copy {step_dir} and the remote copy {store.where(layout.step_dirname(step))} "
                f"differ; refusing to mix them. Remedy: delete the local step directory, or load another step."
            )
        wanted = sorted(names) if names is not None else layout.missing_files(step_dir, local_manifest)
        target = step_dir
    else:
        wanted = sorted(remote.files)
        os.makedirs(root, exist_ok=True)
        target = os.path.join(root, layout.partial_dirname(step, "fetch-" + uuid.uuid4().hex[:8]))
        os.makedirs(target)
    total = sum(remote.files[n].size for n in wanted)
    progress = Progress(f"fetching step {step} from {safe_url(store.url)}", total, progress_s)

    def one(name: str) -> None:
        entry = remote.files[name]
        final = os.path.join(target, name)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = f"{final}.fetch-{uuid.uuid4().hex[:8]}"
        try:
            store.get_file(step_key(step, name), tmp, entry.size, entry.checksum, deadline, progress.add)
            os.replace(tmp, final)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    try:
        with progress:
            store.run_all([lambda n=n: one(n) for n in wanted], files=True)
        if target != step_dir:
            layout.atomic_write_text(os.path.join(target, layout.MANIFEST_NAME), remote.to_json())
            mark_uploaded(target, store.url, remote)
            _commit_fetched(root, target, step_dir)
        else:
            mark_uploaded(step_dir, store.url, remote)
    except BaseException:
        if target != step_dir:
            shutil.rmtree(target, ignore_errors=True)
        raise
    took = progress.elapsed()
    if wanted:
        log.info(
            "shardckpt: fetched %d file(s) of step %d from %s: %.1f MiB in %.2f s",
            len(wanted), step, safe_url(store.url), total / 2**20, took,
        )
    return set(wanted)


def _commit_fetched(root: str, partial: str, step_dir: str) -> None:
    if os.path.isdir(step_dir):
        if layout.read_manifest(step_dir) is not None:
            shutil.rmtree(partial, ignore_errors=True)  # someone else committed it meanwhile
            return
        trash = os.path.join(root, f"{layout.TRASH_PREFIX}{os.path.basename(step_dir)}-{uuid.uuid4().hex[:8]}")
        os.replace(step_dir, trash)
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.replace(partial, step_dir)
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST) and layout.read_manifest(step_dir) is not None:
            shutil.rmtree(partial, ignore_errors=True)
            return
        raise
    layout.fsync_dir(root)


# ------------------------------------------------------------ the uploader


@dataclasses.dataclass
class _StepState:
    attempts: int = 0
    next_try: float = 0.0
    error: str | None = None
    permanent: bool = False
    marker_digest: str | None = None
    waiting: str = ""
    first_seen: float = dataclasses.field(default_factory=time.monotonic)


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
    ) -> None:
        self.root = os.path.abspath(root)
        self.store = store
        self.node = node
        self.policy = policy
        self.poll_s = poll_s
        self.exit_when_idle = exit_when_idle
        self.once = once
        self.give_up_s = give_up_s
        self.steps: dict[int, _StepState] = {}
        self.latest_remote: int | None = None
        self.last_error: str | None = None
        self.last_error_step: int | None = None
        self.last_error_time: float | None = None
        self.uploaded_bytes = 0
        self._stop = threading.Event()
        self._lock_fd: int | None = None
        self._last_status: dict[str, Any] = {}
        self._last_status_time = 0.0
        self._last_progress = time.monotonic()

    # ---- lifecycle

    def acquire_lock(self, wait_s: float = 2.0) -> bool:
        os.makedirs(state_dir(self.root), exist_ok=True)
        fd = os.open(os.path.join(state_dir(self.root), "uploader.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        end = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                if time.monotonic() >= end:
                    os.close(fd)
                    return False
                time.sleep(0.1)
                continue
            self._lock_fd = fd
            return True

    def stop(self, *_: Any) -> None:
        self._stop.set()

    def run(self) -> int:
        if not self.acquire_lock():
            log.info("shardckpt: an uploader already serves %s; this one exits", self.root)
            return 0
        log.info("shardckpt: uploader (pid %d, node %s) syncing %s -> %s", os.getpid(), self.node, self.root, safe_url(self.store.url))
        try:
            return self._loop()
        finally:
            self.store.close()
            self._write_status("exited")
            if self._lock_fd is not None:
                os.close(self._lock_fd)

    def _loop(self) -> int:
        try:
            known = remote_steps(self.store, Deadline(self.store.options.step_deadline_s))
            self.latest_remote = known[-1] if known else None
        except RemoteError as exc:
            self._record_error(None, exc)
        while not self._stop.is_set():
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
                    log.error("shardckpt: steps %s are not committed on %s (last error: %s)", pending, safe_url(self.store.url), self.last_error)
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
            self._stop.wait(self.poll_s)
        return 0

    def tick(self) -> list[int]:
        """One pass over the pending steps; returns the steps still pending."""
        pending = pending_steps(self.root, self.store.url)
        for step in list(self.steps):
            if step not in pending:
                del self.steps[step]
        now = time.monotonic()
        for step in pending:
            if self._stop.is_set():
                break
            st = self.steps.setdefault(step, _StepState())
            if now < st.next_try:
                continue
            t0 = time.monotonic()
            try:
                result = push_step(
                    self.store, self.root, step, node=self.node, policy=self.policy, skip_upload_digest=st.marker_digest
                )
            except Exception as exc:  # noqa: BLE001 - reported and retried later
                st.attempts += 1
                st.error = redact(str(exc))
                st.permanent = getattr(exc, "retryable", True) is False
                delay = min(60.0, 1.0 * 2 ** min(st.attempts - 1, 6))
                st.next_try = time.monotonic() + delay
                self._record_error(step, exc)
                log.error("shardckpt: upload of step %d failed (attempt %d; retry in %.0f s): %s", step, st.attempts, delay, st.error)
                continue
            st.permanent = False
            if result.uploaded_bytes:
                self.uploaded_bytes += result.uploaded_bytes
                self._last_progress = time.monotonic()
            if result.state == COMMITTED:
                self._last_progress = time.monotonic()
                self.latest_remote = max(step, self.latest_remote or step)
                if self.last_error_step == step:
                    self.last_error = None
                    self.last_error_step = None
                log.info(
                    "shardckpt: step %d committed on %s (%s, %.2f s)", step, safe_url(self.store.url),
                    f"{result.uploaded_bytes / 2**20:.1f} MiB uploaded by this node" if result.uploaded_bytes else result.detail or "no bytes",
                    time.monotonic() - t0,
                )
                self.steps.pop(step, None)
            elif result.state == WAITING:
                manifest = layout.read_manifest(os.path.join(self.root, layout.step_dirname(step)))
                st.marker_digest = files_digest(manifest) if manifest is not None and result.detail != "this node holds no file of the step" else None
                st.waiting = result.detail
                st.next_try = time.monotonic() + min(5.0, max(self.poll_s, 0.25 * (1 + st.attempts)))
            elif result.state == SUPERSEDED:
                self._last_progress = time.monotonic()
                log.info("shardckpt: step %d is not committed remotely but %s; not uploaded further", step, result.detail)
                self.steps.pop(step, None)
            else:
                self.steps.pop(step, None)
        return pending_steps(self.root, self.store.url)

    def _record_error(self, step: int | None, exc: BaseException) -> None:
        self.last_error = redact(f"{type(exc).__name__}: {exc}")
        self.last_error_step = step
        self.last_error_time = time.time()

    def _write_status(self, state: str, pending: list[int] | None = None) -> None:
        pending = pending if pending is not None else pending_steps(self.root, self.store.url)
        steps = layout.committed_steps(self.root)
        body = {
            "state": state,
            "pid": os.getpid(),
            "pid_start": _proc_start(os.getpid()),
            "node": self.node,
            "remote": safe_url(self.store.url),
            "latest_local": steps[-1] if steps else None,
            "latest_remote": self.latest_remote,
            "pending_steps": pending,
            "pending_bytes": sum(local_bytes(self.root, s) for s in pending if self.steps.get(s) is None or self.steps[s].marker_digest is None),
            "waiting": {str(s): st.waiting for s, st in self.steps.items() if st.waiting and s in pending},
            "failed": {str(s): st.error for s, st in self.steps.items() if st.error and s in pending},
            # Pending steps whose last attempt failed for a reason retries do not fix.
            "failed_permanently": sorted(s for s, st in self.steps.items() if st.permanent and s in pending),
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
            os.makedirs(state_dir(self.root), exist_ok=True)
            layout.atomic_write_text(os.path.join(state_dir(self.root), "status.json"), json.dumps(body, indent=1))
        except OSError as exc:
            log.warning("shardckpt: cannot write the uploader status under %s: %s", self.root, exc)


def run_uploader(uploader: Uploader) -> int:
    for signum in (signal.SIGTERM, signal.SIGINT):
        try:
            signal.signal(signum, uploader.stop)
        except ValueError:
            pass
    return uploader.run()


def add_transfer_args(p: Any) -> None:
    """Arguments shared by ``shardckpt sync | push | pull``."""
    p.add_argument("--local", required=True, help="the node's local checkpoint directory (local_dir)")
    p.add_argument("--remote", required=True, help="remote URL: s3://bucket/prefix, file:///mnt/nfs/run, ...")
    p.add_argument("--endpoint-url", help="S3-compatible endpoint (default: AWS_ENDPOINT_URL or AWS)")
    p.add_argument("--node", help="this node's name in its upload markers (default: hostname)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument("--part-size", type=int, default=32 << 20, help="multipart part size in bytes (default 32 MiB)")
    p.add_argument("--request-timeout", type=float, default=60.0, help="seconds per request (default 60)")
    p.add_argument("--max-attempts", type=int, default=8, help="attempts per request (default 8)")
    p.add_argument("--backoff-max", type=float, default=10.0, help="cap of the retry backoff in seconds (default 10)")
    p.add_argument("--step-deadline", type=float, default=1800.0, help="seconds per step before it is retried later")


def add_sync_args(p: Any) -> None:
    add_transfer_args(p)
    p.add_argument("--keep-last", type=int, help="remote retention: keep the newest N committed steps")
    p.add_argument("--keep-every", type=int, help="remote retention: also keep every multiple of K")
    p.add_argument("--once", action="store_true", help="exit when nothing is pending (status 1 if a step failed)")
    p.add_argument("--exit-when-idle", action="store_true", help="exit when nothing is pending and no trainer of this node is alive")
    p.add_argument("--poll", type=float, default=0.5, help="seconds between scans of the local directory")
    p.add_argument("--give-up", type=float, default=600.0, help="with --exit-when-idle/--once: exit after this many seconds without progress")


def store_from_args(args: Any) -> Store:
    from .options import CheckpointConfig
    from .remote import open_store

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
        preemption_signals=(),
    )
    return open_store(args.remote, cfg.transfer_options())


def policy_from_args(args: Any) -> RetentionPolicy | None:
    from .retention import policy_from

    if getattr(args, "keep_last", None) is None:
        return None
    return policy_from(args.keep_last, args.keep_every)


def sync_from_args(args: Any) -> int:
    uploader = Uploader(
        args.local,
        store_from_args(args),
        node=args.node or socket.gethostname(),
        policy=policy_from_args(args),
        poll_s=args.poll,
        exit_when_idle=args.exit_when_idle,
        once=args.once,
        give_up_s=args.give_up,
    )
    return run_uploader(uploader)


def sync_main(argv: list[str]) -> int:
    """Entry point of the uploader process started by a trainer (no torch import)."""
    import argparse

    logger = logging.getLogger("shardckpt")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(os.environ.get("SHARDCKPT_LOG_LEVEL", "INFO").upper())
        logger.propagate = False
    parser = argparse.ArgumentParser(prog="shardckpt sync")
    add_sync_args(parser)
    return sync_from_args(parser.parse_args(argv))


# The uploader forks once more and the intermediate exits: the uploader is
# then no descendant of the trainer (a kill of the trainer's process tree
# spares it) and runs in a session of its own. It imports only this module's
# dependencies (no torch): a stub package object stands in for
# shardckpt/__init__.py, which imports torch.
_BOOTSTRAP = (
    "import os, sys, types\n"
    "if os.fork() > 0:\n"
    "    os._exit(0)\n"
    "pkg = types.ModuleType('shardckpt'); pkg.__path__ = [sys.argv[1]]; sys.modules['shardckpt'] = pkg\n"
    "from shardckpt.upload import sync_main\n"
    "sys.exit(sync_main(sys.argv[2:]))\n"
)


def spawn_uploader(root: str, url: str, args: list[str]) -> None:
    """Start the uploader for ``root`` detached from the trainer (it outlives it).

    Returns once the uploader is forked; it reports through ``status.json``.
    """
    directory = state_dir(root)
    os.makedirs(directory, exist_ok=True)
    env = dict(os.environ)
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    package_dir = os.path.dirname(os.path.abspath(__file__))
    logfile = open(os.path.join(directory, "uploader.log"), "ab")
    try:
        cmd = [sys.executable, "-c", _BOOTSTRAP, package_dir, "--local", root, "--remote", url, *args]
        launcher = subprocess.Popen(
            cmd, env=env, stdin=subprocess.DEVNULL, stdout=logfile, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True, cwd=root,
        )
    finally:
        logfile.close()
    launcher.wait(timeout=60)  # the intermediate exits right after its fork
