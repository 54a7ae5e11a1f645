"""Mutual TLS for the peer tier: each node's own key and certificate, and the contexts that pin the job's.

Each node makes its own private key (ECDSA P-256) and a self-signed
certificate on its first launch, in its own ``local_dir`` state directory,
readable only by the job's user; the key never leaves that file. Only the
certificates are exchanged (through the job's rendezvous), and each endpoint
trusts exactly the certificates of the nodes of this launch (pinned): TLS 1.3,
a client certificate required both ways.

An operator with their own PKI gives a CA, a certificate and a key by path
(``peer_tls_ca``, ``peer_tls_cert``, ``peer_tls_key``, or
``SHARDCKPT_PEER_TLS_CA`` / ``_CERT`` / ``_KEY``): then a peer is trusted
when its certificate chains to that CA, and the rendezvous is not trusted for
keys at all (it only names which certificate is which node's).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import os
import ssl
import stat
import uuid

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from shardckpt.errors import PeerTLSError
from shardckpt.format.node_state import private_dir

KEY_NAME = "peer-key.pem"
CERT_NAME = "peer-cert.pem"
VALID_DAYS = 3650


@dataclasses.dataclass(frozen=True)
class Identity:
    """This node's TLS identity: its certificate and key files, and an operator's CA when given."""

    cert_path: str
    key_path: str
    cert_pem: str
    ca_path: str | None = None

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.cert_pem)

    def to_json(self) -> dict[str, str | None]:
        return {"cert": self.cert_path, "key": self.key_path, "ca": self.ca_path}


def fingerprint(cert: str | bytes) -> str:
    """SHA-256 of a certificate's DER bytes (``cert``: PEM text, or DER bytes), hex."""
    der = ssl.PEM_cert_to_DER_cert(cert) if isinstance(cert, str) else cert
    return hashlib.sha256(der).hexdigest()


def check_private(path: str, what: str) -> None:
    """Refuse a key file that is missing, not a plain file of this user, or readable by group or others."""
    try:
        info = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        raise PeerTLSError(f"the peer tier's {what} {path} is missing. Remedy: give an existing file (an operator's "
                           f"key), or delete the state directory's peer-cert.pem too so that the next launch makes "
                           f"a new key pair") from None
    except OSError as exc:
        raise PeerTLSError(f"the peer tier's {what} {path} cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise PeerTLSError(f"the peer tier's {what} {path} is not a plain file (a link or a directory); "
                           f"Remedy: put the key itself there")
    if info.st_uid != os.getuid():
        raise PeerTLSError(f"the peer tier's {what} {path} belongs to another user (owner uid {info.st_uid}; this "
                           f"process runs as uid {os.getuid()}), so that user can read or replace it; it is not "
                           f"used. Remedy: chown {os.getuid()} {path} (as its owner or root), keeping mode 600")
    if info.st_mode & 0o077:
        raise PeerTLSError(f"the peer tier's {what} {path} is readable by other users (mode "
                           f"{stat.S_IMODE(info.st_mode):o}); it is not used. Remedy: chmod 600 {path}")


