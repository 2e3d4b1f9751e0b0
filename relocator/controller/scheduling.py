"""Who starts a move: the controller's view of the cluster handed to the planner (the same
planner code the simulator and the trace replay use), and the plans that come back.

Pure: nodes and workers in, a plan out. The controller runs the plans (moves through the
relocation state machine, suspends and resumes through the agents and the router).

- `make_room`: the fewest live moves (then fewest bytes) after which a demand of N GPUs fits
  on one node (planner.defragment);
- `preempt`: the fewest lower-priority workers to suspend so that it fits (when moves alone
  cannot seat it);
- `consolidate`: moves that empty whole nodes onto nodes already in use (planner.consolidate).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from relocator import planner

GIB = 1 << 30
DEFAULT_MAX_MOVES = 4


@dataclass(frozen=True)
class NodeView:
    """A live node: its GPUs and how many of them nothing holds. `cordoned` (a drain with a
    deadline): its workers may leave, nothing is placed, moved or resumed onto it."""

    id: str
    gpus_total: int
    gpus_free: int
    cordoned: bool = False


@dataclass(frozen=True)
class Seat:
    """A worker that holds GPUs on a node. `movable`: running and not busy (a live move or a
    suspend may take it); `bytes`: what a move copies (its last image, else an estimate);
    `expired`: past its time limit (any demand may suspend it); `suspendable`: False while a
    failed suspend backs off."""

    worker: str
    node: str
    gpus: int
    priority: int = 0
    movable: bool = True
    bytes: int = 0
    expired: bool = False
    suspendable: bool = True


def can_suspend(s: Seat, priority: int) -> bool:
    """Whether a demand of `priority` may suspend `s`: a strictly lower priority, or a worker
    past its time limit (preemptible); never one whose failed suspend backs off."""
    return s.movable and s.suspendable and (s.priority < priority or s.expired)


@dataclass(frozen=True)
class MovePlan:
    worker: str
    src: str
    dst: str
    gpus: int
    bytes: int = 0

    def to_dict(self) -> dict:
        return {"worker": self.worker, "from": self.src, "to": self.dst, "gpus": self.gpus, "bytes": self.bytes}


@dataclass
class Seating:
    """How a demand gets its GPUs: on `node`, after `moves` (independent, run concurrently)
    and `suspends` (workers of lower priority set aside). `node` None: it cannot be seated
    now (`reason` says why)."""

    node: str | None
    moves: list[MovePlan] = field(default_factory=list)
    suspends: list[str] = field(default_factory=list)
    reason: str = ""

    @property
    def how(self) -> str:
        if self.node is None:
            return "pending"
        if self.suspends:
            return "preempt"
        return "make_room" if self.moves else "fits"

    def to_dict(self) -> dict:
        return {"node": self.node, "how": self.how, "moves": [m.to_dict() for m in self.moves],
                "suspends": list(self.suspends), "reason": self.reason,
                "bytes": sum(m.bytes for m in self.moves)}


def closed(nodes: Iterable[NodeView], exclude: Iterable[str] = ()) -> set[str]:
    """Nodes that take nobody: `exclude` and every cordoned node (the one rule for cordons)."""
    return set(exclude) | {n.id for n in nodes if n.cordoned}


def to_cluster(nodes: Iterable[NodeView], seats: Iterable[Seat], exclude: Iterable[str] = ()) -> planner.Cluster:
    """The planner's model: whole GPUs, no CPU or memory limits; GPUs held by something that
    is not a movable worker (a busy worker, a relocation's target, another tenant's
    reservation) are one immovable workload per node. A closed node (`exclude`, cordoned)
    never receives anything: one more immovable workload fills its free GPUs."""
    nodes = sorted(nodes, key=lambda n: n.id)
    cluster = planner.Cluster([planner.NodeSpec(n.id, 10**9, 10**9, n.gpus_total) for n in nodes])
    by_node: dict[str, list[Seat]] = {}
    for s in seats:
        by_node.setdefault(s.node, []).append(s)
    for n in nodes:
        mine = sorted(by_node.get(n.id, []), key=lambda s: s.worker)
        movable = [s for s in mine if s.movable and s.gpus > 0]
        other = n.gpus_total - n.gpus_free - sum(s.gpus for s in movable)
        if other > 0:
            cluster.add(planner.Workload(f"_held_{n.id}", num_gpu=other, gpu_milli=planner.MILLI,
                                         relocatable=False), n.id)
        for s in movable:
            try:
                cluster.add(planner.Workload(s.worker, num_gpu=s.gpus, gpu_milli=planner.MILLI,
                                             move_cost_bytes=s.bytes or s.gpus * GIB), n.id)
            except planner.PlannerError:  # the views disagree (Ray lags a free): not movable
                pass
    for nid in sorted(closed(nodes, exclude) & {n.id for n in nodes}):
        free = int((cluster.gpu_left[cluster.node_index(nid)] >= planner.MILLI).sum())
        if free:
            cluster.add(planner.Workload(f"_closed_{nid}", num_gpu=free, gpu_milli=planner.MILLI,
                                         relocatable=False), nid)
    return cluster


def _moves(plan: planner.Plan, seats: dict[str, Seat]) -> list[MovePlan]:
    return [MovePlan(m.workload, m.src, m.dst, seats[m.workload].gpus, m.bytes) for m in plan.moves]


def fits(nodes: Iterable[NodeView], gpus: int, policy: str = "best-fit", exclude: Iterable[str] = ()) -> str | None:
    """A node with `gpus` free GPUs now (the policy's choice, never a closed one), or None."""
    nodes = list(nodes)
    nodes = [n for n in nodes if n.id not in closed(nodes, exclude)]
    cluster = to_cluster(nodes, [Seat(f"_used_{n.id}", n.id, n.gpus_total - n.gpus_free, movable=False)
                                 for n in nodes])
    p = planner.place(cluster, planner.Workload("_demand", num_gpu=gpus, gpu_milli=planner.MILLI), policy=policy)
    return p.node if p is not None else None


def make_room(nodes: list[NodeView], seats: list[Seat], gpus: int, max_moves: int = DEFAULT_MAX_MOVES,
              policy: str = "best-fit", exclude: Iterable[str] = ()) -> Seating:
    """The fewest live moves (then fewest bytes) after which `gpus` GPUs are free on one node."""
    exclude = closed(nodes, exclude)
    live = [n for n in nodes if n.id not in exclude]
    if not any(n.gpus_total >= gpus for n in live):
        return Seating(None, reason=f"no node has {gpus} GPU(s) at all")
    direct = fits(live, gpus, policy)
    if direct is not None:
        return Seating(direct)
    if max_moves <= 0:
        return Seating(None, reason=f"no node has {gpus} free GPU(s) (moves disabled)")
    seats = [s for s in seats if s.node in {n.id for n in nodes}]
    cluster = to_cluster(nodes, seats, exclude)  # a closed node takes nobody and is never the target
    plan = planner.defragment(cluster, planner.Workload("_demand", num_gpu=gpus, gpu_milli=planner.MILLI),
                              max_moves=max_moves, policy=policy, victim_policy="best-fit")
    if (plan is None or plan.placement is None or plan.placement.node in exclude
            or any(m.dst in exclude for m in plan.moves)):  # a closed node's GPUs freed by a move: still closed
        return Seating(None, reason=f"no node has {gpus} free GPU(s), not even after {max_moves} live move(s)")
    return Seating(plan.placement.node, _moves(plan, {s.worker: s for s in seats}))


def preempt(nodes: list[NodeView], seats: list[Seat], gpus: int, priority: int,
            exclude: Iterable[str] = ()) -> Seating:
    """The fewest running workers to suspend so that `gpus` GPUs are free on one node: of
    priority below `priority`, or past their time limit (`can_suspend`). Those past their
    limit first (they had their turn), then the fewest, the lowest priorities, the fewest GPUs."""
    best: tuple | None = None
    exclude = closed(nodes, exclude)
    for n in nodes:
        if n.id in exclude or n.gpus_total < gpus:
            continue
        free = n.gpus_free
        victims: list[Seat] = []
        cands = [s for s in seats if s.node == n.id and can_suspend(s, priority)]
        # the fewest: take the largest of the lowest priority first (past their limit before
        # all), then drop any not needed (those within their limit first)
        for s in sorted(cands, key=lambda s: (not s.expired, -s.gpus, s.priority, s.worker)):
            if free >= gpus:
                break
            victims.append(s)
            free += s.gpus
        if free < gpus:
            continue
        for s in sorted(victims, key=lambda s: (s.expired, -s.priority, s.gpus)):  # needless ones go back
            if free - s.gpus >= gpus:
                victims.remove(s)
                free -= s.gpus
        key = (sum(not s.expired for s in victims), len(victims), sum(s.priority for s in victims),
               sum(s.gpus for s in victims), n.id)
        if best is None or key < best[0]:
            best = (key, n.id, [s.worker for s in victims])
    if best is None:
        return Seating(None, reason=f"no node has {gpus} GPU(s) even after suspending every worker of "
                                    f"priority below {priority} or past its time limit")
    return Seating(best[1], suspends=best[2])


def consolidate(nodes: list[NodeView], seats: list[Seat], max_moves: int = 10) -> dict:
    """Moves that pack the running workers onto the fewest nodes, never onto a cordoned one:
    {moves, nodes_freed}."""
    cluster = to_cluster(nodes, seats)
    plan = planner.consolidate(cluster, max_moves=max_moves, policy="best-fit")
    by = {s.worker: s for s in seats}
    shut = closed(nodes)
    moves = [m for m in _moves(plan, by) if m.dst not in shut]
    used_before = {n.id for n in nodes if n.gpus_total - n.gpus_free > 0}
    left: dict[str, int] = {}
    for s in seats:
        left[s.node] = left.get(s.node, 0) + 1
    for m in moves:
        left[m.src] -= 1
    held = {n.id for n in nodes if n.gpus_total - n.gpus_free > sum(s.gpus for s in seats if s.node == n.id)}
    freed = sorted(n for n in used_before if left.get(n, 0) == 0 and n not in held and
                   any(m.src == n for m in moves))
    return {"moves": moves, "nodes_freed": freed}
