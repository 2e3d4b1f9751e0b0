"""Emulated hosts on one machine: each a raylet in its own network and mount namespaces.

Host i (1-based) is a network namespace `rlemu-h<i>` joined to a bridge the project creates
(`rlemu0`, 10.250.0.1/24 by default) with its own address (10.250.0.<10+i>), and a private mount
namespace in which /var/lib/relocator, /run/relocator and /tmp are that host's own directories
(under `base_dir/hosts/h<i>/`) and the hostname is `h<i>`. Its raylet is started with plain
`ray start` (the head on h1), exactly as an operator would on a real machine, with the
`relocator` resource that `relocator deploy` selects nodes by.

Networking is "routed cell subnets" (docs/deploy.md): host i declares the cell subnet
10.252.<16*i>.0/20 (`RELOCATOR_NET_POOL` in its raylet's environment, so its agent allocates
cell addresses only from it) and every host, and the machine itself, routes that subnet to
host i's bridge address. Cells get a route back to the bridge subnet
(`RELOCATOR_CELL_ROUTES`), so a router on any host reaches a worker on any other.

Nothing here listens outside the project's own namespaces: Ray's listeners bind inside the host
namespaces, whose only interfaces are loopback and the bridge port.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from relocator import procs, waits
from relocator.cluster.config import REPO

BRIDGE = "rlemu0"
NETNS_PREFIX = "rlemu-h"
#: paths each emulated host has to itself (bound from base_dir/hosts/h<i>/<key>)
PRIVATE = {"var-lib": "/var/lib/relocator", "run": "/run/relocator", "tmp": "/tmp"}
#: what a process attaching to the emulated cluster needs too: Ray turns token authentication on
#: by itself when it finds ~/.ray/auth_token (written by any `ray.init()` on this machine) on the
#: head, but not on the nodes joining it; the hosts are reachable only from this machine's
#: project namespaces, so authentication stays off, explicitly
RAY_CLIENT_ENV = {"RAY_AUTH_MODE": "disabled"}
GCS_PORT = 6379
MTU = 9000
CLIENT_PORT = 10001


class EmulationError(RuntimeError):
    pass


@dataclass
class EmulatedHost:
    index: int
    name: str
    netns: str
    ip: str
    cell_pool: str
    dir: str
    veth: str

    def private(self, key: str) -> Path:
        """Where this host's private `PRIVATE[key]` lives on the machine."""
        return Path(self.dir) / key


