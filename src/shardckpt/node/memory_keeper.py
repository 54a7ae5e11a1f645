"""The node's memory keeper: frees a ``local_dir``'s shared memory once its job is over on this node.

The memory tier's copies are files in a tmpfs (``format/shm.py``): they
outlive the trainer on purpose (a restarted trainer resumes from them), and
nothing frees them by itself. A clean ``close()`` frees its own. For the rest
(a job killed and not restarted, a node left out of the next launch) the
first trainer of the node that keeps a step in memory starts this keeper
(one per ``local_dir``, like the uploader and the peer daemon; no torch). It
exits when the namespace is gone and no trainer is left, and removes the
namespace once no trainer of the node has been alive for ``--linger``
seconds (``SHARDCKPT_MEMORY_LINGER_S``, default :data:`LINGER_S`): long
enough for a launcher or a scheduler to restart the job here. A keeper
looks after one run's namespace (``--ns``): once the directory holds another
run (removed and created again) that memory is of no use to a restart: the
run stops being alive at once (a job of the new run reports it and frees
it), and the keeper frees it after its linger if none did. While the run is
the directory's, the keeper holds it alive
(``format/shm.hold``), so no job of another run frees the memory meanwhile.

Its files sit beside the other daemons' in ``<local_dir>/.shardckpt-remote/``:
``memory-<id>.lock`` (held while it runs; ``<id>`` names this machine's
shared memory of the ``local_dir``, so each node of a job whose
``local_dir`` is on a shared filesystem gets its own keeper), ``memory.log``.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import signal
import threading
import time
from typing import Any

from shardckpt._text import fmt_bytes
from shardckpt.format import shm
from shardckpt.node.node_registry import (
    acquire_lock,
    daemon_logging,
    lock_held,
    make_state_dir,
    register_trainer,
    spawn_node_daemon,
    state_dir,
    trainers_alive,
)

log = logging.getLogger("shardckpt")

LINGER_S = 120.0
"""Seconds the memory of a job with no live trainer on this node is kept for a restart."""


def lock_path(root: str, ns: str | None = None) -> str:
    """The lock of the keeper of ``root``'s shared memory on this machine (one per machine and namespace)."""
    ns = ns or shm.namespace(root) or ""
    here = hashlib.sha256(f"{shm.machine()}\0{ns}".encode("utf-8", "surrogatepass")).hexdigest()
    return os.path.join(state_dir(root), f"memory-{here[:12]}.lock")


def running(root: str) -> bool:
    """A keeper holds the lock of ``root``'s shared memory on this machine."""
    return lock_held(lock_path(root))


def join(root: str, starts: bool) -> str:
    """A trainer keeps steps in memory: it counts as the node's trainer, and (``starts``: the node's first
    rank) starts the keeper when none runs. Returns the trainer's file (``node_registry.unregister_trainer``)."""
    path = register_trainer(root)
    ns = shm.namespace(root)
    if starts and ns is not None and not running(root):
        linger = os.environ.get("SHARDCKPT_MEMORY_LINGER_S") or str(LINGER_S)
        spawn_node_daemon(root, "node.memory_keeper:keeper_main", ["--local", root, "--linger", linger, "--ns", ns],
                          "memory.log")
    return path


class MemoryKeeper:
    def __init__(self, root: str, *, linger_s: float = LINGER_S, poll_s: float = 0.5, ns: str | None = None) -> None:
        self.root = os.path.abspath(root)
        self.ns = ns or shm.namespace(self.root) or ""
        self.run_of_ns = os.path.basename(self.ns).rsplit("-", 1)[-1]
        self.linger_s = linger_s
        self.poll_s = poll_s
        self._stop = threading.Event()

    def stop(self, *_: Any) -> None:
        self._stop.set()

    def run(self) -> int:
        make_state_dir(self.root)
        fd = acquire_lock(lock_path(self.root, self.ns))
        if fd is None:
            return 0  # another keeper looks after this machine's memory of this local_dir
        alive = shm.hold(self.ns) if os.path.isdir(self.ns) else None
        try:
            log.info("shardckpt: memory keeper (pid %d) of %s: %s", os.getpid(), self.root, self.ns)
            alone_since: float | None = None
            changed_at: float | None = None
            while not self._stop.is_set():
                held = os.path.isdir(self.ns)
                if held and (changed_at is not None or shm.run_id(self.root) != self.run_of_ns):
                    # No restart can use this memory: its run is no longer the directory's. The run stops being
                    # alive at once (a job of the new run reports it and frees it), else it is freed here after the
                    # linger.
                    if changed_at is None:
                        changed_at = time.monotonic()
                        if alive is not None:
                            os.close(alive)
                            alive = None
                    if time.monotonic() - changed_at >= self.linger_s:
                        freed = shm.purge(self.root, self.ns)
                        log.info("shardckpt: %s now holds another run (or none): freed %s of shared memory of run "
                                 "%s (%s); exiting", self.root, fmt_bytes(freed), self.run_of_ns, self.ns)
                        break
                elif changed_at is not None:
                    break  # freed by a job of the directory's new run
                elif trainers_alive(self.root):
                    alone_since = None
                elif not held:
                    log.info("shardckpt: no trainer left and no shared memory held for %s; exiting", self.root)
                    break
                else:
                    alone_since = alone_since or time.monotonic()
                    if time.monotonic() - alone_since >= self.linger_s:
                        freed = shm.purge(self.root, self.ns)
                        log.info("shardckpt: no trainer of %s on this node for %.0f s: freed %s of shared memory "
                                 "(%s); exiting", self.root, self.linger_s, fmt_bytes(freed), self.ns)
                        break
                self._stop.wait(self.poll_s)
            return 0
        finally:
            if alive is not None:
                os.close(alive)
            os.close(fd)


def keeper_main(argv: list[str]) -> int:
    """Entry point of the memory keeper started by a trainer (no torch import)."""
    daemon_logging()
    parser = argparse.ArgumentParser(prog="shardckpt memory-keeper")
    parser.add_argument("--local", required=True, help="the node's local_dir")
    parser.add_argument("--linger", type=float, default=LINGER_S,
                        help=f"seconds the memory is kept once no trainer of this node is left (default {LINGER_S:g})")
    parser.add_argument("--ns", default=None,
                        help="the run's namespace in shared memory (default: the directory's run)")
    args = parser.parse_args(argv)
    keeper = MemoryKeeper(args.local, linger_s=args.linger, ns=args.ns)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, keeper.stop)
    return keeper.run()
