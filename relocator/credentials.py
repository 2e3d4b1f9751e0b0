"""A cluster's credentials: a CA, one certificate per node agent, and the image key.

`relocator up` and `relocator deploy` make the cluster's (`make_cluster`) and one bundle per node
(`for_nodes`); the controller hands each agent its own as it starts it, the agent writes it into its
node directory (`install`, 0600) and points RELOCATOR_CREDENTIALS there, so that everything it
starts (CRIU, the post-copy keeper and pump) finds them. Transfers are TLS with mutual X.509
authentication against the cluster's CA (`criu_tls_args`, `server_context`, `client_context`);
the image key authenticates manifests and verification stamps (relocator.snapshot.manifest).

This module must import with the standard library only: the keeper and the pump run under
`python -S` (`cryptography` is imported by the functions that make keys, run by up/deploy).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import ssl
from pathlib import Path
from typing import Any

ENV_DIR = "RELOCATOR_CREDENTIALS"  # a node's credentials directory (what `install` wrote)
ENV_KEY = "RELOCATOR_IMAGE_KEY"  # by-hand commands: the image key itself, instead of a directory
ENV_INSECURE = "RELOCATOR_INSECURE_TRANSFERS"  # by-hand commands only: "1" = plaintext transfers
ENV_MACHINE_KEY = "RELOCATOR_MACHINE_KEY_FILE"  # by-hand commands: this machine's own image key
ENV_MOVE = "RELOCATOR_MOVE_CREDENTIALS"  # one move's own transfer credentials (make_move), for its children
#: `relocator bench relocation --plaintext-transfers` only: "1" = every transfer of this agent in
#: plaintext, to measure what TLS costs (check_bench_plaintext refuses it beyond BENCH_NETS)
ENV_BENCH_PLAINTEXT = "RELOCATOR_BENCH_PLAINTEXT_TRANSFERS"
#: where the bench's plaintext switch is honoured: loopback and the emulated hosts' bridge
#: (relocator/cluster/emulate.py's default subnet), never a real network
BENCH_NETS = ("127.0.0.0/8", "::1/128", "10.250.0.0/24")
CA, CERT, KEY, IMAGE_KEY = "ca.pem", "node.pem", "node.key", "image.key"
CLUSTER_FILE = "cluster-credentials.json"  # `up`: the cluster's CA key and image key, 0600
FIX = ("run it under `relocator up` or `relocator deploy` (they give every agent its credentials), or "
       f"for a by-hand command point {ENV_DIR} at a node's credentials directory")


class CredentialsError(RuntimeError):
    """A node lacks (part of) its cluster credentials."""


# -- making them (up, deploy, the controller) -------------------------------------------------
def _name(cn: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "relocator"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem_key(key) -> str:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


def _cert(subject: str, issuer, public_key, signing_key, ca: bool) -> str:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
         .public_key(public_key).serial_number(x509.random_serial_number())
         # a day back: the hosts' clocks need not agree to the second
         .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=3650))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True))
    if ca:
        b = b.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                          content_commitment=False, key_encipherment=False, data_encipherment=False,
                                          key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
    else:  # every transfer endpoint is a server one time and a client another
        from cryptography.x509.oid import ExtendedKeyUsageOID

        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                            critical=False)
    return b.sign(signing_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM).decode()


def make_cluster(name: str = "relocator") -> dict[str, str]:
    """A new cluster's CA (ECDSA P-256: GnuTLS, as CRIU links it, and OpenSSL both take it) and
    a random 256-bit image key: {ca_cert, ca_key, image_key (hex)}."""
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    cn = f"{name} cluster CA {secrets.token_hex(4)}"
    return {"ca_cert": _cert(cn, _name(cn), key.public_key(), key, ca=True), "ca_key": _pem_key(key),
            "image_key": secrets.token_hex(32)}


def for_node(cluster: dict[str, str] | None, node: str) -> dict[str, str] | None:
    """What one node's agent gets: the CA's certificate (not its key), a certificate and key of
    its own signed by the CA, and the image key. None without cluster credentials."""
    if not cluster:
        return None
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    ca_key = serialization.load_pem_private_key(cluster["ca_key"].encode(), password=None)
    issuer = x509.load_pem_x509_certificate(cluster["ca_cert"].encode()).subject
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _cert(f"relocator node {node}", issuer, key.public_key(), ca_key, ca=False)
    return {"ca_cert": cluster["ca_cert"], "cert": cert,
            "key": _pem_key(key), "image_key": cluster["image_key"]}


def make_move() -> dict[str, Any]:
    """One move's transfer identity, made by the agent that listens (the stream's target, the
    post-copy's source): a CA for this move only, whose key signs one certificate for each end
    and is then dropped, so nothing can sign another. {id, listener, peer}: each a bundle
    {id, ca_cert, cert, key}; the peer's travels to the other agent with the move's offer.
    A listener trusts this move's CA only: a certificate of the cluster, or of an earlier move
    (a replayed credential), fails the handshake."""
    from cryptography.hazmat.primitives.asymmetric import ec

    ident = secrets.token_hex(8)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    cn = f"relocator move {ident} CA"
    ca_cert = _cert(cn, _name(cn), ca_key.public_key(), ca_key, ca=True)
    out: dict[str, Any] = {"id": ident}
    for end in ("listener", "peer"):
        key = ec.generate_private_key(ec.SECP256R1())
        out[end] = {"id": ident, "ca_cert": ca_cert, "key": _pem_key(key),
                    "cert": _cert(f"relocator move {ident} {end}", _name(cn), key.public_key(), ca_key, ca=False)}
    return out


def cert_sha256(pem: str) -> str:
    """The sha256 of a PEM certificate's DER form (what a TLS peer presents), stdlib only."""
    import hashlib

    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem)).hexdigest()


