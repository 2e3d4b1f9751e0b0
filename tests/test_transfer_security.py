"""Issue 26: nothing of a transfer crosses the network unauthenticated. The cluster's credentials
(relocator.credentials), CRIU's page server under TLS against clients without them, and (with
the session's cluster) a port scan of every transfer process during a stream and a post-copy
move. The pump's own refusal is in tests/test_postcopy_push.py."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import stat
import subprocess
import time
from pathlib import Path

import pytest

from relocator import credentials
from relocator.agent.postcopy import PSI, PS_IOV_GET
from tests.helpers import listening_ports

TLS_ALERT, TLS_HANDSHAKE = 0x15, 0x16


def _other_cluster(d: Path) -> Path:
    return credentials.install(credentials.for_node(credentials.make_cluster("other"), "x"), d, export=False)


def test_an_agent_keeps_its_credentials_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from relocator.agent.agent import NodeAgent

    monkeypatch.setenv(credentials.ENV_DIR, os.environ.get(credentials.ENV_DIR, ""))  # restored afterwards
    monkeypatch.setenv("RELOCATOR_STATE_DIR", str(tmp_path / "state"))
    bundle = credentials.for_nodes(credentials.make_cluster(), ["n1", "n2"])
    assert "ca_key" not in bundle["n1"]  # the CA's key stays where the cluster was made
    assert bundle["n1"]["cert"] != bundle["n2"]["cert"] and bundle["n1"]["image_key"] == bundle["n2"]["image_key"]
    NodeAgent("n1", str(tmp_path / "n1" / "state"), str(tmp_path / "n1" / "images"), bundle["n1"])
    d = tmp_path / "n1" / "credentials"
    assert os.environ[credentials.ENV_DIR] == str(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for name in (credentials.CA, credentials.CERT, credentials.KEY, credentials.IMAGE_KEY):
        assert stat.S_IMODE((d / name).stat().st_mode) == 0o600
    assert credentials.image_key() == bundle["n1"]["image_key"].encode()
    ca, cert, key = credentials.tls_files()
    assert subprocess.run(["openssl", "verify", "-CAfile", ca, cert], capture_output=True).returncode == 0


def test_a_node_without_credentials_gets_no_plaintext_transfer(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from relocator.snapshot import criu

    monkeypatch.delenv(credentials.ENV_DIR, raising=False)
    monkeypatch.delenv(credentials.ENV_INSECURE, raising=False)
    with pytest.raises(credentials.CredentialsError, match="no transfer credentials.*RELOCATOR_CREDENTIALS"):
        criu.page_server(tmp_path / "img", "127.0.0.1")
    monkeypatch.setenv(credentials.ENV_DIR, str(tmp_path / "half"))
    (tmp_path / "half").mkdir()
    with pytest.raises(credentials.CredentialsError, match="missing .*node.pem"):
        credentials.criu_tls_args()
    monkeypatch.delenv(credentials.ENV_DIR)
    monkeypatch.setenv(credentials.ENV_INSECURE, "1")  # the documented by-hand opt-out, nothing else
    assert credentials.criu_tls_args() == [] and credentials.server_context() is None


def test_the_bench_plaintext_switch_is_for_loopback_and_the_emulated_bridge(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench relocation --plaintext-transfers` (RELOCATOR_BENCH_PLAINTEXT_TRANSFERS=1): a node with
    credentials then transfers in plaintext, to measure what TLS costs; on a transfer address of
    a real network every transfer refuses it (the address itself is refused), and a value other
    than 1 is an error."""
    monkeypatch.setenv(credentials.ENV_DIR, str(credentials.install(
        credentials.for_node(credentials.make_cluster(), "n1"), tmp_path / "creds", export=False)))
    monkeypatch.delenv(credentials.ENV_BENCH_PLAINTEXT, raising=False)
    assert credentials.criu_tls_args(), "TLS unless the bench says otherwise"
    credentials.check_bench_plaintext("192.0.2.7")  # unset: nothing to refuse
    monkeypatch.setenv(credentials.ENV_BENCH_PLAINTEXT, "1")
    assert credentials.criu_tls_args() == [] and credentials.server_context() is None
    assert credentials.image_key(), "images stay signed: only the transfer's TLS is off"
    for ok in ("127.0.0.1", "10.250.0.12", "::1"):
        credentials.check_bench_plaintext(ok)
    for bad in ("192.0.2.7", "10.0.0.5", "not-an-ip"):
        with pytest.raises(credentials.CredentialsError, match="bench relocation --plaintext-transfers"):
            credentials.check_bench_plaintext(bad)
    from relocator.agent.modes.base import transfer_address

    monkeypatch.setenv("RELOCATOR_TRANSFER_ADDRESS", "192.0.2.7")
    with pytest.raises(credentials.CredentialsError, match="transfer address is 192.0.2.7"):
        transfer_address()
    monkeypatch.setenv("RELOCATOR_TRANSFER_ADDRESS", "10.250.0.12")
    assert transfer_address() == "10.250.0.12"
    monkeypatch.setenv(credentials.ENV_BENCH_PLAINTEXT, "yes")
    with pytest.raises(credentials.CredentialsError, match="only \"1\""):
        credentials.check_bench_plaintext("127.0.0.1")


