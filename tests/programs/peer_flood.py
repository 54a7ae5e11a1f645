"""Strangers flooding a peer endpoint, in a process of their own (stdlib only; loopback addresses).

    python peer_flood.py idle HOST:PORT SOURCES RATE SECONDS
        open TCP connections that send nothing, RATE per second round SOURCES (comma-separated
        addresses to bind), each held until the endpoint closes it (or 5 s)
    python peer_flood.py hello HOST:PORT SOURCES IN_FLIGHT SECONDS [RATE]
        replay one captured TLS ClientHello on new connections round SOURCES, IN_FLIGHT at a time,
        each closed once the endpoint answered or closed it; with RATE, at most RATE new connections
        per second (without it, as fast as the endpoint answers)

It runs for SECONDS or until its stdin closes, then prints one JSON line: ``opened`` (connections),
``seconds``, ``closed_by_endpoint`` (idle) or ``worked`` (ClientHellos the endpoint answered).
"""

from __future__ import annotations

import json
import selectors
import socket
import ssl
import sys
import threading
import time


def client_hello() -> bytes:
    """The first flight of a TLS 1.3 client (stdlib ssl through memory buffers), to replay as is."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing)
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


def idle(target, sources, rate, stop):
    sel = selectors.DefaultSelector()
    held = {}
    opened = closed = 0
    t0 = time.monotonic()
    while not stop.is_set():
        now = time.monotonic()
        while opened < rate * (now - t0) and len(held) < 15000:
            sock = socket.socket()
            try:
                sock.bind((sources[opened % len(sources)], 0))
                sock.setblocking(False)
                sock.connect_ex(target)
            except OSError:
                sock.close()
                break
            sel.register(sock, selectors.EVENT_READ)
            held[sock] = now
            opened += 1
        for key, _mask in sel.select(0.001):
            try:
                gone = not key.fileobj.recv(1)
            except BlockingIOError:
                gone = False
            except OSError:
                gone = True
            if gone:
                closed += 1
                sel.unregister(key.fileobj)
                held.pop(key.fileobj, None)
                key.fileobj.close()
        for sock in [s for s, t in held.items() if now - t > 5.0][:500]:
            sel.unregister(sock)
            del held[sock]
            sock.close()
    for sock in held:
        sock.close()
    return {"opened": opened, "seconds": time.monotonic() - t0, "closed_by_endpoint": closed}


def hello(target, sources, in_flight, stop, rate=None):
    first = client_hello()
    sel = selectors.DefaultSelector()
    opened = worked = 0
    t0 = time.monotonic()

    def start():
        nonlocal opened
        sock = socket.socket()
        sock.bind((sources[opened % len(sources)], 0))
        sock.setblocking(False)
        sock.connect_ex(target)
        sel.register(sock, selectors.EVENT_WRITE, "connecting")
        opened += 1

    waiting = 0  # connections not started yet for the rate

    for _ in range(in_flight):
        start()
    while not stop.is_set():
        while waiting and (rate is None or opened < rate * (time.monotonic() - t0)):
            start()
            waiting -= 1
        for key, _mask in sel.select(0.01 if waiting else 0.1):
            sock = key.fileobj
            if key.data == "connecting":
                try:
                    sock.send(first)
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
            if not stop.is_set():
                if rate is None or opened < rate * (time.monotonic() - t0):
                    start()
                else:
                    waiting += 1
    for key in list(sel.get_map().values()):
        key.fileobj.close()
    return {"opened": opened, "seconds": time.monotonic() - t0, "worked": worked}


def main(argv):
    kind, addr, sources, amount, seconds, *rate = argv
    host, port = addr.rsplit(":", 1)
    stop = threading.Event()

    def watch():
        sys.stdin.read()
        stop.set()

    threading.Thread(target=watch, daemon=True).start()
    timer = threading.Timer(float(seconds), stop.set)
    timer.daemon = True
    timer.start()
    if kind == "idle":
        result = idle((host, int(port)), sources.split(","), float(amount), stop)
    else:
        result = hello((host, int(port)), sources.split(","), int(amount), stop, float(rate[0]) if rate else None)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
