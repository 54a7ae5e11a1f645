"""The peer daemon: one per node (per ``local_dir``), serving its endpoint and replicating its steps.

``shardckpt peer``, started by the node's local rank 0 like the uploader, and
outliving the trainer, does two things:

* **serves** the endpoint (:mod:`shardckpt.node.peer_service`) on the node's address;
* **replicates**: after each local commit it sends this node's files of the
  newest committed step to ``peer_replicas`` other nodes (a ring over the
  nodes, off the owner's ``SHARDCKPT_FAILURE_DOMAIN``), at most
  ``peer_bandwidth`` bytes/s.

Files the daemon and the trainer share, in ``<local_dir>/.shardckpt-remote/``:
``peer.secret`` (0600), ``peers.json`` (the job's nodes, written by the
trainer), ``peer.json`` (the daemon's address and what it replicated),
``peer.lock``, ``peer.log``. It imports no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import logging
import os
import signal
import socket
import threading
import time
from typing import Any

from shardckpt.format import layout
from shardckpt.format.replicas import committed_replicas, manifest_or_none, placement
from shardckpt.node.node_registry import daemon_logging, process_record, read_json, state_dir, trainers_alive
from shardckpt.node.peer_service import PeerService, PeerHTTPServer, serve
from shardckpt.stores.peer_client import PeerClient, PeerError

log = logging.getLogger("shardckpt")

PEERS_NAME = "peers.json"
STATUS_NAME = "peer.json"
LOCK_NAME = "peer.lock"


@dataclasses.dataclass
class _Sent:
    version: str
    holders: list[str]
    time: float
    seconds: float


class PeerDaemon:
    """Serves this node's endpoint and replicates its newest committed step to the nodes in ``peers.json``.

    Exits on SIGTERM, or once no trainer of the node is alive, nothing is left
    to replicate and no request came for ``linger_s`` (other nodes may still
    be sending their replicas here).
    """

    def __init__(self, root: str, node: str, host: str, *, poll_s: float = 0.5, linger_s: float = 60.0) -> None:
        self.root = os.path.abspath(root)
        self.node = node
        self.host = host
        self.poll_s = poll_s
        self.linger_s = linger_s
        self.service = PeerService(self.root, node)
        self.sent: dict[int, _Sent] = {}
        self.last_error: str | None = None
        self.sent_bytes = 0
        self._retry_at = 0.0
        self._failures = 0
        self._nodes_seen: str | None = None
        self._stop = threading.Event()
        self._lock_fd: int | None = None
        self._server: PeerHTTPServer | None = None
        self._alone_since: float | None = None

    def stop(self, *_: Any) -> None:
        self._stop.set()

    def run(self) -> int:
        os.makedirs(state_dir(self.root), exist_ok=True)
        fd = os.open(os.path.join(state_dir(self.root), LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            log.info("shardckpt: a peer daemon already serves %s; this one exits", self.root)
            return 0
        self._lock_fd = fd
        try:
            self._server = serve(self.service, self.host)
            log.info("shardckpt: peer daemon (pid %d, node %s) serves %s on %s", os.getpid(), self.node,
                     self.root, self.addr)
            while not self._stop.is_set():
                if not os.path.isdir(state_dir(self.root)):
                    log.info("shardckpt: %s is gone; the peer daemon exits", self.root)
                    break
                pending = self.tick()
                self._write_status("running")
                if self._idle(pending):
                    log.info("shardckpt: peer daemon idle, no trainer left on this node; exiting")
                    break
                self._stop.wait(self.poll_s)
            return 0
        finally:
            if self._server is not None:
                self._server.shutdown()
                self._server.server_close()
            if os.path.isdir(state_dir(self.root)):
                self._write_status("exited")
            os.close(fd)

    @property
    def addr(self) -> str:
        assert self._server is not None
        return f"{self.host}:{self._server.server_address[1]}"

    def _idle(self, pending: bool) -> bool:
        now = time.monotonic()
        if pending or trainers_alive(self.root):
            self._alone_since = None
            return False
        self._alone_since = self._alone_since or now
        quiet = min(now - self._alone_since, now - self.service.last_request)
        return quiet >= self.linger_s

    def peers(self) -> dict[str, Any]:
        return read_json(os.path.join(state_dir(self.root), PEERS_NAME))

    def tick(self) -> bool:
        """Replicate the newest committed step where it is not yet; True while something is left to do."""
        config = self.peers()
        keep = config.get("keep_last")
        self.service.keep_last = keep if isinstance(keep, int) and keep > 0 else None
        count = int(config.get("replicas") or 0)
        nodes = config.get("nodes") or []
        seen = json.dumps(nodes, sort_keys=True)
        if seen != self._nodes_seen:  # a restarted job (new addresses): retry at once, not after the backoff
            self._nodes_seen, self._retry_at, self._failures = seen, 0.0, 0
        secret = self.service.secret()
        holders = placement(nodes, self.node, count)
        steps = layout.committed_steps(self.root)
        if not holders or not steps or secret is None:
            return False
        step = steps[-1]
        step_dir = os.path.join(self.root, layout.step_dirname(step))
        manifest = manifest_or_none(step_dir)
        if manifest is None:
            return False
        version = layout.version_of(manifest)
        done = self.sent.get(step)
        if done is not None and done.version == version and {h["node"] for h in holders} <= set(done.holders):
            return False
        if time.monotonic() < self._retry_at:
            return True
        names, _elsewhere = layout.copy_files(step_dir, manifest)
        t0 = time.monotonic()
        reached: list[str] = []
        for holder in holders:
            try:
                self.sent_bytes += PeerClient(holder["addr"], secret).put_replica(
                    self.node, step_dir, manifest, names, config.get("bandwidth"))
                reached.append(holder["node"])
            except (PeerError, OSError, ValueError) as exc:
                self.last_error = f"step {step} to node {holder['node']} ({holder['addr']}): {exc}"
        if len(reached) < len(holders):
            self._failures += 1
            self._retry_at = time.monotonic() + min(30.0, 0.5 * 2 ** self._failures)
            log.warning("shardckpt: step %d is not yet replicated to every peer (retry in %.1f s): %s", step,
                        self._retry_at - time.monotonic(), self.last_error)
            return True
        self._failures = 0
        self.last_error = None
        self.sent = {s: v for s, v in self.sent.items() if s in steps[-4:]}
        self.sent[step] = _Sent(version, reached, time.time(), round(time.monotonic() - t0, 3))
        log.info("shardckpt: step %d peer-durable: replicated to %s in %.2f s", step, ", ".join(reached),
                 time.monotonic() - t0)
        return False

    def _write_status(self, state: str) -> None:
        body = {
            **process_record(state, self.node),
            "addr": self.addr if self._server is not None else None,
            "replicated": {str(s): dataclasses.asdict(v) for s, v in sorted(self.sent.items())},
            "sent_bytes": self.sent_bytes,
            "last_error": self.last_error,
        }
        path = os.path.join(state_dir(self.root), STATUS_NAME)
        if read_json(path) == body:
            return
        try:
            layout.atomic_write_text(path, json.dumps(body, indent=1))
        except OSError as exc:
            log.warning("shardckpt: cannot write the peer status under %s: %s", self.root, exc)


def replicated(root: str, step: int, manifest: layout.Manifest | None = None) -> dict[str, Any] | None:
    """What this node's daemon recorded of sending its files of ``step``, for the version committed
    here (``{"holders", "time", "seconds"}``); ``None`` when not replicated (or another save was)."""
    info = read_json(os.path.join(state_dir(root), STATUS_NAME))
    sent = (info.get("replicated") or {}).get(str(step))
    if manifest is None:
        manifest = manifest_or_none(os.path.join(root, layout.step_dirname(step)))
    if not sent or manifest is None or sent.get("version") != layout.version_of(manifest):
        return None
    return sent


def node_status(root: str) -> dict[str, Any] | None:
    """What ``shardckpt status`` shows of the peer tier on this node (``None``: no daemon has run here)."""
    info = read_json(os.path.join(state_dir(root), STATUS_NAME))
    if not info:
        return None
    replicated = info.get("replicated") or {}
    newest = max((int(s) for s in replicated if s.isdigit()), default=None)
    return {
        "state": info.get("state"),
        "addr": info.get("addr"),
        "latest_peer": newest,
        "holders": replicated.get(str(newest), {}).get("holders") if newest is not None else None,
        "holding": {owner: sorted(steps) for owner, steps in committed_replicas(root).items()},
        "last_error": info.get("last_error"),
    }


def status_line(body: dict[str, Any]) -> str:
    holding = "; ".join(f"{o} steps {s}" for o, s in body["holding"].items()) or "nothing"
    return (f"  peer: daemon {body['state']} on {body['addr']}; newest step replicated: {body['latest_peer']}"
            f"{' to ' + ', '.join(body['holders']) if body['holders'] else ''}; holding replicas of {holding}"
            + (f"; last error: {body['last_error']}" if body["last_error"] else ""))


def peer_main(argv: list[str]) -> int:
    """Entry point of the peer daemon started by a trainer (no torch import)."""
    daemon_logging()
    parser = argparse.ArgumentParser(prog="shardckpt peer")
    parser.add_argument("--local", required=True, help="the node's local_dir")
    parser.add_argument("--node", default=socket.gethostname(), help="this node's name (default: hostname)")
    parser.add_argument("--host", required=True, help="the address to serve on (this node's address)")
    parser.add_argument("--poll", type=float, default=0.5, help="seconds between looks for a new step")
    parser.add_argument("--linger", type=float, default=60.0,
                        help="seconds to keep serving once no trainer of this node is left (default 60)")
    args = parser.parse_args(argv)
    daemon = PeerDaemon(args.local, args.node, args.host, poll_s=args.poll, linger_s=args.linger)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, daemon.stop)
    return daemon.run()