def _probe(port: int, tls: ssl.SSLContext | None, page: tuple[int, int] = (1, 0x400000)) -> tuple[bytes, bool]:
    """Connect without this cluster's credentials and ask for a page (pagemap id, vaddr) as
    CRIU's lazy-pages daemon would: (what came back, whether the server closed the connection
    within 5 s)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    got, closed = b"", False
    try:
        if tls is not None:
            sock = tls.wrap_socket(sock)
        sock.sendall(PSI.pack(PS_IOV_GET, 1, page[1], page[0]))
        while True:
            b = sock.recv(65536)
            if not b:
                closed = True
                break
            got += b
    except (ssl.SSLError, ConnectionError):
        closed = True
    except TimeoutError:
        pass
    finally:
        sock.close()
    return got, closed


def _no_data(got: bytes, tls: bool) -> bool:
    """Nothing but TLS's own alerts (plaintext probe) or nothing at all (TLS probe)."""
    return got == b"" or (not tls and got[0] == TLS_ALERT and len(got) < 64)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("openssl"), reason="CRIU's page server runs as root")
@pytest.mark.parametrize("client", ["plain", "no-cert", "other-cluster"])
def test_page_server_drops_a_client_without_the_clusters_certificate(tmp_path: Path, client: str) -> None:
    from relocator.snapshot import criu

    tls = None
    if client != "plain":
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        tls.check_hostname, tls.verify_mode = False, ssl.CERT_NONE
        if client == "other-cluster":
            d = _other_cluster(tmp_path / "other")
            tls.load_cert_chain(str(d / credentials.CERT), str(d / credentials.KEY))
    proc, port = criu.page_server(tmp_path / "img", "127.0.0.1")
    try:
        got, closed = _probe(port, tls)
        assert closed and _no_data(got, tls is not None), (client, got[:64])
        assert proc.wait(10) != 0  # the page server gave up: no dump can feed it pages now
        assert not list((tmp_path / "img").glob("pages-*.img"))
    finally:
        proc.kill()


# -- the port scan during real moves (the session's loopback cluster) ------------------------------


def _a_lazy_page(pid: int) -> tuple[int, int]:
    """A page a lazy dump (`pid`) really serves: the first lazy run of its image (-D), so that a
    plaintext server would answer with the worker's memory; a default one for anything else."""
    from relocator.agent.postcopy import _lazy_ranges

    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    if "--lazy-pages" in argv and "-D" in argv:
        runs = _lazy_ranges(Path(argv[argv.index("-D") + 1]))
        if runs:
            return runs[0][0], runs[0][1]
    return 1, 0x400000


