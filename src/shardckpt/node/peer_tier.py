"""The trainer's side of the peer tier: the node's TLS identity, the node daemon, the nodes' addresses.

At the first save or load (collective over the ``ctl`` side group, every
rank alike): the ranks agree whether the tier is on (``peer_replicas``); the
committer of each node's directory makes (first launch) or loads its node's
key and certificate (:mod:`shardckpt.stores.tls`; an operator's by path
instead when ``peer_tls_*`` are set), starts the node's daemon
(:mod:`shardckpt.node.peer_daemon`) when none runs and reads its address
from the daemon's status file; the addresses and the certificates (public;
a key never leaves its node) are gathered and every node's committer writes
them into ``peers.json``, which its daemon reads and pins. ``close()`` waits,
bounded, until the head of the live branch is peer-durable. A launch with
the tier off (one node left, ``peer_replicas=0``) tells the node's daemon
that its job is over for it: nothing more to replicate, no node to retry.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import ssl
import time
from typing import Any

from shardckpt import _dist
from shardckpt.format import lineage, node_state, replicas
from shardckpt.node import peer_daemon
from shardckpt.node.node_registry import (
    pid_alive,
    read_json,
    register_trainer,
    spawn_node_daemon,
    state_dir,
    unregister_trainer,
)
from shardckpt.options import CheckpointConfig
from shardckpt.stores import admission, peer_client, tls
from shardckpt.topology import Topology

log = logging.getLogger("shardckpt")

START_WAIT_S = 30.0
"""How long the first save or load waits for a newly started daemon to report its address."""
FACT_STEPS = 8
"""How many of its newest live steps a node reports at each save (:meth:`PeerTier.facts`)."""


def node_host() -> str:
    """The address this node's daemon serves on: ``SHARDCKPT_PEER_HOST``, else the one that reaches the job's master."""
    explicit = os.environ.get("SHARDCKPT_PEER_HOST")
    if explicit:
        return explicit
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))  # no packet is sent
                return s.getsockname()[0]
        except OSError:
            pass
    return socket.gethostbyname(socket.gethostname())


class PeerTier:
    """This trainer process's view of its node's peer daemon."""

    def __init__(self, config: CheckpointConfig, root: str, *, registered: bool) -> None:
        self.config = config
        self.root = root
        self.replicas = 0
        """Replicas per step once :meth:`launch` decided (0: the tier is off)."""
        self.nodes: list[dict[str, Any]] = []
        self.committer = False
        self.identity: tls.Identity | None = None
        self.client_context: ssl.SSLContext | None = None
        self.admission: admission.Admission | None = None
        """This node's admission keys with the job's nodes (a restore's connections open with a token)."""
        self._registered = registered
        self._trainer_file: str | None = None
        self._node = ""
        self._served_addr: str | None = None
        """The address this node's daemon served on when this launch exchanged the nodes' addresses."""
        self.agreed: tuple[int, str] | None = _read_agreed(root)
        """The newest step (and its save) complete across any single node's loss, agreed at a save."""

    @property
    def on(self) -> bool:
        return self.replicas > 0

    @property
    def node_name(self) -> str:
        """This node's name in the job (set on its committer by :meth:`launch`)."""
        return self._node

    def launch(self, topology: Topology, groups: _dist.SideGroups) -> None:
        """Decide, start and connect the tier (collective over ``ctl``; every rank calls it at the same point)."""
        if not _dist.is_dist():
            self._retire()
            return
        me = (_dist.node_id(), topology.committer, os.environ.get("SHARDCKPT_FAILURE_DOMAIN") or None)
        everyone = groups.all_gather_ctl(me)
        node_names = sorted({n for n, committer, _d in everyone if committer})
        # One directory copy per node, on two nodes or more: a replica can live on another node.
        per_node = not topology.shared and len(node_names) >= 2 and len(node_names) == len(topology.committers)
        wanted = self.config.peer_replicas
        if wanted is None:
            wanted = 1 if per_node else 0
        elif wanted and not per_node:
            if _dist.rank() == 0:
                log.warning("shardckpt: peer_replicas=%d is ignored: the job's directory copies (%s) are not one per "
                            "node on >= 2 nodes, so there is no other node to hold a replica", wanted,
                            topology.describe())
            wanted = 0
        if not wanted:
            if topology.committer:
                self._retire()
            return
        self.committer = topology.committer
        entry: dict[str, Any] | None = None
        error: str | None = None
        if self.committer:
            try:
                entry = self._start(me[0], me[2])
            except Exception as exc:  # noqa: BLE001 - every rank must reach the exchange below
                error = f"node {me[0]}: {type(exc).__name__}: {exc}"
                log.error("shardckpt: the peer tier of %s cannot start on this node: %s", self.root, exc)
        gathered = groups.all_gather_ctl((entry, error))
        self.nodes = [e for e, _err in gathered if e is not None]
        errors = [err for _e, err in gathered if err]
        if errors and _dist.rank() == 0:
            log.warning("shardckpt: the peer tier runs without %d node(s) whose daemon did not start: %s",
                        len(errors), "; ".join(errors[:3]))
        self.replicas = min(wanted, max(0, len(self.nodes) - 1))
        if self.committer and entry is not None and self.identity is not None:
            try:
                self.client_context = tls.client_context(self.identity, [n["cert"] for n in self.nodes])
                self.admission = admission.load(self.identity, [n["cert"] for n in self.nodes])
            except tls.PeerTLSError as exc:
                log.error("shardckpt: the peer tier of %s: %s", self.root, exc)
            written = f"{time.time():.6f}-{os.getpid()}"
            node_state.write_private(os.path.join(state_dir(self.root), peer_daemon.PEERS_NAME), _json({
                "nodes": self.nodes, "replicas": self.replicas, "bandwidth": self.config.peer_bandwidth,
                "keep_last": self.config.keep_last, "tls": self.identity.to_json(), "written": written,
            }))
            self._await_daemon(written)
        groups.all_gather_ctl(None)  # every node's endpoint trusts this launch's certificates from here on
        if _dist.rank() == 0:
            log.info("shardckpt: peer tier: %d replica(s) of each node's files across %d node(s)", self.replicas,
                     len(self.nodes))

    def _await_daemon(self, written: str) -> None:
        """Wait (bounded) until this node's daemon serves with the certificates just written for it."""
        deadline = time.monotonic() + START_WAIT_S
        respawned = False
        while time.monotonic() < deadline:
            info = self.daemon_info()
            if info is None and not respawned:
                # The daemon this launch found running was on its way out (no trainer had been left for
                # its linger when this one registered): start another, or the node replicates nothing.
                respawned = True
                try:
                    info = self._spawn_daemon()
                except peer_client.PeerError as exc:
                    log.error("shardckpt: %s", exc)
                    return
                if info.get("addr") != self._served_addr:
                    log.warning("shardckpt: the peer daemon of %s exited as this launch started; a new one serves "
                                "on %s, not %s (the other nodes reach this one once they reload its address)",
                                self.root, info.get("addr"), self._served_addr)
            if info is None or info.get("peers_loaded") == written:
                return
            time.sleep(0.05)
        log.warning("shardckpt: the peer daemon of %s did not take this launch's certificates within %.0f s "
                    "(last error: %s)", self.root, START_WAIT_S, (self.daemon_info() or {}).get("last_error"))

    def _retire(self) -> None:
        """This launch runs without the tier: a daemon left by an earlier launch of this directory learns
        that there is no job to replicate to (it stops retrying, and exits after its linger)."""
        path = os.path.join(state_dir(self.root), peer_daemon.PEERS_NAME)
        if os.path.exists(path) and (read_json(path).get("nodes") or read_json(path).get("replicas")):
            node_state.write_private(path, _json({"nodes": [], "replicas": 0, "written": time.time()}))
            log.info("shardckpt: the peer tier is off in this launch; the peer daemon of %s stops replicating",
                     self.root)

    def _identity(self, node: str) -> tls.Identity:
        paths = (self.config.peer_tls_cert, self.config.peer_tls_key, self.config.peer_tls_ca)
        if any(paths):
            cert, key, ca = paths
            if not cert or not key or not ca:
                raise tls.PeerTLSError("peer_tls_cert, peer_tls_key and peer_tls_ca (SHARDCKPT_PEER_TLS_CERT / _KEY "
                                       "/ _CA) go together: give all three, or none to let each node make its own")
            return tls.load_identity(cert, key, ca)
        return tls.node_identity(state_dir(self.root), node)

    def _start(self, node: str, domain: str | None) -> dict[str, Any]:
        node_state.make_state_dir(self.root)
        self.identity = self._identity(node)
        if not self._registered:
            self._trainer_file = register_trainer(self.root)
        self._node = node
        info = self.daemon_info() or self._spawn_daemon()
        self._served_addr = info["addr"]
        return {"node": node, "addr": info["addr"], "domain": domain, "cert": self.identity.cert_pem}

    def _spawn_daemon(self) -> dict[str, Any]:
        """Start this node's daemon and wait (bounded) until it reports its address."""
        linger = os.environ.get("SHARDCKPT_PEER_LINGER_S") or "60"
        spawn_node_daemon(self.root, "node.peer_daemon:peer_main",
                          ["--local", self.root, "--node", self._node, "--host", node_host(), "--linger", linger],
                          "peer.log")
        deadline = time.monotonic() + START_WAIT_S
        info = None
        while info is None and time.monotonic() < deadline:
            time.sleep(0.05)
            info = self.daemon_info()
        if info is None:
            raise peer_client.PeerError(
                f"the peer daemon of {self.root} did not report its address within {START_WAIT_S:.0f} s; "
                f"see {os.path.join(state_dir(self.root), 'peer.log')}"
            )
        return info

    def daemon_info(self) -> dict[str, Any] | None:
        """The running daemon's status (address, what it replicated), ``None`` when none runs."""
        info = read_json(os.path.join(state_dir(self.root), peer_daemon.STATUS_NAME))
        pid = info.get("pid")
        if info.get("state") != "running" or not info.get("addr") or not isinstance(pid, int):
            return None
        if info.get("host", socket.gethostname()) != socket.gethostname() or not pid_alive(pid, info.get("pid_start")):
            return None
        return info

    def durable(self, step: int) -> list[str]:
        """The nodes holding this node's files of ``step`` (of the version committed here now)."""
        sent = peer_daemon.replicated(self.root, step)
        return list(sent.get("holders") or []) if sent else []

    def wait_durable(self, step: int, limit: float) -> float | None:
        """Wait at most ``limit`` seconds until this node's files of ``step`` are on ``replicas`` other nodes.

        Returns the seconds waited once they are, ``None`` when the tier is off, the
        limit passed or the daemon is not running (a warning names the step and the daemon's log).
        """
        if not self.on:
            return None
        t0 = time.monotonic()
        while len(self.durable(step)) < self.replicas:
            if time.monotonic() - t0 >= limit or self.daemon_info() is None:
                info = read_json(os.path.join(state_dir(self.root), peer_daemon.STATUS_NAME))
                log.warning("shardckpt: step %d of %s is not replicated to %d other node(s) after %.1f s (the peer "
                            "daemon %s; last error: %s; its log: %s)", step, self.root, self.replicas,
                            time.monotonic() - t0, "is running" if self.daemon_info() else "is not running",
                            info.get("last_error"), os.path.join(state_dir(self.root), "peer.log"))
                return None
            time.sleep(0.05)
        return time.monotonic() - t0

    def facts(self) -> dict[str, Any] | None:
        """What this node tells the others at each save's commit exchange (its committer only): for each
        step of its live branch on its disk, the save (version) and the nodes holding its files of it."""
        if not self.on or not self.committer:
            return None
        infos = lineage.local_infos(self.root)
        live, _abandoned = lineage.classify(infos)
        steps = {}
        for step in live[-FACT_STEPS:]:
            sent = peer_daemon.replicated(self.root, step)
            steps[step] = [infos[step].version, list(sent.get("holders") or []) if sent else []]
        return {"node": _dist.node_id(), "steps": steps}

    def agree(self, reports: list[Any]) -> None:
        """Every rank, after a save's commit exchange, from the reports every node gathered alike: the
        newest step complete across the loss of any one node becomes the point below which retention
        may delete, here and on every node; the daemon applies the same point to the replicas it holds."""
        if not self.on:
            return
        found = replicas.complete_across_any_loss(reports, [n["node"] for n in self.nodes])
        if found is None or found == self.agreed:
            return
        self.agreed = found
        if self.committer:
            path = os.path.join(state_dir(self.root), peer_daemon.AGREED_NAME)
            try:
                node_state.make_state_dir(self.root)
                node_state.write_private(path, _json({"step": found[0], "version": found[1]}))
            except OSError as exc:  # the daemon keeps its replicas from the earlier point: nothing is lost
                log.warning("shardckpt: cannot write %s: %s; the peer daemon keeps the replicas it holds from "
                            "an earlier step", path, exc)

    def protects(self, step: int) -> bool:
        """Local retention keeps ``step`` while it is the head of another node's live branch among the
        replicas held here (the replica saved last, not the highest number), and every step of the live
        branch from the newest one complete across any single node's loss (:meth:`agree`, the same point on
        every node) — all of them while no step of this branch is, yet."""
        if not self.on:
            return False
        for held in replicas.committed_replicas(self.root).values():
            top = lineage.head({s: lineage.info_of(m) for s, m in held.items()})
            if top is not None and top.step == step:
                return True
        agreed = self.agreed
        if agreed is None:
            return True
        here = lineage.local_infos(self.root).get(agreed[0])
        if here is None or here.version != agreed[1]:  # another branch's point (a rollback): keep everything
            return True
        return step >= agreed[0]

    def live_head(self) -> int | None:
        """This node's newest step of the live branch (the lineage's head), ``None`` when none."""
        live, _abandoned = lineage.classify(lineage.local_infos(self.root))
        return live[-1] if live else None

    def status(self) -> dict[str, Any]:
        """The ``Checkpointer.status()`` fields of the peer tier."""
        if not self.on:
            return {"peer_replicas": 0}
        steps, _abandoned = lineage.classify(lineage.local_infos(self.root))
        durable = [s for s in steps if len(self.durable(s)) >= self.replicas]
        info = read_json(os.path.join(state_dir(self.root), peer_daemon.STATUS_NAME)) if self.committer else {}
        return {
            "peer_replicas": self.replicas,
            "latest_peer": durable[-1] if durable else None,
            "peer": {
                "nodes": [n["node"] for n in self.nodes],
                "addr": info.get("addr"),
                "running": self.daemon_info() is not None if self.committer else None,
                "holders": {s: self.durable(s) for s in steps[-3:]},
                "last_error": info.get("last_error"),
            },
        }

    def close(self, timeout: float | None) -> None:
        """Wait (at most ``timeout`` or ``drain_timeout_s``) until this node's newest step is peer-durable."""
        try:
            if not self.on or not self.committer:
                return
            head = self.live_head()
            if head is None:
                return
            steps = [head]
            limit = self.config.drain_timeout_s if timeout is None else min(timeout, self.config.drain_timeout_s)
            deadline = time.monotonic() + limit
            while len(self.durable(steps[-1])) < self.replicas:
                if time.monotonic() >= deadline or self.daemon_info() is None:
                    info = read_json(os.path.join(state_dir(self.root), peer_daemon.STATUS_NAME))
                    log.warning(
                        "shardckpt: close(): step %d of %s is not yet replicated to %d other node(s) after %.0f s "
                        "(the peer daemon %s; last error: %s; its log: %s)", steps[-1], self.root, self.replicas,
                        limit, "goes on after this process exits" if self.daemon_info() else "is not running",
                        info.get("last_error"), os.path.join(state_dir(self.root), "peer.log"),
                    )
                    return
                time.sleep(0.1)
        finally:
            unregister_trainer(self._trainer_file)
            self._trainer_file = None


def _read_agreed(root: str) -> tuple[int, str] | None:
    body = read_json(os.path.join(state_dir(root), peer_daemon.AGREED_NAME))
    step, version = body.get("step"), body.get("version")
    return (step, version) if isinstance(step, int) and isinstance(version, str) else None


def _json(body: dict[str, Any]) -> str:
    return json.dumps(body, indent=1)