@dataclass
class EmulatedCluster:
    base_dir: str
    bridge: str
    bridge_ip: str
    subnet: str
    hosts: list[EmulatedHost] = field(default_factory=list)

    @property
    def head(self) -> EmulatedHost:
        return self.hosts[0]

    @property
    def gcs_address(self) -> str:
        return f"{self.head.ip}:{GCS_PORT}"

    @property
    def client_address(self) -> str:
        """Ray Client address: how a process outside every host (a CLI, a test) attaches."""
        return f"ray://{self.head.ip}:{CLIENT_PORT}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gcs_address": self.gcs_address, "client_address": self.client_address}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EmulatedCluster":
        return cls(base_dir=d["base_dir"], bridge=d["bridge"], bridge_ip=d["bridge_ip"], subnet=d["subnet"],
                   hosts=[EmulatedHost(**h) for h in d["hosts"]])


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise EmulationError(f"{' '.join(args)} failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _link_exists(name: str) -> bool:
    return _run("ip", "link", "show", name, check=False).returncode == 0


def plan(n: int, base_dir: str | Path, subnet: str = "10.250.0.0/24",
         cell_pools: str = "10.252.0.0/16") -> EmulatedCluster:
    """Names and addresses of `n` hosts (nothing is created)."""
    if not 1 <= n <= 15:
        raise EmulationError(f"--emulate-hosts must be between 1 and 15, not {n}")
    net = ipaddress.ip_network(subnet)
    pools = list(ipaddress.ip_network(cell_pools).subnets(new_prefix=20))
    cluster = EmulatedCluster(base_dir=str(base_dir), bridge=BRIDGE, bridge_ip=str(net.network_address + 1),
                              subnet=str(net))
    for i in range(1, n + 1):
        cluster.hosts.append(EmulatedHost(
            index=i, name=f"h{i}", netns=f"{NETNS_PREFIX}{i}", ip=str(net.network_address + 10 + i),
            cell_pool=str(pools[i]), dir=str(Path(base_dir) / "hosts" / f"h{i}"), veth=f"rlemub{i}"))
    return cluster


def _existing_host_netns(prefix: str) -> list[str]:
    run = Path("/run/netns")
    return sorted(p.name for p in run.glob(f"{prefix}*")) if run.is_dir() else []


def reclaim_stale(cluster: EmulatedCluster, prefix: str = NETNS_PREFIX) -> bool:
    """Remove emulated hosts' network left by a run that was killed (no process lives in any
    of their namespaces), so that `up` after a crash does not need a `relocator down` that has
    no cluster directory left to read; True if something was removed. Hosts that still run a
    process are refused: another cluster is using them."""
    from relocator.cell import netns

    names = _existing_host_netns(prefix)
    if not names and not _link_exists(cluster.bridge):
        return False
    busy = {n: len(netns.pids(n)) for n in names}
    if any(busy.values()):
        running = ", ".join(f"{n}: {k} process{'es' if k > 1 else ''}" for n, k in busy.items() if k)
        raise EmulationError(f"emulated hosts already exist and are running ({running}); `relocator down` first")
    # a namespace takes its veth pair with it, the bridge its routes
    for name in names:
        _run("ip", "netns", "del", name, check=False)
    _run("ip", "link", "del", cluster.bridge, check=False)
    print(f"removed stale emulated hosts left by an earlier run ({', '.join(names) or cluster.bridge})",
          file=sys.stderr)
    return True


def create_network(cluster: EmulatedCluster) -> None:
    """The bridge, one namespace per host with its address, forwarding and the cell routes."""
    reclaim_stale(cluster)
    prefix = ipaddress.ip_network(cluster.subnet).prefixlen
    _run("ip", "link", "add", cluster.bridge, "type", "bridge")
    _run("ip", "addr", "add", f"{cluster.bridge_ip}/{prefix}", "dev", cluster.bridge)
    _run("ip", "link", "set", cluster.bridge, "mtu", str(MTU))
    _run("ip", "link", "set", cluster.bridge, "up")
    for h in cluster.hosts:
        _run("ip", "netns", "add", h.netns)
        _run("ip", "link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.netns)
        # jumbo frames, as on a GPU cluster's network (a 1500-byte MTU costs the page stream
        # between hosts six times the packets of a 9000-byte one)
        _run("ip", "link", "set", h.veth, "mtu", str(MTU))
        _run("ip", "-n", h.netns, "link", "set", "eth0", "mtu", str(MTU))
        _run("ip", "link", "set", h.veth, "master", cluster.bridge)
        _run("ip", "link", "set", h.veth, "up")
        _run("ip", "-n", h.netns, "addr", "add", f"{h.ip}/{prefix}", "dev", "eth0")
        _run("ip", "-n", h.netns, "link", "set", "eth0", "up")
        _run("ip", "-n", h.netns, "link", "set", "lo", "up")
        # a host forwards between the bridge and its cells' veths
        _run("ip", "netns", "exec", h.netns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    for h in cluster.hosts:  # every host's cell subnet is routed to it, from everywhere
        _run("ip", "route", "add", h.cell_pool, "via", h.ip, "dev", cluster.bridge)
        for other in cluster.hosts:
            if other is not h:
                _run("ip", "-n", other.netns, "route", "add", h.cell_pool, "via", h.ip, "dev", "eth0")


def delete_network(cluster: EmulatedCluster) -> None:
    for h in cluster.hosts:
        _run("ip", "route", "del", h.cell_pool, check=False)
        _run("ip", "netns", "del", h.netns, check=False)  # its veth pair goes with it
        _run("ip", "link", "del", h.veth, check=False)
    _run("ip", "link", "del", cluster.bridge, check=False)


#: the RELOCATOR_* variables a host's raylet is given from this process (the rest are its own)
PASSED_THROUGH = ("RELOCATOR_BENCH_PLAINTEXT_TRANSFERS", "RELOCATOR_KV_POOL_MB", "RELOCATOR_MAX_MODEL_LEN")


def host_env(cluster: EmulatedCluster, h: EmulatedHost, health_check_period_ms: int = 1000,
             health_check_failure_threshold: int = 3) -> dict[str, str]:
    """The environment a host's raylet (and so its agent and workers) starts with."""
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RELOCATOR_"))},
        "PYTHONPATH": str(REPO),
        # a real multi-host cluster: Ray's default, which the one-machine local cluster turns off
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_DEDUP_LOGS": "0",
        **RAY_CLIENT_ENV,
        # the head's Ray Client server starts one process per client and gives it 30 s to
        # answer: not enough on a busy 2-core CI machine (seen: deploy failed to connect)
        "RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S": "120",
        # how fast a lost host is declared dead (as on the local cluster)
        "RAY_health_check_period_ms": str(health_check_period_ms),
        "RAY_health_check_timeout_ms": str(max(health_check_period_ms, 1000)),
        "RAY_health_check_failure_threshold": str(health_check_failure_threshold),
        # this host's cell subnet, routed to it (docs/deploy.md "Networking")
        "RELOCATOR_NET_POOL": h.cell_pool,
        "RELOCATOR_CELL_ROUTES": cluster.subnet,
        # bench settings the hosts' agents read: `--plaintext-transfers` (refused off the bridge)
        # and `--kv-pool-mb` (the vLLM adapter writes the pool where the worker is launched), and
        # `--prompt-tokens`' context length (relocator.worker.default_spec)
        **{k: os.environ[k] for k in PASSED_THROUGH if k in os.environ},
    }


def _kept_visible() -> list[Path]:
    """What a host's processes run from and must still see when its private directories cover
    the machine's: the repository, the virtual environment and the model cache. A checkout under
    /tmp (a CI runner's) would otherwise vanish under the host's own /tmp."""
    from relocator.tinymodel import cache_root

    paths = sorted({Path(p).resolve() for p in (REPO, sys.prefix, cache_root())})
    return [p for i, p in enumerate(paths) if not any(p.is_relative_to(q) for q in paths[:i])]


def in_host(h: EmulatedHost, argv: list[str]) -> list[str]:
    """`argv` run inside host `h`: its network namespace, a private mount namespace with its own
    /var/lib/relocator, /run/relocator and /tmp, and its own hostname. A kept path (the repo,
    the venv, the model cache) under one of those is bound into the host's own directory first,
    at the same place, so it stays where it was."""
    steps = []
    # the private directory that covers the host's own directory (a cluster under
    # /var/lib/relocator: the default) goes last, or it would hide the sources of the others
    order = sorted(PRIVATE.items(), key=lambda kv: Path(h.dir).resolve().is_relative_to(kv[1]))
    for key, target in order:
        for p in _kept_visible():
            if p.is_relative_to(target):
                inner = f'"$0/{key}/{p.relative_to(target)}"'
                steps.append(f"mkdir -p {inner} && mount --bind '{p}' {inner}")
        steps.append(f'mount --rbind "$0/{key}" {target}')  # --rbind: with the kept paths in it
    script = f'{" && ".join(steps)} && hostname "$1" && shift 2 && exec "$@"'
    return ["ip", "netns", "exec", h.netns, "unshare", "--mount", "--uts", "--propagation", "private",
            "sh", "-c", script, h.dir, h.name, h.name, *argv]


def prepare_dirs(h: EmulatedHost) -> None:
    for key, target in PRIVATE.items():
        h.private(key).mkdir(parents=True, exist_ok=True)
        Path(target).mkdir(parents=True, exist_ok=True)  # the mount point on the machine
    h.private("tmp").chmod(0o1777)


def ray_start(cluster: EmulatedCluster, h: EmulatedHost, *, gpus: int, cpus: int, object_store_mb: int,
              env: dict[str, str], timeout: float = 120.0) -> None:
    """Plain `ray start` inside host `h` (the head on the first host)."""
    ray_bin = str(Path(sys.executable).with_name("ray"))
    args = [ray_bin, "start", "--node-ip-address", h.ip, "--num-gpus", str(gpus), "--num-cpus", str(cpus),
            "--resources", '{"relocator": 1}', "--object-store-memory", str(object_store_mb << 20),
            "--disable-usage-stats"]
    if h is cluster.head:
        args += ["--head", "--port", str(GCS_PORT), "--ray-client-server-port", str(CLIENT_PORT),
                 "--include-dashboard", "false"]
    else:
        args += ["--address", cluster.gcs_address]
    log = open(Path(h.dir) / "ray-start.log", "ab")
    proc = subprocess.run(in_host(h, args), env=env, cwd=REPO, stdin=subprocess.DEVNULL,
                          stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        tail = (Path(h.dir) / "ray-start.log").read_text(errors="replace")[-2000:]
        raise EmulationError(f"ray start on {h.name} failed (exit {proc.returncode}):\n{tail}")


def host_pids(h: EmulatedHost) -> list[int]:
    """Every process in host `h`'s network namespace (its raylet, Ray workers, agent, router)."""
    from relocator.cell import netns

    return netns.pids(h.netns)


def host_cells(h: EmulatedHost) -> list[Any]:
    """Cells recorded on host `h` (their records live in its private /var/lib/relocator)."""
    from relocator.cell.cell import list_cells, using_state_dir

    out = []
    for state in sorted(h.private("var-lib").glob("**/nodes/*/state")):
        with using_state_dir(state):
            out.extend(list_cells())
    return out


def _kill_cells(h: EmulatedHost, remove_netns: bool = False) -> list[str]:
    """SIGKILL every cell recorded on host `h` (PID 1 of a cell: its whole tree goes); with
    `remove_netns`, remove their network namespaces too (their veths' host ends live in the
    host's namespace and go with it)."""
    ids = []
    for c in host_cells(h):
        if c.is_alive():
            try:
                os.kill(c.init_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if remove_netns:
            _run("ip", "netns", "del", c.netns, check=False)
        ids.append(c.id)
    return ids


def kill_host(h: EmulatedHost, cells: bool = True) -> dict[str, Any]:
    """A host dies: every process of its namespace and (`cells`) every cell it runs, SIGKILLed."""
    killed = []
    for pid in host_pids(h):
        comm = procs.name(pid)
        if not comm:
            continue  # gone already
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(f"{pid} {comm}")
        except (ProcessLookupError, OSError):
            pass
    return {"host": h.name, "pids": killed, "cells": _kill_cells(h) if cells else []}


def _remove_cells(h: EmulatedHost) -> list[str]:
    """What is left of host `h`'s cells, with their network namespaces, and namespaces of its
    registry (private /run/relocator/net) that never got a cell record."""
    removed = _kill_cells(h, remove_netns=True)
    net = h.private("run") / "net"
    for rec in sorted([*net.glob("*.json"), *net.glob("*.pending")]):  # pending: killed mid-create
        _run("ip", "netns", "del", rec.stem, check=False)
    return removed


def start(n: int, base_dir: str | Path, *, gpus: int = 4, cpus: int = 1, object_store_mb: int = 256,
          subnet: str = "10.250.0.0/24", health_check_period_ms: int = 1000,
          health_check_failure_threshold: int = 3) -> EmulatedCluster:
    """Create `n` emulated hosts and start a raylet on each; returns their description."""
    if os.geteuid() != 0:
        raise EmulationError("emulated hosts need root (network and mount namespaces)")
    cluster = plan(n, base_dir, subnet)
    create_network(cluster)
    try:
        for h in cluster.hosts:
            if Path(h.dir).exists():
                shutil.rmtree(h.dir)
            prepare_dirs(h)
        for h in cluster.hosts:
            ray_start(cluster, h, gpus=gpus, cpus=cpus, object_store_mb=object_store_mb,
                      env=host_env(cluster, h, health_check_period_ms, health_check_failure_threshold))
        return cluster
    except BaseException:
        stop(cluster)
        raise


def stop(cluster: EmulatedCluster, timeout: float = 5.0) -> dict[str, Any]:
    """Stop every host: SIGTERM to its processes, then SIGKILL (Ray's GCS ignores SIGTERM for a
    long while; a host's state is thrown away anyway); its cells; the network."""
    out: dict[str, Any] = {"hosts": {}}
    for h in cluster.hosts:
        for pid in host_pids(h):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    waits.gone(lambda: any(host_pids(h) for h in cluster.hosts), timeout, every=0.2)
    for h in cluster.hosts:
        out["hosts"][h.name] = {"forced": kill_host(h, cells=False)["pids"], "cells_removed": _remove_cells(h)}
    delete_network(cluster)
    return out