def _transfer_pids(base: str) -> set[int]:
    """The transfer processes of the cluster at `base` running now: CRIU page servers, lazy
    dumps and lazy-pages daemons, keepers, pumps, the lazy dump's TLS front, whose directories are under `base` or its
    tmpfs root (a stream target's image, relocator.agent.transient)."""
    from relocator.agent.transient import transient_root
    from relocator.procs import process_table

    roots = (str(Path(base).resolve()), str(transient_root(base)))
    out = set()
    for pid, (_, argv) in process_table().items():
        if not argv or not any(r in a for a in argv for r in roots):
            continue
        criu = argv[0].endswith("criu") and ("page-server" in argv[1:2] or "lazy-pages" in argv[1:2]
                                             or ("dump" in argv[1:2] and "--lazy-pages" in argv))
        if criu or any(m in argv for m in ("relocator.agent.postcopy", "relocator.agent.pump", "relocator.agent.front")):
            out.add(int(pid))
    return out


@pytest.fixture(scope="module")
def scan_worker(relocator_cluster):
    w = relocator_cluster.launch("tiny-llama", gpus=1)
    yield w["id"]
    relocator_cluster.stop_worker(w["id"])


def _probe_a_target_page_server(node: str, base: str) -> dict[int, tuple[bytes, bool]]:
    """The page server a stream move's DUMP opens on its target (the agent's open_page_server),
    probed before any source connects, then removed."""
    import ray

    from relocator.agent import NAMESPACE, agent_name

    agent = ray.get_actor(agent_name(node), namespace=NAMESPACE)
    image_dir = str(Path(base) / "nodes" / node / "images" / "port-scan-probe")
    ps = ray.get(agent.open_page_server.remote(image_dir), timeout=60)
    try:
        return {ps["port"]: _probe(ps["port"], None)}
    finally:
        ray.get(agent.remove_image.remote(image_dir), timeout=60)


@pytest.mark.integration
@pytest.mark.parametrize("transfer", ["stream", "postcopy"])
def test_port_scan_during_a_move_finds_no_transfer_port_that_serves(relocator_cluster, scan_worker,
                                                                    transfer: str) -> None:
    """During a move, a client with no credentials connects to every TCP port the move's
    transfer processes listen on (page server, lazy dump, pump: found from their pids) and asks
    for a page as the lazy-pages daemon would: none answers with a byte of data. CRIU's page
    servers sit behind a TLS front (relocator.agent.front) that refuses such a probe and keeps
    the port for the move's own peer, so the probe does not end the move (its outcome is still
    allowed to be a rollback: a move can roll back for reasons of its own). On the session's
    loopback cluster; the emulated hosts' scan is the next test."""
    import threading

    ctl, wid = relocator_cluster, scan_worker
    base = ctl.info["base_dir"]
    st = ctl.status()
    src = next(w["node"] for w in st["workers"] if w["id"] == wid)
    dst = next(n["id"] for n in st["nodes"] if n["id"] != src and n["alive"] and n["gpus_free"] >= 1)
    seen: dict[int, tuple[bytes, bool]] = {}
    stop = threading.Event()

    def scan() -> None:
        while not stop.is_set():
            for port, pid in listening_ports(_transfer_pids(base)).items():
                if port not in seen:
                    try:
                        page = _a_lazy_page(pid)
                    except OSError:
                        page = (1, 0x400000)
                    seen[port] = _probe(port, None, page)
            time.sleep(0.02)

    t = threading.Thread(target=scan, daemon=True)
    t.start()
    try:
        if transfer == "stream":
            # a stream target's page server listens only until the source connects, which can
            # be sooner than a scan comes round: one opened as DUMP opens it, probed for sure
            seen.update(_probe_a_target_page_server(dst, base))
        rel = ctl.relocate(wid, dst, transfer=transfer)
    finally:
        stop.set()
        t.join(30)
    print(f"{transfer}: probed {sorted(seen)} -> {[(len(g), c) for g, c in seen.values()]}; move {rel['result']}")
    assert seen, "no transfer port was seen listening during the move"
    for port, (got, _closed) in seen.items():
        assert _no_data(got, tls=False), (port, got[:64])
    assert rel["result"] in ("done", "rolled_back"), rel
    assert next(w for w in ctl.status()["workers"] if w["id"] == wid)["state"] == "running"
