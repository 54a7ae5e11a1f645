"""Admission tokens of the peer tier: how a job member proves itself in its connection's first bytes.

Before its TLS ClientHello, a member's client sends a small preamble
(:data:`LENGTH` bytes, in the same flight): a magic, the first 16 bytes of its
certificate's fingerprint, a timestamp, a random nonce and an HMAC-SHA256 of
them. The HMAC key is one per (client, server) pair of nodes, derived with
HKDF-SHA256 from the static ECDH secret of the two nodes' own keys (each node
multiplies its private key by the other's public key, from the pinned
certificate): only those two nodes can compute it. It is taken from the
nodes' private keys rather than from a secret the job's rendezvous would
carry, because the rendezvous (the process group's store) is neither
authenticated nor encrypted: a stranger who can read it must still learn
nothing that admits it. The key is directional (the client's fingerprint and
the server's are in HKDF's info), so a token for A→B is no token for B→A.

The endpoint (:mod:`shardckpt.node.peer_admission`) checks a token in
constant time (:func:`hmac.compare_digest`), accepts each nonce once within
:data:`WINDOW_S` and gives the member a budget of its own: no stranger, from
any address, spends it. A token only decides in which queue a connection
waits; the TLS handshake that follows still requires the member's
certificate. Keys that cannot do ECDH together (an operator's RSA keys, two
curves) give no token: such a member is served as before, from the
strangers' budget. Only stdlib ``hmac``/``hashlib`` and ``cryptography``
are used. It imports no torch.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import time

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from shardckpt.stores.tls import Identity, _load_key, fingerprint

MAGIC = b"SCKA\x01"
"""The preamble's first bytes (a TLS record starts with 0x16: the two are told apart by the first byte)."""
ID_BYTES = 16
NONCE_BYTES = 16
LENGTH = len(MAGIC) + ID_BYTES + 8 + NONCE_BYTES + 32
"""Bytes of a preamble: magic, client id, timestamp (ms, big-endian), nonce, HMAC-SHA256."""
WINDOW_S = 30.0
"""A token's timestamp may be this many seconds off the endpoint's clock (each way)."""
_INFO = b"shardckpt peer admission v1"


def _pair_key(private: ec.EllipticCurvePrivateKey, other_pem: str, client_fp: str, server_fp: str) -> bytes | None:
    """The HMAC key of connections from ``client_fp`` to ``server_fp`` (``None``: the keys cannot do ECDH)."""
    try:
        public = x509.load_pem_x509_certificate(other_pem.encode("ascii")).public_key()
        if not isinstance(public, ec.EllipticCurvePublicKey) or public.curve.name != private.curve.name:
            return None
        shared = private.exchange(ec.ECDH(), public)
    except (ValueError, TypeError):
        return None
    info = _INFO + bytes.fromhex(client_fp) + bytes.fromhex(server_fp)
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(shared)


class Admission:
    """This node's admission keys with every member whose certificate it was given (``certs``, PEM).

    ``preamble(server)`` makes a token for a connection to the node whose certificate has fingerprint
    ``server``; ``check(data)`` reads a preamble received by this node: ``(member fingerprint, nonce,
    timestamp)`` when its HMAC is right, its sender a member and its time within the window, else ``None``.
    """

    def __init__(self, identity: Identity, certs: list[str]) -> None:
        self.own = identity.fingerprint
        self._as_client: dict[str, bytes] = {}
        self._as_server: dict[bytes, tuple[str, bytes]] = {}
        private = _load_key(identity.key_path)
        if not isinstance(private, ec.EllipticCurvePrivateKey):
            return
        for pem in sorted(set(certs)):
            other = fingerprint(pem)
            outward = _pair_key(private, pem, self.own, other)
            inward = _pair_key(private, pem, other, self.own)
            if outward is not None and inward is not None:
                self._as_client[other] = outward
                self._as_server[bytes.fromhex(other)[:ID_BYTES]] = (other, inward)

    def __bool__(self) -> bool:
        return bool(self._as_server)

    def preamble(self, server: str | None, now: float | None = None) -> bytes | None:
        """The first bytes of a new connection to ``server`` (``None``: no key with it, send nothing)."""
        key = self._as_client.get(server) if server else None
        if key is None:
            return None
        stamp = int((time.time() if now is None else now) * 1000)
        body = MAGIC + bytes.fromhex(self.own)[:ID_BYTES] + struct.pack(">Q", stamp) + os.urandom(NONCE_BYTES)
        return body + hmac.new(key, body, hashlib.sha256).digest()

    def check(self, data: bytes, now: float | None = None) -> tuple[str, bytes, float] | None:
        if len(data) != LENGTH or not data.startswith(MAGIC):
            return None
        at = len(MAGIC)
        found = self._as_server.get(data[at:at + ID_BYTES])
        if found is None:
            return None
        member, key = found
        body, mac = data[:-32], data[-32:]
        if not hmac.compare_digest(hmac.new(key, body, hashlib.sha256).digest(), mac):
            return None
        stamp = struct.unpack(">Q", data[at + ID_BYTES:at + ID_BYTES + 8])[0] / 1000.0
        if abs((time.time() if now is None else now) - stamp) > WINDOW_S:
            return None
        return member, data[at + ID_BYTES + 8:at + ID_BYTES + 8 + NONCE_BYTES], stamp


def load(identity: Identity | None, certs: list[str]) -> Admission | None:
    """:class:`Admission` of ``identity`` with ``certs``, or ``None`` when it holds no key (an RSA key)."""
    if identity is None:
        return None
    found = Admission(identity, certs)
    return found if found else None
