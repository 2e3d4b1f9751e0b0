"""What a relocation may leave behind, collected before and after and compared.

Kinds: `cells` (recorded under each node's state dir), `netns` (`ip netns` entries `rl-*`),
`images` (directories under each node's images dir, and under the cluster's tmpfs root:
relocator.agent.transient), `placement_groups` (`relocator-*`, not removed), `processes` (vLLM
processes started by this cluster that are in no recorded cell), `transfers` (CRIU page servers,
lazy dumps, lazy-pages daemons and post-copy keepers working in this cluster's directories: each
ends with its move), `firewall` (iptables rules a network-cut fault tagged `relocator-chaos-*`:
each is removed once its move has ended).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, Iterable

from relocator import procs

KINDS = ("cells", "netns", "images", "placement_groups", "processes", "transfers", "firewall")
#: the comment a chaos fault's iptables rules carry (relocator.chaos.injector)
RULE_TAG = "relocator-chaos-"


def diff_leaks(before: dict[str, Iterable[str]], after: dict[str, Iterable[str]],
               expected: dict[str, Iterable[str]] | None = None) -> dict[str, list[str]]:
    """Per kind: what is in `after` but neither in `before` nor in `expected` (the things that
    should exist now, e.g. the workers' current cells)."""
    expected = expected or {}
    out = {}
    for k in KINDS:
        extra = set(after.get(k, ())) - set(before.get(k, ())) - set(expected.get(k, ()))
        out[k] = sorted(extra)
    return out


def total(leaked: dict[str, list]) -> int:
    return sum(len(v) for v in leaked.values())


# ---- collectors (real system) -----------------------------------------------------------------
def cells(base: Path) -> dict[str, Any]:
    """{"<node>/<cell>": cell} for every cell recorded under base/nodes/*/state."""
    from relocator.cell.cell import list_cells, using_state_dir

    out = {}
    for state in sorted(Path(base).glob("nodes/*/state")):
        with using_state_dir(state):
            found = list_cells()
        for c in found:
            out[f"{state.parent.name}/{c.id}"] = c
    return out


def netns() -> set[str]:
    try:
        txt = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return set()
    return {ln.split()[0] for ln in txt.splitlines() if ln.strip().startswith("rl-")}


def images(base: Path, transient: bool = True) -> set[str]:
    """Each node's images as "<node>/<image>", and those under the cluster's tmpfs root (a
    stream/postcopy target's, relocator.agent.transient) as "<node>/tmpfs:<image>"."""
    out = {f"{d.parent.parent.name}/{d.name}" for d in Path(base).glob("nodes/*/images/*")}
    if transient:
        out |= transient_images(base)
    return out


def transient_images(base: str | Path) -> set[str]:
    """The images under the tmpfs root of the cluster whose base dir is `base` (the path the
    agents were given: on emulated hosts the host-internal one)."""
    from relocator.agent.transient import transient_root

    return {f"{d.parent.parent.name}/tmpfs:{d.name}" for d in transient_root(base).glob("*/images/*")}


def placement_groups() -> set[str]:
    import ray

    return {f"{pg.get('name')}" for pg in ray.util.placement_group_table().values()
            if str(pg.get("name", "")).startswith("relocator-") and pg.get("state") != "REMOVED"}


def engine_processes(base: Path, live_cells: Iterable[Any]) -> set[str]:
    """Engine processes (any adapter's `process_markers` in the command line) whose
    RELOCATOR_STATE_DIR is under `base` and whose PID namespace is not that of a recorded, live
    cell: strays."""
    from adapters.base import engine_names, get_adapter

    markers = {m for name in engine_names() for m in get_adapter(name).process_markers}
    base_s = str(Path(base).resolve())
    cell_ns = {procs.pid_ns(c.init_pid) for c in live_cells if c.is_alive()} - {None}
    out = set()
    for pid, (_, argv) in procs.process_table().items():
        cmd = "\0".join(argv).encode(errors="replace")
        if not any(m in cmd for m in markers):
            continue
        if not procs.environ(pid).get("RELOCATOR_STATE_DIR", "").startswith(base_s):
            continue
        if procs.pid_ns(pid) in cell_ns:
            continue
        out.add(f"{pid}:{argv[0][-40:]}")
    return out


def transfer_processes(base: Path) -> set[str]:
    """`criu page-server`, `criu dump --lazy-pages`, `criu lazy-pages` and post-copy keepers
    whose directories are under `base`."""
    base_s = str(Path(base).resolve())
    out = set()
    for pid, (_, argv) in procs.process_table().items():
        if not argv or not any(base_s in a for a in argv):
            continue
        criu = argv[0].endswith("criu") and (
            "page-server" in argv[1:2] or "lazy-pages" in argv[1:2] or "--lazy-pages" in argv and "dump" in argv[1:2])
        keeper = "relocator.agent.postcopy" in argv
        pump = "relocator.agent.pump" in argv
        if criu or keeper or pump:
            out.add(f"{pid}:{'keeper' if keeper else 'pump' if pump else 'criu ' + argv[1]}")
    return out


def chaos_rules() -> set[str]:
    """The iptables rules (`iptables -S` lines) a chaos fault tagged; empty without iptables."""
    try:
        out = subprocess.run(["iptables", "-S"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return set()
    return {line for line in out.splitlines() if RULE_TAG in line}


def _foreign_netns(name: str, base: Path) -> bool:
    """A namespace whose processes belong to another cluster (same cell name elsewhere)."""
    from relocator.cell import netns as ns

    pids = ns.pids(name)
    mine = str(Path(base).resolve())
    for pid in pids:
        theirs = procs.environ(pid).get("RELOCATOR_STATE_DIR")
        if theirs is not None and not theirs.startswith(mine):
            return True
    return False


def collect(base: str | Path, with_ray: bool = True, netns_names: set[str] | None = None) -> dict[str, set[str]]:
    """`netns_names`: only these namespaces count (`ip netns` is machine-wide and other
    clusters on the same host create and remove theirs at any time)."""
    base = Path(base)
    cs = cells(base)
    ns = netns()
    if netns_names is not None:
        ns = {n for n in ns & set(netns_names) if not _foreign_netns(n, base)}
    snap = {"cells": set(cs), "netns": ns, "images": images(base),
            "placement_groups": placement_groups() if with_ray else set(),
            "processes": engine_processes(base, cs.values()), "transfers": transfer_processes(base),
            "firewall": chaos_rules()}
    return snap
