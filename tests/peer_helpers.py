"""Shared parts of the peer tier's tests: simulated nodes' identities, raw requests, an endpoint fixture,
daemons in their own processes, and the strangers' floods (idle connections, replayed ClientHellos)."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import ssl
import threading
import time

import pytest
import torch
import torch.nn as nn

import shardckpt
from shardckpt.format import layout, replicas
from shardckpt.node import peer_daemon, peer_server, peer_service
from shardckpt.stores import admission, peer_client, tls


class Job:
    """The TLS identities of a few simulated nodes (each its own key pair) and what pins them."""

    def __init__(self, base, names=("owner", "holder", "second")):
        self.ids = {n: tls.node_identity(str(base / "keys" / n), f"{n}:0") for n in names}
        self.certs = [i.cert_pem for i in self.ids.values()]
        self.members = {i.fingerprint: f"{n}:0" for n, i in self.ids.items()}

    def client(self, who, addr, expect=None):
        ctx = tls.client_context(self.ids[who], self.certs)
        return peer_client.PeerClient(addr, ctx, expect=self.ids[expect].fingerprint if expect else None)

    def serve(self, who, root):
        service = peer_service.PeerService(str(root), f"{who}:0", tls.server_context(self.ids[who], self.certs),
                                           self.members)
        service.admission = admission.load(self.ids[who], self.certs)  # members' tokens taken (clients may send none)
        server = peer_server.serve(service, "127.0.0.1")
        return server, f"127.0.0.1:{server.server_address[1]}"


def _tree(root):
    """Every path under ``root`` with its size and mtime: what a refused request must leave as it was."""
    out = {}
    for base, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(base, name)
            st = os.lstat(path)
            out[os.path.relpath(path, root)] = "dir" if name in dirs else (st.st_size, st.st_mtime_ns)
    return out


def _raw(addr, method, path, body=b"", headers=None, context=None):
    """One request over TLS with ``context`` (a job member's, unless a test gives a stranger's)."""
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPSConnection(host, int(port), timeout=30, context=context)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    except (ConnectionResetError, BrokenPipeError):
        return "reset", b""  # refused while the body was still being sent
    finally:
        conn.close()


def _tier(job, me, nodes):
    """What a restore's peer views read of a node's peer tier: this node's name and TLS context, and the
    job's nodes as ``(name, address, whose certificate is pinned there)``."""
    import types

    return types.SimpleNamespace(
        on=True, committer=True, node_name=f"{me}:0", client_context=tls.client_context(job.ids[me], job.certs),
        admission=admission.load(job.ids[me], job.certs),
        nodes=[{"node": f"{n}:0", "addr": a, "cert": job.ids[c].cert_pem} for n, a, c in nodes])


def _routes(step, name, owner, tag):
    """Every route of the endpoint, as (method, path)."""
    return [("GET", "/v1/steps"), ("GET", f"/v1/local/{step}/{name}"), ("GET", f"/v1/local/{step}/"),
            ("GET", f"/v1/replica/{owner}/{step}/{name}"), ("GET", f"/v1/replica/{owner}/{step}/"),
            ("POST", f"/v1/replica/{owner}/{step}/{tag}/begin"), ("PUT", f"/v1/replica/{owner}/{step}/{tag}/f/{name}"),
            ("POST", f"/v1/replica/{owner}/{step}/{tag}/commit")]


def _answer_or_closed(addr, method, path, context, secret):
    """One request with ``context``: ``None`` when the connection was refused or closed before any answer,
    else the status (403 expected); fails when any bytes of ``secret`` (a file's content) came back."""
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPSConnection(host, int(port), timeout=30, context=context)
    try:
        conn.request(method, path, body=b"{}" if method != "GET" else None)
        resp = conn.getresponse()
        body = resp.read()
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()
    assert secret[:64] not in body and resp.status != 200, (method, path, resp.status, body[:200])
    return resp.status


def _quiet(fn):
    def run():
        try:
            fn()
        except (OSError, ValueError):
            pass
    return run


@pytest.fixture
def endpoint(tmp_path):
    """A committed step of an owner node, and a holder node's endpoint on 127.0.0.1 (a free port)."""
    owner = tmp_path / "owner"
    torch.manual_seed(0)
    with shardckpt.Checkpointer(local_dir=str(owner), preemption_signals=()) as ckpt:
        ckpt.save({"model": nn.Linear(16, 8), "extra": {"epoch": 1}}, 1)
    holder = tmp_path / "holder"
    holder.mkdir()
    job = Job(tmp_path)
    server, addr = job.serve("holder", holder)
    yield owner, holder, addr, job
    server.shutdown()
    server.server_close()

def _job_dirs(tmp_path):
    """A node job's directories: its nodes' local_dirs under ``nvme``, and the outputs of its two launches."""
    base, out, out2 = tmp_path / "nvme", tmp_path / "out", tmp_path / "out2"
    out.mkdir()
    out2.mkdir()
    return base, out, out2


def _end_daemon(info):
    """SIGKILL a node's daemon (a lost node), unless it has already ended by itself (its job over)."""
    from helpers import wait_for

    from shardckpt.node.node_registry import pid_alive

    if info.get("state") == "running" and pid_alive(info["pid"], info.get("pid_start")):
        os.kill(info["pid"], signal.SIGKILL)
        # Gone before the caller removes its directory (else a daemon still exiting writes its status there).
        wait_for(lambda: not pid_alive(info["pid"], info.get("pid_start")), 30, "the SIGKILLed peer daemon to end")


