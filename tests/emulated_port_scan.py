"""The port scan from another emulated host (issue 26), run as its own process by
tests/test_transfer_security.py (the test session may be attached to another Ray cluster):

    python tests/emulated_port_scan.py CLUSTER_DIR   # prints one JSON object

On a cluster from `relocator up --emulate-hosts 3`: a worker on h2 moved to the other of h2
and h3 (`stream`), then again (`postcopy`), while a scanner finds every TCP port that the move's transfer processes
(CRIU page servers and lazy dumps, pumps, keepers) listen on in h2's and h3's network
namespaces and probes each from h1's (a client with no credentials, in a namespace of its own)
as CRIU's lazy-pages daemon would ask for a page. Before each stream move a target page server
opened as DUMP opens it is probed too (it listens only until the source connects).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODEL = "tiny-llama"

# what runs in h1's namespace: connect, ask for a page, report what came back
PROBE = """
import json, socket, sys
from relocator.agent.postcopy.base import PSI, PS_IOV_GET
host, port, vpid, vaddr = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
got, closed = b"", False
try:
    s = socket.create_connection((host, port), timeout=5)
    s.sendall(PSI.pack(PS_IOV_GET, 1, vaddr, vpid))
    while True:
        b = s.recv(65536)
        if not b:
            closed = True
            break
        got += b
except (ConnectionError, OSError) as e:
    closed = not isinstance(e, TimeoutError)
print(json.dumps({"n": len(got), "closed": closed, "head": got[:16].hex()}))
"""


def _probe(h1, host: str, port: int, page: tuple[int, int]) -> dict:
    from relocator.cluster.emulate import in_host

    argv = in_host(h1, [sys.executable, "-S", "-c", PROBE, host, str(port), str(page[0]), str(page[1])])
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=REPO,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    try:
        return {"host": host, "port": port, **json.loads(out.stdout.strip().splitlines()[-1])}
    except (ValueError, IndexError):
        return {"host": host, "port": port, "error": (out.stdout + out.stderr)[-300:]}


def _transfer_ports(h) -> dict[int, int]:
    """{TCP port: pid} of the transfer processes of host `h` listening now."""
    from relocator.cluster.emulate import host_pids
    from tests.helpers import listening_ports
    from relocator.procs import cmdline

    pids = set()
    for pid in host_pids(h):
        argv = cmdline(pid)
        criu = bool(argv) and argv[0].endswith("criu") and (argv[1:2] == ["page-server"]
                                                           or (argv[1:2] == ["dump"] and "--lazy-pages" in argv))
        if criu or any(m in argv for m in ("relocator.agent.pump", "relocator.agent.postcopy", "relocator.agent.front")):
            pids.add(pid)
    return listening_ports(pids, h.netns)


def _a_lazy_page(pid: int) -> tuple[int, int]:
    """A page the lazy dump `pid` really serves (its image seen through its own root)."""
    from relocator.agent.postcopy.base import lazy_ranges
    from relocator.procs import cmdline

    argv = cmdline(pid)
    if "--lazy-pages" in argv and "-D" in argv:
        runs = lazy_ranges(Path(f"/proc/{pid}/root{argv[argv.index('-D') + 1]}"))
        if runs:
            return runs[0][0], runs[0][1]
    return 1, 0x400000


class Scanner(threading.Thread):
    def __init__(self, h1, targets) -> None:
        super().__init__(daemon=True)
        self.h1, self.targets = h1, targets
        self.seen: dict[str, dict] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for h in self.targets:
                for port, pid in _transfer_ports(h).items():
                    key = f"{h.name}:{port}"
                    if key not in self.seen:
                        try:
                            page = _a_lazy_page(pid)
                        except OSError:
                            page = (1, 0x400000)
                        self.seen[key] = {"pid": pid, **_probe(self.h1, h.ip, port, page)}
            time.sleep(0.02)


def _ensure_deployed(address: str) -> None:
    import relocator
    from relocator.deploy import DeployConfig, deploy

    try:
        relocator.connect(address=address).status()
    except Exception:  # noqa: BLE001 - a previous test undeployed it: deploy again as `up` does
        deploy(address, DeployConfig(nodes={"fake_gpus": True}, controller={"node": "h1"}, insecure=True))


def _probe_a_target_page_server(h1, h) -> dict:
    """A page server as a stream's DUMP opens it on host `h`, probed before any source connects."""
    import ray

    from relocator.agent import NAMESPACE, agent_name

    agent = ray.get_actor(agent_name(h.name), namespace=NAMESPACE)
    images = ray.get(agent.transfer_info.remote(), timeout=60)["images_dir"]  # as the host sees it
    image_dir = f"{images}/port-scan-probe-{int(time.time())}"
    ps = ray.get(agent.open_page_server.remote(image_dir), timeout=60)
    try:
        return _probe(h1, ps["address"], ps["port"], (1, 0x400000))
    finally:
        ray.get(agent.remove_image.remote(image_dir), timeout=60)


def main(base: str) -> dict:
    import relocator
    from relocator.cluster.emulate import EmulatedCluster
    from relocator.cluster.info import read_info

    info = read_info(base)
    cluster = EmulatedCluster.from_dict(info["emulated"])
    h1, h2, h3 = cluster.hosts[:3]
    _ensure_deployed(info["address"])
    ctl = relocator.connect(address=info["address"])
    w = ctl.launch(MODEL, 1, "h2")
    out: dict = {"moves": []}
    try:
        for transfer in ("stream", "postcopy"):
            now = next(x for x in ctl.status()["workers"] if x["id"] == w["id"])["node"]
            to = h3 if now == "h2" else h2  # the other one (a rolled-back stream left it on h2)
            scan = Scanner(h1, [h2, h3])
            scan.start()
            opened = _probe_a_target_page_server(h1, to) if transfer == "stream" else None
            try:
                rel = ctl.relocate(w["id"], to.name, transfer=transfer)
            finally:
                scan.stop.set()
                scan.join(60)
            state = next(x for x in ctl.status()["workers"] if x["id"] == w["id"])
            out["moves"].append({"transfer": transfer, "to": to.name, "result": rel["result"],
                                 "error": rel.get("error"), "opened_page_server": opened, "probes": scan.seen,
                                 "worker": {k: state[k] for k in ("node", "state")}})
    finally:
        ctl.stop_worker(w["id"])
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1]), default=str))
