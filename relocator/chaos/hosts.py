"""Where the chaos runner finds a node's files and processes: one machine, or emulated hosts.

On the local cluster every node's directories are under one base dir on this machine. On
emulated hosts (`relocator up --emulate-hosts N`, relocator/cluster/emulate.py) each host has
its own /var/lib/relocator, /run/relocator and /tmp, bound from DIR/emulated/hosts/h<i>/: a path
an agent reports (host-internal) is read here through that host's directory, leaks are
collected host by host, and a node is lost by killing its whole host. The hosts share this
machine's PID namespace, so process tables and pids need no translation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from relocator.chaos import leaks as L

#: faults that do not apply on emulated hosts, and why (reported, never dropped silently)
EMULATED_SKIPS: dict[str, str] = {
    "restart-router": "a deployment's router is owned by a Ray actor on the controller's host, not by the "
                      "local cluster daemon that holds the listening socket and restarts it at once: the "
                      "fault's mechanism and expectation (no request fails) are the local daemon's",
    "postcopy-kill-target": "post-copy between emulated hosts is not exercised by deploy yet (issue 17 "
                            "report); not run here",
    "postcopy-network-cut": "drops the page-server connection in this machine's INPUT chain, which "
                            "traffic between emulated hosts (bridged namespaces) never crosses",
    "postcopy-source-loss": "post-copy between emulated hosts is not exercised by deploy yet (issue 17 "
                            "report); not run here",
    "fail-make-room-move": "fragments the cluster with `relocator_node:` placement groups, a resource "
                           "deployed nodes do not carry",
}


class LocalView:
    """The one-machine local cluster: every path is readable as is."""

    emulated = False
    skips: dict[str, str] = {}

    def __init__(self, base: Path) -> None:
        self.base = Path(base)
        self.protected: set[str] = set()  # nodes a destructive fault must spare (besides the first)

    def path(self, node: str, p: str | Path) -> Path:
        return Path(p)

    def state_dir(self, node: str) -> Path:
        return self.base / "nodes" / node / "state"

    def collect(self, netns_names: set[str] | None = None) -> dict[str, set[str]]:
        return L.collect(self.base, netns_names=netns_names)

    def kill_node(self, node: str, netns: Iterable[str] = ()) -> dict[str, Any] | None:
        """None: the runner stops the node's raylet itself."""
        return None


class EmulatedView(LocalView):
    """Emulated hosts: host-internal paths mapped to DIR/emulated/hosts/h<i>/..."""

    emulated = True
    skips = EMULATED_SKIPS

    def __init__(self, info: dict[str, Any], dep_base: str, controller_host: str | None) -> None:
        from relocator.cluster.emulate import EmulatedCluster

        self.cluster = EmulatedCluster.from_dict(info["emulated"])
        self.base = Path(dep_base)  # host-internal: the same path on every host
        self.hosts = {h.name: h for h in self.cluster.hosts}
        self.dead: set[str] = set()
        self._dead_netns: set[str] = set()
        # the head (GCS, Ray Client) and the controller's host (controller, router) are spared
        self.protected = {self.cluster.head.name} | ({controller_host} if controller_host else set())

    def path(self, node: str, p: str | Path) -> Path:
        from relocator.cluster.emulate import PRIVATE

        p = Path(p)
        for key, target in PRIVATE.items():
            if p == Path(target) or Path(target) in p.parents:
                return self.hosts[node].private(key) / p.relative_to(target)
        return p  # not private to the host (the repository, the model)

    def state_dir(self, node: str) -> Path:
        return self.path(node, self.base / "nodes" / node / "state")

    def roots(self) -> list[Path]:
        """The deployment's base dir of each live host, as seen from here."""
        return [self.path(n, self.base) for n in sorted(self.hosts) if n not in self.dead]

    def collect(self, netns_names: set[str] | None = None) -> dict[str, set[str]]:
        """Per host: cells and images from its own directories; processes and namespaces from
        this machine's tables (shared PID namespace; every host's agent has the same base path,
        so a process of any host matches it)."""
        cs: dict[str, Any] = {}
        images: set[str] = set()
        for root in self.roots():
            cs.update(L.cells(root))
            images |= L.images(root, transient=False)
        # /dev/shm is not private to a host: one tmpfs root, keyed by the host-internal base;
        # a dead host's entries would have gone with it (as its directories are skipped above)
        images |= {i for i in L.transient_images(self.base) if i.split("/", 1)[0] not in self.dead}
        # a dead host's cell namespaces went with it on a real machine; here their names linger
        # until `relocator down` (emulate.stop removes them)
        ns = L.netns() - self.dead_netns()
        if netns_names is not None:
            ns &= set(netns_names)
        return {"cells": set(cs), "netns": ns, "images": images, "placement_groups": L.placement_groups(),
                "processes": L.engine_processes(self.base, cs.values()),
                "transfers": L.transfer_processes(self.base)}

    def dead_netns(self) -> set[str]:
        """Namespaces of the dead hosts' cells: recorded cells, and the host's network registry
        (a cell being restored when its host died has a namespace and no record yet)."""
        out: set[str] = set(self._dead_netns)
        for n in self.dead:
            out |= {c.netns for c in L.cells(self.path(n, self.base)).values()}
            out |= {rec.stem for rec in (self.hosts[n].private("run") / "net").glob("*.json")}
        return out

    def remove_dead_netns(self) -> list[str]:
        """Remove the dead hosts' namespace names from this machine (`relocator down` misses a
        target cell's that has no record); they would have gone with a real host."""
        import subprocess

        names = sorted(self.dead_netns() & L.netns())
        for n in names:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
        return names

    def kill_node(self, node: str, netns: Iterable[str] = ()) -> dict[str, Any] | None:
        """Kill node's whole host. `netns`: namespaces known to be on it that its records may
        not name yet (a move's target cell during RESTORE: seen left with no registry record)."""
        from relocator.cluster.emulate import kill_host

        self.dead.add(node)
        self._dead_netns |= set(netns)
        return kill_host(self.hosts[node])


def host_view(ctl: Any, base: Path) -> LocalView:
    """The view for the cluster `ctl` is attached to (`ctl.info`: cluster.json's content)."""
    info = getattr(ctl, "info", None) or {}
    if not info.get("emulated"):
        return LocalView(base)
    from relocator.deploy.deploy import deployment

    dep = deployment() or {}
    if not dep.get("base_dir"):
        raise RuntimeError("emulated hosts: no deployment record in Ray (is relocator deployed?)")
    ctl_host = (dep.get("controller_node") or {}).get("hostname") or info.get("controller_host")
    return EmulatedView(info, dep["base_dir"], ctl_host)


def split_faults(faults: Iterable[str], view: LocalView) -> tuple[list[str], dict[str, str]]:
    """(faults that apply on this cluster, {skipped fault: why})."""
    keep, skipped = [], {}
    for f in faults:
        if f in view.skips:
            skipped[f] = view.skips[f]
        else:
            keep.append(f)
    return keep, skipped