def for_nodes(cluster: dict[str, str], nodes: list[str]) -> dict[str, dict[str, str]]:
    """Every node's bundle, made where the CA key is (up, deploy): the CA key itself never goes
    to the controller or the agents."""
    return {name: for_node(cluster, name) for name in nodes}  # type: ignore[misc]


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def save_cluster(directory: str | Path, cluster: dict[str, str]) -> Path:
    """`up`: keep the cluster's credentials in its private directory (0700, the file 0600)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    _write_private(d / CLUSTER_FILE, json.dumps(cluster))
    return d / CLUSTER_FILE


def load_cluster(directory: str | Path) -> dict[str, str]:
    path = Path(directory) / CLUSTER_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CredentialsError(f"the cluster's credentials are missing or unreadable ({path}: {exc}); "
                               "`relocator down` and `relocator up` make new ones") from None


def install(bundle: dict[str, str], directory: str | Path, export: bool = True) -> Path:
    """An agent's side: write its bundle (for_node) into `directory` (0700; files 0600) and,
    with `export`, point RELOCATOR_CREDENTIALS there for this process and its children."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    for name, field in ((CA, "ca_cert"), (CERT, "cert"), (KEY, "key"), (IMAGE_KEY, "image_key")):
        _write_private(d / name, bundle[field])
    if export:
        os.environ[ENV_DIR] = str(d)
    return d


# -- a move's own credentials (make_move): on disk only while the move needs them ---------------
MOVE_NAME = re.compile(r"^[0-9a-f]{16}$")  # make_move's ids: what the sweep may remove


def moves_dir() -> Path:
    from relocator.paths import state_dir

    return state_dir() / "move-credentials"


