"""The peer daemon: one per node (per ``local_dir``), serving its endpoint and replicating its steps.

``shardckpt peer``, started by the node's local rank 0 like the uploader, and
outliving the trainer, does two things:

* **serves** the endpoint (:mod:`shardckpt.node.peer_service`) on the node's address;
* **replicates**: after each local commit it sends this node's files of the
  newest committed step to ``peer_replicas`` other nodes (a ring over the
  nodes, off the owner's ``SHARDCKPT_FAILURE_DOMAIN``), at most
  ``peer_bandwidth`` bytes/s.

What it replicates is this node's live branch: the head of its lineage
(:mod:`shardckpt.format.lineage`), never the highest step number, so a
rollback's new steps are replicated and an abandoned one is not.

Files the daemon and the trainer share, in ``<local_dir>/.shardckpt-remote/``
(mode 0700): ``peer-key.pem`` (this node's private key, 0600, never sent),
``peer-cert.pem``, ``peers.json`` (the job's nodes with their certificates,
written by the trainer), ``peer-agreed.json`` (the step below which the
replicas held here may go, agreed by the job's nodes at a save, written by the
trainer), ``peer.json`` (the daemon's address and what it
replicated), ``peer.lock``, ``peer.log``. It imports no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import socket
import ssl
import threading
import time
from typing import Any

from shardckpt.errors import PeerError
from shardckpt.format import layout, lineage, node_state
from shardckpt.format.replicas import committed_replicas, manifest_or_none, placement
from shardckpt.node.node_registry import (
    acquire_lock,
    daemon_logging,
    process_record,
    read_json,
    state_dir,
    trainers_alive,
)
from shardckpt.node.peer_server import PeerServer, serve
from shardckpt.node.peer_service import PeerService
from shardckpt.stores import admission, tls
from shardckpt.stores.peer_client import PeerClient

log = logging.getLogger("shardckpt")

PEERS_NAME = node_state.PEERS_NAME
AGREED_NAME = node_state.AGREED_NAME
STATUS_NAME = node_state.PEER_STATUS_NAME
LOCK_NAME = "peer.lock"
LOCK_WAIT_S = 15.0
"""How long a new daemon waits for the lock of one that is exiting (it shuts its endpoint down first)."""


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
        self._server: PeerServer | None = None
        self._alone_since: float | None = None
        self._failing_since: float | None = None
        self._tls_seen: Any = None
        self._client_ctx: ssl.SSLContext | None = None
        self._admission: admission.Admission | None = None
        self._members: dict[str, str] = {}
        self._tls_failed = False
        self._clients: dict[tuple[str, str | None, int], PeerClient] = {}
        self._peers_loaded: Any = None
        """The ``written`` stamp of the peers.json whose certificates the endpoint serves with now."""

    def stop(self, *_: Any) -> None:
        self._stop.set()

    def run(self) -> int:
        node_state.make_state_dir(self.root)
        # A trainer starts a daemon when none reports itself running: one still holding the lock is
        # on its way out (its status says so); wait for it rather than leave the node without one.
        fd = acquire_lock(os.path.join(state_dir(self.root), LOCK_NAME), LOCK_WAIT_S)
        if fd is None:
            log.info("shardckpt: a peer daemon already serves %s; this one exits", self.root)
            return 0
        self._lock_fd = fd
        try:
            self._load_tls(self.peers())
            self._server = self._serve()
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
            for client in self._clients.values():
                client.close()
            if self._server is not None:
                self._server.shutdown()
            if os.path.isdir(state_dir(self.root)):
                self._write_status("exited")
            os.close(fd)

    def _serve(self) -> Any:
        """The endpoint, on the port of this node's previous daemon when it is free again: a daemon that
        replaces one (which exited as a launch started) keeps the address the other nodes were given."""
        previous = str(read_json(os.path.join(state_dir(self.root), STATUS_NAME)).get("addr") or "")
        host, _sep, port = previous.rpartition(":")
        if host == self.host and port.isdigit():
            try:
                return serve(self.service, self.host, int(port))
            except OSError:
                pass
        return serve(self.service, self.host)

    @property
    def addr(self) -> str:
        assert self._server is not None
        return f"{self.host}:{self._server.server_address[1]}"

    def _idle(self, pending: bool) -> bool:
        """Exit time: no trainer of this node is left, and for ``linger_s`` nothing came to serve and either
        nothing was left to send or every try to send it failed (a holder gone with its job)."""
        now = time.monotonic()
        if trainers_alive(self.root):
            self._alone_since = None
            return False
        if pending and self._failing_since is None:
            self._alone_since = None
            return False
        self._alone_since = self._alone_since or now
        if not self.peers().get("nodes"):  # the last launch here ran without the tier: no peer will come
            return True
        quiet = min(now - self._alone_since, now - self.service.last_request)
        return quiet >= self.linger_s

    def peers(self) -> dict[str, Any]:
        return read_json(os.path.join(state_dir(self.root), PEERS_NAME))

    def _load_tls(self, config: dict[str, Any]) -> bool:
        """(Re)build the TLS contexts when the job's certificates or this node's key files change.

        A key or certificate that cannot be used becomes ``last_error`` (naming the file and the remedy);
        returns whether the contexts are usable."""
        paths = config.get("tls") or {}
        cert = paths.get("cert") or os.path.join(state_dir(self.root), tls.CERT_NAME)
        key = paths.get("key") or os.path.join(state_dir(self.root), tls.KEY_NAME)
        ca = paths.get("ca")
        nodes = config.get("nodes") or []
        seen = (cert, key, ca, json.dumps(nodes, sort_keys=True), _stamp(cert), _stamp(key), _stamp(ca))
        if seen == self._tls_seen:
            return self._client_ctx is not None
        self._tls_seen = seen
        try:
            identity = tls.load_identity(cert, key, ca)
            trusted = [n["cert"] for n in nodes if n.get("cert")]
            members = {tls.fingerprint(n["cert"]): n["node"] for n in nodes if n.get("cert")}
            server_ctx = tls.server_context(identity, trusted)
            self._client_ctx = tls.client_context(identity, trusted)
            self._admission = admission.load(identity, trusted)
        except (tls.PeerTLSError, ValueError, KeyError, TypeError) as exc:
            self._client_ctx = None
            self.service.context = None
            self.last_error, self._tls_failed = f"node {self.node}: {exc}", True
            log.error("shardckpt: the peer daemon of %s cannot use its TLS identity: %s", self.root, exc)
            return False
        self._members = members
        self.service.configure(server_ctx, members, self._admission)
        if self._tls_failed:
            self.last_error, self._tls_failed = None, False
        return True

    def live_head(self) -> tuple[int, layout.Manifest] | None:
        """This node's newest step of its live branch (the lineage's head), never the highest number alone."""
        infos = lineage.local_infos(self.root)
        live, _abandoned = lineage.classify(infos)
        if not live:
            return None
        step = live[-1]
        manifest = manifest_or_none(os.path.join(self.root, layout.step_dirname(step)))
        return (step, manifest) if manifest is not None else None

    def tick(self) -> bool:
        """Replicate the live head step where it is not yet; True while something is left to do."""
        config = self.peers()
        keep = config.get("keep_last")
        self.service.keep_last = keep if isinstance(keep, int) and keep > 0 else None
        agreed = read_json(os.path.join(state_dir(self.root), AGREED_NAME))
        point = (agreed.get("step"), agreed.get("version"))
        if isinstance(point[0], int) and isinstance(point[1], str) and point != self.service.agreed:
            self.service.agreed = point  # the job's nodes moved the point: replicas below it may go now
            self.service.retain_all()
        count = int(config.get("replicas") or 0)
        nodes = config.get("nodes") or []
        seen = json.dumps(nodes, sort_keys=True)
        if seen != self._nodes_seen:  # a restarted job (new addresses): retry at once, not after the backoff
            self._nodes_seen, self._retry_at, self._failures, self._failing_since = seen, 0.0, 0, None
        holders = placement(nodes, self.node, count)  # none when this node left the job or the tier is off
        if nodes and not self._load_tls(config):
            return False
        self._peers_loaded = config.get("written")
        found = self.live_head() if holders else None
        if found is None:
            self._failing_since = None
            return False
        step, manifest = found
        step_dir = os.path.join(self.root, layout.step_dirname(step))
        version = layout.version_of(manifest)
        done = self.sent.get(step)
        if done is not None and done.version == version and {h["node"] for h in holders} <= set(done.holders):
            return False
        if time.monotonic() < self._retry_at:
            return True
        live = lineage.info_of(manifest).lineage.to_json()
        names, _elsewhere = layout.copy_files(step_dir, manifest)
        t0 = time.monotonic()
        reached: list[str] = []
        for holder in holders:
            try:
                expect = tls.fingerprint(holder["cert"]) if holder.get("cert") else None
                client = self._client(holder["addr"], expect)
                self.sent_bytes += client.put_replica(self.node, step_dir, manifest, names, config.get("bandwidth"),
                                                      live=live)
                reached.append(holder["node"])
            except (PeerError, OSError, ValueError) as exc:
                self.last_error = f"step {step} to node {holder['node']} ({holder['addr']}): {exc}"
        if len(reached) < len(holders):
            self._failures += 1
            self._failing_since = self._failing_since or time.monotonic()
            self._retry_at = time.monotonic() + min(30.0, 0.5 * 2 ** self._failures)
            log.warning("shardckpt: step %d is not yet replicated to every peer (retry in %.1f s): %s", step,
                        self._retry_at - time.monotonic(), self.last_error)
            return True
        self._failures = 0
        self._failing_since = None
        self.last_error = None
        self.sent = {s: v for s, v in self.sent.items()
                     if s in lineage.classify(lineage.local_infos(self.root))[0][-4:]}
        self.sent[step] = _Sent(version, reached, time.time(), round(time.monotonic() - t0, 3))
        log.info("shardckpt: step %d peer-durable: replicated to %s in %.2f s", step, ", ".join(reached),
                 time.monotonic() - t0)
        return False

    def _client(self, addr: str, expect: str | None) -> PeerClient:
        """The client of a holder, kept from one step to the next (its connections are reused); clients of
        other addresses, certificates or TLS contexts are closed."""
        key = (addr, expect, id(self._client_ctx))
        client = self._clients.get(key)
        if client is None:
            for old in self._clients.values():
                if old.addr == addr:
                    old.close()
            self._clients = {k: c for k, c in self._clients.items() if c.addr != addr}
            client = self._clients[key] = PeerClient(addr, self._client_ctx, expect=expect, admission=self._admission)
        return client

    def _write_status(self, state: str) -> None:
        body = {
            **process_record(state, self.node),
            "addr": self.addr if self._server is not None else None,
            "replicated": {str(s): dataclasses.asdict(v) for s, v in sorted(self.sent.items())},
            "sent_bytes": self.sent_bytes,
            "last_error": self.last_error,
            "peers_loaded": self._peers_loaded,
        }
        path = os.path.join(state_dir(self.root), STATUS_NAME)
        if read_json(path) == body:
            return
        try:
            node_state.write_private(path, json.dumps(body, indent=1))
        except OSError as exc:
            log.warning("shardckpt: cannot write the peer status under %s: %s", self.root, exc)


replicated = node_state.replicated


def latest_replicated(root: str) -> int | None:
    """The newest step of this node's live branch whose files (of the save committed here) are replicated."""
    live, _abandoned = lineage.classify(lineage.local_infos(root))
    return next((s for s in reversed(live) if replicated(root, s)), None)


def node_status(root: str) -> dict[str, Any] | None:
    """What ``shardckpt status`` shows of the peer tier on this node (``None``: no daemon has run here)."""
    info = read_json(os.path.join(state_dir(root), STATUS_NAME))
    if not info:
        return None
    replicated = info.get("replicated") or {}
    newest = latest_replicated(root)
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


def _stamp(path: str | None) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path) if path else None
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_mode) if st else None


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
