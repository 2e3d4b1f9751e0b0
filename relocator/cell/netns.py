"""Network namespaces with a veth link to the host, one per cell (or per emulated node).

A cell's network namespace would otherwise only have loopback; the veth pair gives the host
(the router) a route to the worker. Addresses come from a private /30 block per namespace,
inside namespaces this project creates and removes itself.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import subprocess
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

from relocator.paths import net_dir

POOL = ipaddress.ip_network(os.environ.get("RELOCATOR_NET_POOL", "10.251.0.0/16"))
MAX_BLOCKS = POOL.num_addresses // 4


class NetnsError(RuntimeError):
    pass


@dataclass(frozen=True)
class NetLink:
    """A network namespace and the veth pair joining it to the host."""

    name: str
    block: int
    host_ip: str
    cell_ip: str
    host_if: str

    @property
    def path(self) -> str:
        return f"/run/netns/{self.name}"


def _run(*args: str) -> None:
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        raise NetnsError(f"{' '.join(args)} failed: {proc.stderr.strip() or proc.stdout.strip()}")


def cell_routes() -> list[str]:
    """Extra routes a cell gets through its host (RELOCATOR_CELL_ROUTES, comma-separated CIDRs or
    `default`): on a multi-host deployment with routed cell subnets, the networks the router and
    other hosts are on (docs/deploy.md "Networking"). None by default: only the host reaches it."""
    return [c.strip() for c in os.environ.get("RELOCATOR_CELL_ROUTES", "").split(",") if c.strip()]


def _registry() -> Path:
    return net_dir()


@contextmanager
def _locked() -> Iterator[Path]:
    reg = _registry()
    reg.mkdir(parents=True, exist_ok=True)
    with open(reg / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield reg


def _addresses(block: int) -> tuple[str, str]:
    base = POOL.network_address + block * 4
    return str(base + 1), str(base + 2)


def create(name: str) -> NetLink:
    """Create namespace `name` with a veth pair and a fresh /30 block; idempotent per name."""
    with _locked() as reg:
        record = reg / f"{name}.json"
        if record.exists() and Path(f"/run/netns/{name}").exists():
            return NetLink(**json.loads(record.read_text()))
        used = {json.loads(p.read_text())["block"] for p in reg.glob("*.json")}
        # round robin, not lowest free: a block just released (a killed cell) is not handed out
        # again at once, so stale connections to the old address never reach a new cell
        try:
            last = int((reg / ".last").read_text())
        except (OSError, ValueError):
            last = 0
        order = [*range(last + 1, MAX_BLOCKS), *range(1, last + 1)]
        block = next((b for b in order if b not in used), None)
        if block is None:
            raise NetnsError(f"address pool {POOL} exhausted")
        host_ip, cell_ip = _addresses(block)
        host_if, peer_if = f"rlh{block}", f"rlc{block}"
        link = NetLink(name=name, block=block, host_ip=host_ip, cell_ip=cell_ip, host_if=host_if)
        # named before it exists: a process (or an emulated host) killed midway leaves this for
        # whoever cleans up after it (relocator.cluster.emulate._remove_cells), not a stray netns
        pending = reg / f"{name}.pending"
        pending.write_text(host_if)
        try:
            _run("ip", "netns", "add", name)
            _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", peer_if)
            _run("ip", "link", "set", peer_if, "netns", name)
            _run("ip", "addr", "add", f"{host_ip}/30", "dev", host_if)
            _run("ip", "link", "set", host_if, "up")
            _run("ip", "-n", name, "addr", "add", f"{cell_ip}/30", "dev", peer_if)
            _run("ip", "-n", name, "link", "set", peer_if, "up")
            _run("ip", "-n", name, "link", "set", "lo", "up")
            for cidr in cell_routes():  # routed cell subnets: replies reach other hosts
                _run("ip", "-n", name, "route", "add", cidr, "via", host_ip)
        except NetnsError:
            _teardown(name, host_if)
            pending.unlink(missing_ok=True)
            raise
        record.write_text(json.dumps(asdict(link)))
        pending.unlink(missing_ok=True)
        (reg / ".last").write_text(str(block))
        return link


def _teardown(name: str, host_if: str) -> None:
    subprocess.run(["ip", "link", "del", host_if], capture_output=True)
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


def delete(name: str) -> None:
    """Remove the namespace, its veth pair and its address block (no error if absent)."""
    with _locked() as reg:
        record = reg / f"{name}.json"
        host_if = json.loads(record.read_text())["host_if"] if record.exists() else ""
        _teardown(name, host_if)
        record.unlink(missing_ok=True)


def pids(name: str) -> list[int]:
    """Host PIDs of the processes inside namespace `name` (none if it does not exist)."""
    try:
        out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [int(p) for p in out.split() if p.isdigit()]


def list_links() -> list[NetLink]:
    reg = _registry()
    if not reg.exists():
        return []
    return [NetLink(**json.loads(p.read_text())) for p in sorted(reg.glob("*.json"))]