def install_move(bundle: dict[str, str], base: Path | None = None) -> Path:
    """Write one end's move bundle to <state dir>/move-credentials/<id>/ (0700; files 0600),
    laid out as a node's (ca.pem, node.pem, node.key), so tls_files(that dir) serves CRIU and ssl."""
    ident = str(bundle.get("id", ""))
    if not MOVE_NAME.match(ident):
        raise CredentialsError(f"a move credential with a malformed id {ident!r}")
    root = base or moves_dir()
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    d = root / ident
    d.mkdir(mode=0o700, exist_ok=True)
    os.chmod(d, 0o700)
    for name, field in ((CA, "ca_cert"), (CERT, "cert"), (KEY, "key")):
        _write_private(d / name, bundle[field])
    return d


def remove_move(directory: str | Path | None) -> None:
    """Remove a move's credentials directory (its key is useless from then on anyway)."""
    if not directory:
        return
    d = Path(directory)
    if d.is_symlink() or not d.is_dir():
        return
    for p in d.iterdir():
        if p.is_file() and not p.is_symlink():
            p.unlink(missing_ok=True)
    try:
        d.rmdir()
    except OSError:
        pass


def move_context(bundle: dict[str, str], server: bool) -> ssl.SSLContext:
    """An ssl context holding one end's move bundle (the files live only while it loads)."""
    d = install_move(bundle)
    try:
        return _context(server, str(d))  # type: ignore[return-value]
    finally:
        remove_move(d)


# -- using them (agents, CRIU, keeper, pump, manifests) ----------------------------------------
def _dir() -> Path | None:
    raw = os.environ.get(ENV_DIR)
    return Path(raw) if raw else None


def image_key() -> bytes:
    """The cluster's image key (HMAC of manifests and stamps); CredentialsError without one."""
    d = _dir()
    if d is not None:
        try:
            key = (d / IMAGE_KEY).read_text().strip()
        except OSError as exc:
            raise CredentialsError(f"this node has no image key: {d / IMAGE_KEY} unreadable ({exc}); {FIX}") from None
        if key:
            return key.encode()
    key = os.environ.get(ENV_KEY, "")
    if key:
        return key.encode()
    raise CredentialsError(f"this node has no image key (neither {ENV_DIR} nor {ENV_KEY} is set): images cannot be "
                           f"signed or checked; {FIX}, or set {ENV_KEY}")


def machine_key_file() -> Path:
    return Path(os.environ.get(ENV_MACHINE_KEY, "/var/lib/relocator/machine-image.key"))


def use_machine_key() -> Path | None:
    """By-hand commands on one machine (`relocator snapshot ...`, `relocator bench snapshot`):
    without cluster credentials or RELOCATOR_IMAGE_KEY, images are signed and checked with this
    machine's own key (made 0600 on first use, root's), so an image made here by hand restores
    here and nowhere else. Agents never call it: a node without its cluster's key fails loudly.
    Returns the key file used, or None when the process already has a key."""
    if _dir() is not None or os.environ.get(ENV_KEY):
        return None
    path = machine_key_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:  # O_EXCL: two first uses at once agree on one key
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32))
    except FileExistsError:
        pass
    key = path.read_text().strip()
    if not key:
        raise CredentialsError(f"the machine's image key {path} is empty: remove it to make a new one")
    os.environ[ENV_KEY] = key
    return path


def insecure() -> bool:
    """The by-hand opt-out: RELOCATOR_INSECURE_TRANSFERS=1 and no credentials directory."""
    return os.environ.get(ENV_INSECURE) == "1" and _dir() is None


def bench_plaintext() -> bool:
    """The bench's switch (ENV_BENCH_PLAINTEXT): this agent's transfers without TLS. The agent's
    transfer address is checked against it at every transfer (check_bench_plaintext, from
    relocator.agent.modes.base.transfer_address); its children (keeper, pump, front) follow."""
    return os.environ.get(ENV_BENCH_PLAINTEXT) == "1"


