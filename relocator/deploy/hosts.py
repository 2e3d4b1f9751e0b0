"""What deploy learns and checks on every host: a task pinned to each selected Ray node.

The probe runs on the host itself (its filesystem, its network namespace, its kernel), so a
host is described by what it reports, never by what the machine running `deploy` sees. The
checks across hosts (names, cell subnets, shared storage) are pure functions of the reports.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from pathlib import Path
from typing import Any

from relocator import procs


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def probe(base_dir: str, shared_marker: str | None = None) -> dict[str, Any]:
    """Runs on the host: identity, preflight (relocator.preflight), cell subnet, real GPUs."""
    import platform

    from relocator.cell import netns
    from relocator.gpus import local_gpus
    from relocator.preflight import run_checks
    from relocator.snapshot import criu

    checks = [c.model_dump() for c in run_checks()]
    try:
        criu_version = criu.criu_version(criu.criu_binary())
    except Exception as exc:  # noqa: BLE001 - reported by the preflight checks too
        criu_version = f"unavailable: {exc}"
    writable = True
    try:
        Path(base_dir).mkdir(parents=True, exist_ok=True)
        probe_file = Path(base_dir) / f".probe-{os.getpid()}"
        probe_file.write_text("ok")
        probe_file.unlink()
    except OSError:
        writable = False
    checks.append({"name": f"state dir {base_dir} writable", "ok": writable, "detail": "yes" if writable else "no",
                   "fix": "create it, on local disk, writable by root", "warning": False})
    out = {
        "hostname": socket.gethostname(), "boot_id": procs.boot_id(),
        "machine_id": _read("/etc/machine-id"), "kernel": platform.release(), "criu": criu_version,
        "cell_pool": str(netns.POOL), "cell_routes": netns.cell_routes(),
        "gpus": [g.to_dict() for g in local_gpus()], "checks": checks,
    }
    if shared_marker is not None:
        out["shared_seen"] = _read(str(Path(base_dir) / ".shared-marker")) == shared_marker
    return out


def write_marker(base_dir: str, marker: str) -> str:
    """Runs on the controller's host: the file every host must see if storage is shared."""
    Path(base_dir).mkdir(parents=True, exist_ok=True)
    (Path(base_dir) / ".shared-marker").write_text(marker)
    return socket.gethostname()


def remove_dir(path: str) -> dict[str, Any]:
    """Runs on a host at undeploy: its state under the deployment's directory, and any cell
    left recorded there (normally none: the controller killed them)."""
    import shutil

    from relocator.cell.cell import list_cells, using_state_dir

    cells = []
    for state in sorted(Path(path).glob("nodes/*/state")):
        with using_state_dir(state):
            for c in list_cells():
                c.kill()
                cells.append(c.id)
    existed = Path(path).exists()
    from relocator.agent.transient import remove_roots

    remove_roots(path)  # stream/postcopy images on its tmpfs
    shutil.rmtree(path, ignore_errors=True)
    return {"hostname": socket.gethostname(), "removed": existed, "cells_killed": cells}


def node_name(node: dict[str, Any], how: str) -> str:
    """A node's relocator name: its hostname or IP, made safe for actor and directory names."""
    raw = node.get("NodeManagerHostname") if how == "hostname" else node.get("NodeManagerAddress")
    return re.sub(r"[^A-Za-z0-9_.-]", "-", str(raw or node["NodeID"][:12]))


def name_nodes(nodes: list[dict[str, Any]], how: str) -> dict[str, str]:
    """{ray node id: name}; two nodes with one name (two raylets on one host, or hosts with the
    same hostname) get their IP, then a short node id, appended."""
    names = {n["NodeID"]: node_name(n, how) for n in nodes}
    counts: dict[str, int] = {}
    for v in names.values():
        counts[v] = counts.get(v, 0) + 1
    for n in nodes:
        if counts[names[n["NodeID"]]] > 1:
            names[n["NodeID"]] = f"{names[n['NodeID']]}-{n['NodeID'][:8]}"
    return names


def cross_checks(reports: dict[str, dict[str, Any]], gpu_counts: dict[str, int], *, fake_gpus: bool,
                 shared: bool) -> dict[str, list[str]]:
    """Checks that need every host's report: {host: [failure, ...]}. Cell subnets must not
    overlap (a worker's address must mean one host); a host's Ray GPU count needs real GPUs
    unless fake ones are configured; `shared` transfer needs the storage seen by every host."""
    failures: dict[str, list[str]] = {h: [] for h in reports}
    pools = {}
    for h, r in reports.items():
        try:
            pools[h] = ipaddress.ip_network(r["cell_pool"])
        except ValueError:
            failures[h].append(f"cell subnet {r['cell_pool']!r} is not a network")
    hosts = sorted(pools)
    for i, a in enumerate(hosts):
        for b in hosts[i + 1:]:
            if pools[a].overlaps(pools[b]):
                msg = (f"cell subnet {pools[a]} overlaps {b}'s {pools[b]}: give each host its own "
                       "(RELOCATOR_NET_POOL before `ray start`, docs/deploy.md)")
                failures[a].append(msg)
                failures[b].append(f"cell subnet {pools[b]} overlaps {a}'s {pools[a]}")
    if len(reports) > 1:
        for h, r in reports.items():
            if not r.get("cell_routes"):
                failures[h].append("no RELOCATOR_CELL_ROUTES: workers here are reachable only from this host "
                                   "(set it to the network the router is on, docs/deploy.md)")
    for h, r in reports.items():
        real = len(r.get("gpus") or [])
        declared = gpu_counts.get(h, 0)
        if declared > real and not fake_gpus:
            failures[h].append(f"Ray declares {declared} GPU(s) but the host has {real}: set "
                               "nodes.fake_gpus for emulation, or fix `ray start --num-gpus`")
        if shared and not r.get("shared_seen"):
            failures[h].append("transfer: shared, but this host does not see the controller host's "
                               "base_dir (no shared filesystem): use transfer: stream")
    return failures


def summarize(report: dict[str, Any], extra: list[str]) -> dict[str, Any]:
    """One host's line: ok, what failed (errors), what warned."""
    failed = [f"{c['name']}: {c['detail']}" + (f" ({c['fix']})" if c.get("fix") else "")
              for c in report.get("checks", []) if not c["ok"] and not c.get("warning")]
    warned = [f"{c['name']}: {c['detail']}" for c in report.get("checks", []) if not c["ok"] and c.get("warning")]
    failed += extra
    return {"ok": not failed, "failed": failed, "warnings": warned}
