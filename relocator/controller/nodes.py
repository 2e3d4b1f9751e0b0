"""Nodes: Ray's node table joined with what the store remembers (names, GPU facts, when a
node was first seen lost, cordons), and the reconcile steps that keep nodes clean: a lost node
fenced once, a live node's GPUs reported once, orphan cells and reservations freed."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

from relocator.controller.claims import Claims
from relocator.controller.events import EventKind
from relocator.controller.inventory import GpuFact, NodeInfo, ray_nodes
from relocator.controller.store import Store

log = logging.getLogger("relocator.controller")
ORPHAN_AFTER_S = 60.0  # a cell nobody owns is killed once it is this old
INVENTORY_TTL_S = 1.0  # a cached inventory younger than this is answered without asking Ray


def ray_placement_groups() -> list[dict]:
    import ray

    return list(ray.util.placement_group_table().values())


class NodeManager:
    def __init__(self, store: Store, backend: Any, claims: Claims, emit: Callable[..., Any],
                 node_dir: Callable[[str], Path], node_names: dict[str, str] | None = None,
                 list_nodes: Callable[..., dict[str, NodeInfo]] = ray_nodes,
                 placement_groups: Callable[[], list[dict]] = ray_placement_groups) -> None:
        self.store, self.backend, self.claims, self.emit, self.node_dir = store, backend, claims, emit, node_dir
        self.node_names, self.list_nodes, self.placement_groups = node_names, list_nodes, placement_groups
        self._nodes: dict[str, NodeInfo] = {}
        self._nodes_at = 0.0
        self.lost: dict[str, float] = {}  # node -> when this controller saw it lost
        self._unreachable: set[tuple[str, str]] = set()  # (node, cell) a fence cannot act on

    # -- the inventory ------------------------------------------------------------------------
    def inventory(self, refresh: bool = False) -> dict[str, NodeInfo]:
        with self.claims.lock:
            if refresh or time.monotonic() - self._nodes_at > INVENTORY_TTL_S:
                self._read()
            return dict(self._nodes)

    def _read(self) -> None:
        docs = {d["ray_node_id"]: d for d in self.store.all("node")}
        known = {k: d["id"] for k, d in docs.items()}
        self._nodes = self.list_nodes(known, self.node_names)
        for n in self._nodes.values():  # remembered: Ray lists a dead node without its name
            if n.alive and known.get(n.ray_node_id) != n.id:
                self.store.put("node", n.ray_node_id, {"id": n.id, "ray_node_id": n.ray_node_id})
            n.gpus = [GpuFact(**g) for g in (docs.get(n.ray_node_id) or {}).get("gpus") or []]
            if not n.alive and n.id not in self.lost:
                self._first_seen_lost(n)
        self._nodes_at = time.monotonic()

    def _first_seen_lost(self, n: NodeInfo) -> None:
        self.lost[n.id] = time.time()
        self.claims.wake.set()
        doc = self.store.get("node", n.ray_node_id) or {"id": n.id, "ray_node_id": n.ray_node_id}
        if not doc.get("lost_at"):  # once per node, also across controller restarts
            self.store.put("node", n.ray_node_id, {**doc, "lost_at": self.lost[n.id]})
            self.emit(EventKind.NODE_LOST, node=n.id, ray_node_id=n.ray_node_id)

    def watch(self, stop: threading.Event, every: float) -> None:
        """Ray's node table every `every` s (one cheap GCS call): a node newly declared dead
        wakes the reconcile loop at once, so its workers are replaced without waiting a round."""
        while not stop.wait(every):
            try:
                self.inventory(refresh=True)
            except Exception as exc:  # noqa: BLE001
                log.warning("node watch: %s", exc)

    def check_target(self, node: str, nodes: dict[str, NodeInfo] | None = None) -> None:
        """An operator's explicit target (`--to`, `--node`): known, alive and not cordoned."""
        nodes = self.inventory(refresh=True) if nodes is None else nodes
        if node not in nodes:
            raise ValueError(f"unknown node {node!r}; nodes: {', '.join(nodes)}")
        if not nodes[node].alive:
            raise ValueError(f"node {node!r} is lost")
        if node in self.cordoned():
            raise ValueError(f"node {node!r} is cordoned (drained with --by): nothing is placed there "
                             f"until `relocator uncordon {node}`")

    # -- cordons ------------------------------------------------------------------------------
    def cordoned(self) -> set[str]:
        """Nodes drained with a deadline: nothing is placed or resumed on them until uncordoned."""
        return {d["node"] for d in self.store.all("cordon")}

    def cordon(self, node: str, until: float) -> None:
        self.store.put("cordon", node, {"node": node, "at": time.time(), "by": until})

    def uncordon(self, node: str) -> dict:
        self.store.delete("cordon", node)
        self.claims.wake.set()
        return {"node": node, "cordoned": False}

    # -- reconcile steps ----------------------------------------------------------------------
    def update(self) -> None:
        """A live node's agent reports its real GPUs once (kept with the node's record); the
        cells of a node Ray declares dead are fenced, each once it is found."""
        nodes = self.inventory(refresh=True)
        for name, info in nodes.items():
            if info.alive and "gpus" not in (self.store.get("node", info.ray_node_id) or {}):
                self._ask_gpus(name, info)
        for name, info in nodes.items():
            if not info.alive:
                self._fence(name)

    def _ask_gpus(self, name: str, info: NodeInfo) -> None:
        try:
            gpus = self.backend.agents.gpus(name, timeout=30)
        except Exception as exc:  # noqa: BLE001 - asked again next round
            log.debug("GPU report of %s: %s", name, exc)
            return
        doc = self.store.get("node", info.ray_node_id) or {"id": name, "ray_node_id": info.ray_node_id}
        self.store.put("node", info.ray_node_id, {**doc, "gpus": gpus})
        self._nodes_at = 0.0  # the next inventory carries them

    def _fence(self, name: str) -> None:
        """What of a lost node runs here and nobody owns is killed (a lost node's copies must
        never serve again next to their replacements). Every round while the node is lost, not
        once: its agent may outlive its raylet and record a cell after a first fence (a start
        it was in the middle of); a fence removes what it killed, so each cell is fenced once."""
        with self.claims.lock:
            # only cells nobody owns: a worker's own copy is killed by its replacement, after
            # the router holds its traffic, and a relocation's copies by its rollback
            cells = {c.name for c in (self.node_dir(name) / "state" / "cells").glob("*")}
            cells -= self.owned_cells() | {c for n, c in self._unreachable if n == name}
        if not cells:
            return
        try:
            out = self.backend.fence(name, sorted(cells))
            self._unreachable |= {(name, c) for c in out.get("unreachable", [])}
            log.warning("node %s is lost; fenced: %s", name, out)
        except Exception as exc:  # noqa: BLE001
            log.warning("node %s is lost; fencing failed: %s", name, exc)

    def owned_cells(self) -> set[str]:
        owned = {w.cell_id for w in self.store.workers()}
        for r in self.store.open_relocations():
            owned |= {r.src_cell, r.dst_cell}
        return owned

    def update_cells(self) -> None:
        """Cells on live nodes that no worker or open relocation owns (left by a failed kill, a
        node that came back, an interrupted launch) are killed once they are a minute old."""
        listed = {name: self.backend.agents.cells(name, timeout=30)
                  for name, info in self.inventory().items() if info.alive}
        owned = self.owned_cells()  # read after the agents: a cell is recorded before it is created
        for node, cells in listed.items():
            for c in cells:
                if c["id"] not in owned and time.time() - float(c.get("created_at", 0)) > ORPHAN_AFTER_S:
                    log.warning("killing orphan cell %s on %s", c["id"], node)
                    self.backend.kill(node, c["id"])

    def update_reservations(self) -> None:
        """Placement groups named relocator-* that no worker or open relocation owns are freed."""
        with self.claims.lock:
            owned = {w.reservation for w in self.store.workers()}
            for r in self.store.open_relocations():
                owned |= {r.reservation, r.src_reservation}
            owned |= self.claims.reservations
        for pg in self.placement_groups():
            name = pg.get("name", "")
            if name.startswith("relocator-") and pg.get("state") != "REMOVED" and name not in owned:
                self.backend.free(name)