def _write_private(path: str, data: bytes) -> None:
    """Write ``path`` as a file only this user can read, whatever the umask (tmp + rename)."""
    tmp = f"{path}.{uuid.uuid4().hex[:8]}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def node_identity(directory: str, node: str) -> Identity:
    """This node's own key pair in ``directory``, made on the first call (the key never leaves the file).

    A key there is checked (a plain file of this user, mode 0600); its
    certificate is made again when missing, expiring or of another key.
    """
    private_dir(directory)
    key_path, cert_path = os.path.join(directory, KEY_NAME), os.path.join(directory, CERT_NAME)
    if not os.path.lexists(key_path):
        if os.path.lexists(cert_path):
            raise PeerTLSError(f"the peer tier's key {key_path} is missing beside its certificate {cert_path}. "
                               f"Remedy: restore the key, or delete {cert_path} so that a new key pair is made")
        key = ec.generate_private_key(ec.SECP256R1())
        try:
            _write_private(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
        except FileExistsError:
            pass
    check_private(key_path, "private key")
    key = _load_key(key_path)
    cert = _load_cert_or_none(cert_path)
    now = datetime.datetime.now(datetime.timezone.utc)
    if cert is None or cert.not_valid_after_utc - now < datetime.timedelta(days=30) or \
            cert.public_key().public_numbers() != key.public_key().public_numbers():
        cert = _self_signed(key, node, now)
        _write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return Identity(cert_path, key_path, cert.public_bytes(serialization.Encoding.PEM).decode("ascii"))


def load_identity(cert: str, key: str, ca: str | None = None) -> Identity:
    """A node's identity from its files (an operator's, or one :func:`node_identity` made), checked: the key
    private to this user, the certificate the key's, the CA (when given) present."""
    check_private(key, "private key")
    for path, what in ((ca, "CA certificate"), (cert, "certificate")):
        if path is not None and not os.path.isfile(path):
            raise PeerTLSError(f"the peer tier's {what} {path} is missing. Remedy: check peer_tls_"
                               f"{'ca' if what.startswith('CA') else 'cert'} / SHARDCKPT_PEER_TLS_"
                               f"{'CA' if what.startswith('CA') else 'CERT'}")
    loaded = _load_cert_or_none(cert)
    if loaded is None:
        raise PeerTLSError(f"the peer tier's certificate {cert} is not a PEM certificate")
    if loaded.public_key().public_numbers() != _load_key(key).public_key().public_numbers():
        raise PeerTLSError(f"the peer tier's certificate {cert} is not of the key {key}. Remedy: give the "
                           f"certificate issued for that key")
    return Identity(cert, key, loaded.public_bytes(serialization.Encoding.PEM).decode("ascii"), ca)


def _load_key(path: str) -> ec.EllipticCurvePrivateKey:
    try:
        with open(path, "rb") as f:
            key = serialization.load_pem_private_key(f.read(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise PeerTLSError(f"the peer tier's private key {path} cannot be loaded ({exc}). Remedy: give an "
                           f"unencrypted PEM key, or delete it and its certificate to make a new pair") from None
    return key  # type: ignore[return-value]


def _load_cert_or_none(path: str) -> x509.Certificate | None:
    try:
        with open(path, "rb") as f:
            return x509.load_pem_x509_certificate(f.read())
    except (OSError, ValueError):
        return None


def _self_signed(key: ec.EllipticCurvePrivateKey, node: str, now: datetime.datetime) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"shardckpt node {node}"[:64])])
    return (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))


def _context(purpose: int, identity: Identity, trusted: list[str]) -> ssl.SSLContext:
    ctx = ssl.SSLContext(purpose)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    if purpose == ssl.PROTOCOL_TLS_CLIENT:
        ctx.check_hostname = False  # the peer is identified by its pinned certificate, not a host name
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        check_private(identity.key_path, "private key")
        ctx.load_cert_chain(identity.cert_path, identity.key_path)
        if identity.ca_path:
            ctx.load_verify_locations(cafile=identity.ca_path)
        else:
            ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # a pinned self-signed leaf is its own anchor
            ctx.load_verify_locations(cadata="".join(sorted(set(trusted + [identity.cert_pem]))))
    except ssl.SSLError as exc:
        raise PeerTLSError(f"the peer tier's certificate {identity.cert_path}, key {identity.key_path}"
                           f"{' or CA ' + identity.ca_path if identity.ca_path else ''} cannot be used: {exc}. "
                           f"Remedy: check that the certificate is the key's, both PEM") from None
    return ctx


def server_context(identity: Identity, trusted: list[str]) -> ssl.SSLContext:
    """Serve as ``identity``; accept only clients presenting one of ``trusted`` (or, operator mode, the CA's)."""
    return _context(ssl.PROTOCOL_TLS_SERVER, identity, trusted)


def client_context(identity: Identity, trusted: list[str]) -> ssl.SSLContext:
    """Connect as ``identity``; accept only servers presenting one of ``trusted`` (or, operator mode, the CA's)."""
    return _context(ssl.PROTOCOL_TLS_CLIENT, identity, trusted)