def check_bench_plaintext(address: str) -> None:
    """CredentialsError when the bench's plaintext switch is set and `address` (this node's
    transfer address) is not in BENCH_NETS: it is for `relocator bench relocation` on one
    machine only, so on a real network every transfer, and PLAN's probe, fails instead."""
    raw = os.environ.get(ENV_BENCH_PLAINTEXT)
    if raw is None or raw == "":
        return
    if raw != "1":
        raise CredentialsError(f"{ENV_BENCH_PLAINTEXT}={raw!r}: only \"1\" (set by `relocator bench relocation "
                               "--plaintext-transfers`) or unset")
    import ipaddress

    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        ip = None
    if ip is None or not any(ip in ipaddress.ip_network(n) for n in BENCH_NETS):
        raise CredentialsError(f"{ENV_BENCH_PLAINTEXT}=1 is for `relocator bench relocation --plaintext-transfers` "
                               f"on loopback or emulated hosts only ({', '.join(BENCH_NETS)}), and this node's "
                               f"transfer address is {address}: unset it")


def tls_files(directory: str | Path | None = None) -> tuple[str, str, str] | None:
    """(CA, certificate, key) paths: of `directory` (a move's, install_move), else of the move
    RELOCATOR_MOVE_CREDENTIALS names (the keeper and pump of a move), else this node's; None
    only under the by-hand opt-out or the bench's plaintext switch (bench_plaintext);
    CredentialsError naming what is missing otherwise (never a silent plaintext transfer)."""
    if bench_plaintext():
        return None
    d = Path(directory) if directory else Path(os.environ[ENV_MOVE]) if os.environ.get(ENV_MOVE) else _dir()
    if d is None:
        if insecure():
            return None
        raise CredentialsError(f"this node has no transfer credentials ({ENV_DIR} is not set): transfers are "
                               f"TLS with the cluster's certificates; {FIX} (or, by hand only, {ENV_INSECURE}=1)")
    paths = [d / CA, d / CERT, d / KEY]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise CredentialsError(f"this node's transfer credentials are incomplete: missing {', '.join(missing)}; {FIX}")
    return str(paths[0]), str(paths[1]), str(paths[2])


def criu_tls_args(directory: str | Path | None = None) -> list[str]:
    """CRIU's TLS options for a page server, dump or lazy-pages daemon that talks to another
    node. CRIU (criu/tls.c) requires and verifies the peer's certificate against --tls-cacert on
    both sides; --tls-no-cn-verify because a peer is a member of the cluster (signed by its CA),
    not a host name (CRIU would match the server's own listen address against the client).
    `directory`: a move's own credentials (install_move) instead of the node's."""
    files = tls_files(directory)
    if files is None:
        return []
    ca, cert, key = files
    return ["--tls", "--tls-cacert", ca, "--tls-cert", cert, "--tls-key", key, "--tls-no-cn-verify"]


def _context(server: bool, directory: str | None = None) -> ssl.SSLContext | None:
    files = tls_files(directory)
    if files is None:
        return None
    ca, cert, key = files
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False  # a peer is whoever the cluster's CA signed (see criu_tls_args)
    ctx.verify_mode = ssl.CERT_REQUIRED  # on a server: a client without a cluster certificate fails
    ctx.load_verify_locations(ca)
    ctx.load_cert_chain(cert, key)
    if server:
        ctx.num_tickets = 0  # one session per connection: no TLS 1.3 tickets for a reader to trip on
    return ctx


def server_context() -> ssl.SSLContext | None:
    """TLS for a transfer listener (the pump): mutual, the cluster's CA; None: opted out."""
    return _context(server=True)


def client_context() -> ssl.SSLContext | None:
    """TLS for a connection to another node's transfer listener (the keeper); None: opted out."""
    return _context(server=False)


def describe(directory: str | Path | None = None) -> dict[str, Any]:
    """What a node has (no secrets): for preflight and errors."""
    d = Path(directory) if directory else _dir()
    if d is None:
        return {"dir": None, "files": []}
    return {"dir": str(d), "files": sorted(p.name for p in d.iterdir()) if d.is_dir() else []}
