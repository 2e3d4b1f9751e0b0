"""Nodes and their GPUs as Ray sees them, and where a worker should go.

Emulated nodes carry a custom resource `relocator_node:<name>`; GPUs are Ray's `GPU` resource
(fake counts on machines without GPUs). Free GPUs are what Ray has not reserved: every worker
and every relocation target holds its GPUs through a placement group.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from relocator import shares
from relocator.gpus import GpuFact, local_gpus  # noqa: F401 - re-exported: they live low, in relocator.gpus

NODE_RESOURCE = "relocator_node:"
log = logging.getLogger("relocator.controller")


@dataclass
class NodeInfo:
    id: str
    ray_node_id: str
    gpus_total: int
    gpus_free: float  # whole GPUs and shares nothing holds (an int when whole, relocator.shares.count)
    alive: bool = True
    #: the node's real GPUs as its agent reports them (`local_gpus`); empty: fake GPUs
    gpus: list["GpuFact"] = field(default_factory=list)

    def to_dict(self) -> dict:
        out = {"id": self.id, "ray_node_id": self.ray_node_id, "gpus_total": self.gpus_total,
               "gpus_free": self.gpus_free, "alive": self.alive}
        if self.gpus:
            out["gpus"] = [g.to_dict() for g in self.gpus]
        return out


def ray_nodes(known: dict[str, str] | None = None, named: dict[str, str] | None = None) -> dict[str, NodeInfo]:
    """The relocator nodes of the connected Ray cluster, by name. Ray lists a dead node without
    its resources: `known` ({ray node id: name}, what was seen before) names it, as lost.
    `named` ({ray node id: name}): nodes of a deployed cluster (`relocator deploy`), which carry
    no `relocator_node:` resource; told apart by Ray node id, alive or lost."""
    import ray
    from ray._private import state

    avail = {}
    try:
        avail = state.available_resources_per_node()
    except Exception:  # noqa: BLE001 - older/newer Ray: fall back to totals
        pass
    out: dict[str, NodeInfo] = {}
    for n in ray.nodes():
        names = [k[len(NODE_RESOURCE):] for k in n.get("Resources", {}) if k.startswith(NODE_RESOURCE)]
        if not names and n["NodeID"] in (named or {}):
            names = [named[n["NodeID"]]]
        if not names and not n["Alive"] and n["NodeID"] in (known or {}):
            name = known[n["NodeID"]]
            if name not in out:  # a live node of that name (re-added) wins
                out[name] = NodeInfo(name, n["NodeID"], 0, 0, False)
            continue
        if not names:
            continue
        total = int(n["Resources"].get("GPU", 0))
        # Ray leaves a resource with nothing available out of a node's entry: a node whose GPUs
        # are all reserved has no "GPU" key (0 free, not all free); a node missing from the
        # view altogether (older Ray, no report yet) counts as all free
        node_avail = avail.get(n["NodeID"])
        # shares leave a fraction (3.25: a 0.75 share held); relocator.shares.count keeps it
        free = (shares.count(node_avail.get("GPU", 0)) if node_avail is not None else total) if n["Alive"] else 0
        out[names[0]] = NodeInfo(names[0], n["NodeID"], total, free, bool(n["Alive"]))
    return dict(sorted(out.items()))


def best_fit(free: dict[str, float], gpus: float, exclude: tuple[str, ...] = (), totals: dict[str, int] | None = None,
             policy: str = "best-fit") -> str | None:
    """The node to put a `gpus`-GPU worker on: the planner's `policy` when it knows every node's
    total (`totals`), else plain best-fit (fewest GPUs left over, ties by name). An unknown
    policy is refused (ValueError naming the planner's policies), never replaced."""
    from relocator import planner

    policy = planner.PlacementPolicy(policy)
    candidates = {n: f for n, f in free.items() if n not in exclude and f >= gpus}
    if not candidates:
        return None
    if totals:
        try:
            nodes = [planner.NodeSpec(n, 10**6, 10**7, totals[n]) for n in sorted(free)]
            cluster = planner.Cluster(nodes)
            for n in sorted(free):
                whole, rest = divmod(shares.milli(totals[n] - free[n]), planner.MILLI)  # shares: one GPU in part
                if whole > 0:
                    cluster.add(planner.Workload(f"_used_{n}", num_gpu=whole, gpu_milli=planner.MILLI), n)
                if rest > 0:
                    cluster.add(planner.Workload(f"_used_{n}_share", num_gpu=1, gpu_milli=rest), n)
            num, per = shares.shape(gpus)
            placement = planner.place(cluster, planner.Workload("_new", num_gpu=num, gpu_milli=per),
                                      policy=policy.value, exclude=tuple(n for n in exclude if n in free))
        except (planner.PlannerError, KeyError) as exc:  # an inventory the planner cannot model
            log.warning("placement by %s failed (%s); using plain best-fit", policy, exc)
        else:
            if placement is not None and placement.node in candidates:
                return placement.node
    return min(candidates, key=lambda n: (candidates[n] - gpus, n))


def ray_hosts(ray_node_ids: dict[str, str]) -> dict[str, str]:
    """{node: the address of its host} for {node: Ray node id}: nodes of one host share it
    (the loopback cluster's nodes are all one host; emulated and real hosts each have their own)."""
    import ray

    addr = {n["NodeID"]: n.get("NodeManagerAddress", "") for n in ray.nodes()}
    return {node: addr.get(rid) or node for node, rid in ray_node_ids.items()}