def _kill_daemons(base, signum=signal.SIGKILL):
    """Signal (by default: end) the peer daemons the jobs under ``base`` started (they outlive their trainers by
    design)."""
    from shardckpt.node.node_registry import pid_alive, read_json, state_dir

    for node in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        info = read_json(os.path.join(state_dir(os.path.join(base, node)), peer_daemon.STATUS_NAME))
        pid = info.get("pid")
        if isinstance(pid, int) and info.get("state") == "running" and pid_alive(pid, info.get("pid_start")):
            os.kill(pid, signum)


def _private_files(root):
    """Every path of the tier's directories under ``root`` whose mode lets anyone but its owner in."""
    loose = []
    for top in (root / ".shardckpt-remote", root / replicas.REPLICAS_DIR):
        for here, dirs, files in os.walk(top):
            for path, want in [(here, 0o700)] + [(os.path.join(here, f), 0o600) for f in files]:
                mode = os.stat(path).st_mode & 0o777
                if mode != want:
                    loose.append(f"{path}: {mode:o}")
    return loose


def _start_daemon(root, node, fd_limit):
    """A node's peer daemon in its own process (as a trainer starts it), at an open-file limit of ``fd_limit``."""
    import resource
    import subprocess
    import sys

    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit))

    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    log_file = open(root / ".shardckpt-remote" / "peer.log", "ab")
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from shardckpt.node.peer_daemon import peer_main; "
                             "sys.exit(peer_main(sys.argv[1:]))", "--local", str(root), "--node", node,
                             "--host", "127.0.0.1", "--poll", "0.2", "--linger", "2"],
                            env={**os.environ, "PYTHONPATH": src}, stdout=log_file, stderr=subprocess.STDOUT,
                            preexec_fn=limit)
    log_file.close()
    return proc


class _IdleFlood:
    """Strangers holding TCP connections open without a byte of TLS: ``per_source`` of them from each source
    address, each opened again as soon as the endpoint closes it (one thread, a selector; bounded by stop())."""

    def __init__(self, addr, sources, per_source):
        import selectors

        self.target = (addr.rsplit(":", 1)[0], int(addr.rsplit(":", 1)[1]))
        self.sources, self.per_source = sources, per_source
        self.sel = selectors.DefaultSelector()
        self.reopened = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _open(self, source):
        try:
            sock = socket.create_connection(self.target, timeout=5, source_address=(source, 0))
        except OSError:
            return
        sock.setblocking(False)
        self.sel.register(sock, 1, source)  # EVENT_READ: the endpoint closed it

    def _run(self):
        for source in self.sources:
            for _ in range(self.per_source):
                self._open(source)
        while not self.stopped.is_set():
            for key, _mask in self.sel.select(0.1):
                try:
                    gone = not key.fileobj.recv(1)
                except BlockingIOError:
                    gone = False
                except OSError:
                    gone = True
                if gone:
                    self.sel.unregister(key.fileobj)
                    key.fileobj.close()
                    self.reopened += 1
                    self._open(key.data)
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopped.set()
        self.thread.join(timeout=30)


def _client_hello():
    """The first flight of a TLS 1.3 client (stdlib ssl through memory buffers), to replay as is."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def _hello_flood(addr, source, seconds, most, in_flight=32):
    """Replay one ClientHello on new connections from ``source`` (``in_flight`` at a time) for ``seconds`` or
    ``most`` connections; each closes once the endpoint answered or closed. Returns how many were sent and how
    many the endpoint answered with a ServerHello (a handshake it worked on)."""
    import selectors

    hello = _client_hello()
    target = (addr.rsplit(":", 1)[0], int(addr.rsplit(":", 1)[1]))
    sel = selectors.DefaultSelector()
    sent = worked = 0
    end = time.monotonic() + seconds

    def start():
        nonlocal sent
        sock = socket.socket()
        sock.bind((source, 0))
        sock.setblocking(False)
        sock.connect_ex(target)
        sel.register(sock, selectors.EVENT_WRITE, "connecting")
        sent += 1

    for _ in range(in_flight):
        start()
    while time.monotonic() < end and sel.get_map():
        for key, _mask in sel.select(0.1):
            sock = key.fileobj
            if key.data == "connecting":
                try:
                    sock.send(hello)
                    sel.modify(sock, selectors.EVENT_READ, "sent")
                    continue
                except OSError:
                    pass
            else:
                try:
                    worked += bool(sock.recv(65536))
                except OSError:
                    pass
            sel.unregister(sock)
            sock.close()
            if sent < most and time.monotonic() < end:
                start()
    for key in list(sel.get_map().values()):
        key.fileobj.close()
    return sent, worked


def _cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _newest_complete(base, survivors, lost):
    """The newest step the ``survivors`` (node directories under ``base``) can rebuild without node ``lost``:
    the same save committed in each survivor's directory and the lost node's replica of it on a survivor."""
    here = [base / n for n in survivors]
    for step in sorted(layout.committed_steps(str(here[0])), reverse=True):
        versions = {layout.version_of(m) if m else None
                    for m in (replicas.manifest_or_none(str(d / layout.step_dirname(step))) for d in here)}
        held = [replicas.manifest_or_none(str(d / replicas.REPLICAS_DIR / replicas.owner_dirname(lost)
                                               / layout.step_dirname(step))) for d in here]
        if len(versions) == 1 and None not in versions and any(m and layout.version_of(m) in versions for m in held):
            return step
    return None
