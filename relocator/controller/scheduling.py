"""Who starts a move: the controller's view of the cluster handed to the planner (the same
planner code the simulator and the trace replay use), and the plans that come back.

Pure: nodes and workers in, a plan out. The controller runs the plans (moves through the
relocation state machine, suspends and resumes through the agents and the router).

- `make_room`: the fewest live moves (then fewest bytes) after which a demand of N GPUs fits
  on one node (planner.defragment);
- `preempt`: the fewest lower-priority workers to suspend so that it fits (when moves alone
  cannot seat it);
- `consolidate`: moves that empty whole nodes onto nodes already in use (planner.consolidate),
  then GPUs of shares onto other GPUs of shares (planner.pack_shares), by FGD's score.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from relocator import planner, shares

GIB = 1 << 30
DEFAULT_MAX_MOVES = 4


@dataclass(frozen=True)
class NodeView:
    """A live node: its GPUs and how many of them nothing holds (whole GPUs and shares summed:
    3.25 with a 0.75 share held, relocator.shares). `cordoned` (a drain with a deadline): its
    workers may leave, nothing is placed, moved or resumed onto it."""

    id: str
    gpus_total: int
    gpus_free: float
    cordoned: bool = False


@dataclass(frozen=True)
class Seat:
    """A worker that holds GPUs on a node. `movable`: running and not busy (a live move or a
    suspend may take it); `bytes`: what a move copies (its last image, else an estimate);
    `expired`: past its time limit (any demand may suspend it); `suspendable`: False while a
    failed suspend backs off. `gpus`: whole GPUs or a share of one (relocator.shares);
    `gpu_ids`: the node's GPU indices Ray gave it (where a share sits; () when unknown)."""

    worker: str
    node: str
    gpus: float
    priority: int = 0
    movable: bool = True
    bytes: int = 0
    expired: bool = False
    suspendable: bool = True
    gpu_ids: tuple[int, ...] = ()


def can_suspend(s: Seat, priority: int) -> bool:
    """Whether a demand of `priority` may suspend `s`: a strictly lower priority, or a worker
    past its time limit (preemptible); never one whose failed suspend backs off."""
    return s.movable and s.suspendable and (s.priority < priority or s.expired)


@dataclass(frozen=True)
class MovePlan:
    worker: str
    src: str
    dst: str
    gpus: float
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


def demand_workload(gpus: float, wid: str = "_demand") -> planner.Workload:
    """A demand of `gpus` (whole GPUs or a share, relocator.shares) as the planner's workload."""
    num, per = shares.shape(gpus)
    return planner.Workload(wid, num_gpu=num, gpu_milli=per)


def _seat_workload(s: Seat) -> planner.Workload:
    num, per = shares.shape(s.gpus)
    return planner.Workload(s.worker, num_gpu=num, gpu_milli=per, relocatable=s.movable,
                            move_cost_bytes=s.bytes or max(1, int(s.gpus * GIB)))


def _add(cluster: planner.Cluster, w: planner.Workload, node: str, gpus: tuple[int, ...] = ()) -> bool:
    """`w` on `node` at `gpus` (its GPU ids, when they fit), else wherever on it it fits; False
    when it does not fit at all (the views disagree: Ray lags a free)."""
    if gpus and len(gpus) == w.num_gpu:
        try:
            cluster.add(w, node, gpus)
            return True
        except planner.PlannerError:
            pass
    try:
        cluster.add(w, node)
        return True
    except planner.PlannerError:
        return False


def _add_held(cluster: planner.Cluster, node: str, held_milli: int) -> None:
    """GPUs held by something that is no seat (another tenant's reservation, a relocation's
    target): immovable, whole GPUs first, then a share of one for the rest."""
    whole, rest = divmod(max(0, held_milli), planner.MILLI)
    if whole:
        _add(cluster, planner.Workload(f"_held_{node}", num_gpu=whole, gpu_milli=planner.MILLI,
                                       relocatable=False), node)
    if rest:
        _add(cluster, planner.Workload(f"_held_{node}_share", num_gpu=1, gpu_milli=rest, relocatable=False), node)


def _close(cluster: planner.Cluster, nid: str) -> None:
    """A closed node takes nobody: every free GPU, and what is left of each shared one, filled."""
    left = cluster.gpu_left[cluster.node_index(nid)]
    for g in range(int(cluster.num_gpus[cluster.node_index(nid)])):
        if left[g] > 0:
            cluster.add(planner.Workload(f"_closed_{nid}_{g}", num_gpu=1, gpu_milli=int(left[g]),
                                         relocatable=False), nid, (g,))


def to_cluster(nodes: Iterable[NodeView], seats: Iterable[Seat], exclude: Iterable[str] = ()) -> planner.Cluster:
    """The planner's model: GPUs in milli-GPU (a share is part of one GPU, at the GPU id Ray gave
    it when known), no CPU or memory limits. A seat that is not movable (busy) is an immovable
    workload; GPUs held by something that is no seat (a relocation's target, another tenant's
    reservation) are immovable workloads too. A closed node (`exclude`, cordoned) never
    receives anything: immovable workloads fill what is free on it."""
    nodes = sorted(nodes, key=lambda n: n.id)
    cluster = planner.Cluster([planner.NodeSpec(n.id, 10**9, 10**9, n.gpus_total) for n in nodes])
    by_node: dict[str, list[Seat]] = {}
    for s in seats:
        by_node.setdefault(s.node, []).append(s)
    for n in nodes:
        mine = sorted((s for s in by_node.get(n.id, []) if s.gpus > 0), key=lambda s: (not s.gpu_ids, s.worker))
        placed = 0
        for s in [s for s in mine if s.gpu_ids]:  # where Ray put them first
            placed += shares.milli(s.gpus) if _add(cluster, _seat_workload(s), n.id, tuple(s.gpu_ids)) else 0
        rest = [s for s in mine if not s.gpu_ids]
        _add_held(cluster, n.id, shares.milli(n.gpus_total - n.gpus_free) - placed
                  - sum(shares.milli(s.gpus) for s in rest))
        for s in rest:
            _add(cluster, _seat_workload(s), n.id)
    for nid in sorted(closed(nodes, exclude) & {n.id for n in nodes}):
        _close(cluster, nid)
    return cluster


def _moves(plan: planner.Plan, seats: dict[str, Seat]) -> list[MovePlan]:
    return [MovePlan(m.workload, m.src, m.dst, seats[m.workload].gpus, m.bytes) for m in plan.moves]


def wanted(gpus: float) -> str:
    """A demand's size in words: "4 GPU(s)", "a 0.25 share of one GPU"."""
    return f"a {shares.label(gpus)} share of one GPU" if shares.is_share(gpus) else f"{shares.label(gpus)} GPU(s)"


def no_room(gpus: float) -> str:
    """Why a demand does not fit now: "no node has 4 free GPU(s)", "no GPU has a 0.25 share ... free"."""
    return f"no GPU has {wanted(gpus)} free" if shares.is_share(gpus) else f"no node has {shares.label(gpus)} free GPU(s)"


def fits(nodes: Iterable[NodeView], gpus: float, policy: str = "best-fit", exclude: Iterable[str] = (),
         seats: Iterable[Seat] | None = None) -> str | None:
    """A node with `gpus` free now (whole GPUs, or a share on one GPU: then `seats`, where the
    shares sit, tell which GPUs have room; the policy's choice, never a closed one), or None."""
    nodes = list(nodes)
    nodes = [n for n in nodes if n.id not in closed(nodes, exclude)]
    held = ([Seat(s.worker, s.node, s.gpus, movable=False, gpu_ids=s.gpu_ids) for s in seats] if seats is not None
            else [Seat(f"_used_{n.id}", n.id, n.gpus_total - n.gpus_free, movable=False) for n in nodes])
    cluster = to_cluster(nodes, [s for s in held if s.node in {n.id for n in nodes}])
    p = planner.place(cluster, demand_workload(gpus), policy=policy)
    return p.node if p is not None else None


def make_room(nodes: list[NodeView], seats: list[Seat], gpus: float, max_moves: int = DEFAULT_MAX_MOVES,
              policy: str = "best-fit", exclude: Iterable[str] = ()) -> Seating:
    """The fewest live moves (then fewest bytes) after which `gpus` (whole GPUs on one node, or
    a share on one GPU) are free."""
    exclude = closed(nodes, exclude)
    live = [n for n in nodes if n.id not in exclude]
    if not any(n.gpus_total >= max(1, gpus) for n in live):
        return Seating(None, reason=f"no node has {wanted(gpus)} at all")
    seats = [s for s in seats if s.node in {n.id for n in nodes}]
    direct = fits(live, gpus, policy, seats=seats)
    if direct is not None:
        return Seating(direct)
    free = no_room(gpus)
    if max_moves <= 0:
        return Seating(None, reason=f"{free} (moves disabled)")
    cluster = to_cluster(nodes, seats, exclude)  # a closed node takes nobody and is never the target
    plan = planner.defragment(cluster, demand_workload(gpus), max_moves=max_moves, policy=policy,
                              victim_policy="best-fit")
    if (plan is None or plan.placement is None or plan.placement.node in exclude
            or any(m.dst in exclude for m in plan.moves)):  # a closed node's GPUs freed by a move: still closed
        return Seating(None, reason=f"{free}, not even after {max_moves} live move(s)")
    return Seating(plan.placement.node, _moves(plan, {s.worker: s for s in seats}))


def _share_fits_without(n: NodeView, seats: list[Seat], victims: list[Seat], gpus: float) -> bool:
    """Whether a share of `gpus` fits on one GPU of `n` once `victims` are suspended."""
    gone = {s.worker for s in victims}
    view = NodeView(n.id, n.gpus_total, n.gpus_free + sum(s.gpus for s in victims))
    cluster = to_cluster([view], [s for s in seats if s.node == n.id and s.worker not in gone])
    return planner.place(cluster, demand_workload(gpus), policy="best-fit") is not None


def _victims(free: float, cands: list[Seat], gpus: float) -> list[Seat] | None:
    """The fewest of `cands` whose GPUs with `free` make `gpus`: the largest of the lowest
    priority first (past their limit before all), then any not needed dropped (those within
    their limit first). None: all of them are not enough."""
    victims: list[Seat] = []
    for s in sorted(cands, key=lambda s: (not s.expired, -s.gpus, s.priority, s.worker)):
        if free >= gpus:
            break
        victims.append(s)
        free += s.gpus
    if free < gpus:
        return None
    for s in sorted(victims, key=lambda s: (s.expired, -s.priority, s.gpus)):  # needless ones go back
        if free - s.gpus >= gpus:
            victims.remove(s)
            free -= s.gpus
    return victims


def _share_victims(n: NodeView, seats: list[Seat], cands: list[Seat], gpus: float) -> list[Seat] | None:
    """For a share: the victims on one GPU of `n` (the GPU whose victims are fewest)."""
    cluster = to_cluster([n], [s for s in seats if s.node == n.id])
    left = cluster.gpu_left[cluster.node_index(n.id)]
    best: list[Seat] | None = None
    for g in range(n.gpus_total):
        on_g = [s for s in cands if g in s.gpu_ids]
        v = _victims(int(left[g]) / planner.MILLI, on_g, gpus)
        if v is not None and _share_fits_without(n, seats, v, gpus) and (best is None or len(v) < len(best)):
            best = v
    return best


def preempt(nodes: list[NodeView], seats: list[Seat], gpus: float, priority: int,
            exclude: Iterable[str] = ()) -> Seating:
    """The fewest running workers to suspend so that `gpus` GPUs are free on one node (a share:
    on one GPU): of priority below `priority`, or past their time limit (`can_suspend`). Those
    past their limit first (they had their turn), then the fewest, the lowest priorities, the
    fewest GPUs."""
    best: tuple | None = None
    exclude = closed(nodes, exclude)
    for n in nodes:
        if n.id in exclude or n.gpus_total < gpus:
            continue
        cands = [s for s in seats if s.node == n.id and can_suspend(s, priority)]
        victims = (_share_victims(n, seats, cands, gpus) if shares.is_share(gpus)
                   else _victims(n.gpus_free, cands, gpus))
        if victims is None:
            continue
        key = (sum(not s.expired for s in victims), len(victims), sum(s.priority for s in victims),
               sum(s.gpus for s in victims), n.id)
        if best is None or key < best[0]:
            best = (key, n.id, [s.worker for s in victims])
    if best is None:
        return Seating(None, reason=f"no node has {wanted(gpus)} even after suspending every worker of "
                                    f"priority below {priority} or past its time limit")
    return Seating(best[1], suspends=best[2])


def _merged(steps: list[MovePlan]) -> list[MovePlan]:
    """One move per worker: a worker moved twice (node freed, then its GPU packed) goes straight
    to where it ends; one that ends where it started does not move."""
    first: dict[str, MovePlan] = {}
    last: dict[str, MovePlan] = {}
    for m in steps:
        first.setdefault(m.worker, m)
        last[m.worker] = m
    return [MovePlan(w, m.src, last[w].dst, m.gpus, m.bytes) for w, m in first.items() if last[w].dst != m.src]


def consolidate(nodes: list[NodeView], seats: list[Seat], max_moves: int = 10, demands: Iterable[float] = ()) -> dict:
    """Moves that pack the running workers onto the fewest nodes (planner.consolidate), then
    shares onto the fewest GPUs (planner.pack_shares) within the same budget, never onto a
    cordoned node: {moves, nodes_freed, gpus_freed (whole GPUs that come free)}. Where workers
    hold GPU shares, FGD's score picks the moves: the destination where fragmentation falls
    most (planner.RayGpuFGD), against the running workers' and the pending `demands`' shapes
    plus a whole GPU and a whole node (planner.target_shapes); else best fit, as before."""
    cluster = to_cluster(nodes, seats)
    before = planner.free_gpus(cluster)
    demands = [float(g) for g in demands]
    typical = planner.target_shapes(cluster, [_seat_workload(s) for s in seats if s.gpus > 0],
                                    [demand_workload(g) for g in demands if g > 0])
    sharing = any(shares.is_share(g) for g in [*(s.gpus for s in seats), *demands])
    plan = planner.consolidate(cluster, max_moves=max_moves,
                               policy=planner.RayGpuFGD(typical) if sharing else "best-fit")
    by = {s.worker: s for s in seats}
    shut = closed(nodes)
    steps = [m for m in _moves(plan, by) if m.dst not in shut]
    for mv in plan.moves:
        if mv.dst not in shut:
            cluster.move(mv.workload, mv.dst, mv.gpus)
    if sharing:
        packed = planner.pack_shares(cluster, max_moves - len(steps), exclude=sorted(shut & set(cluster.node_ids)),
                                     typical=typical)
        steps += _moves(packed, by)
        for m in packed.moves:
            cluster.move(m.workload, m.dst, m.gpus)
    moves = _merged(steps)
    used_before = {n.id for n in nodes if n.gpus_total - n.gpus_free > 0}
    left: dict[str, int] = {}
    for s in seats:
        left[s.node] = left.get(s.node, 0) + 1
    for m in moves:
        left[m.src] -= 1
    held = {n.id for n in nodes
            if shares.milli(n.gpus_total - n.gpus_free) > sum(shares.milli(s.gpus) for s in seats if s.node == n.id)}
    freed = sorted(n for n in used_before if left.get(n, 0) == 0 and n not in held and
                   any(m.src == n for m in moves))
    return {"moves": moves, "nodes_freed": freed, "gpus_freed": planner.free_gpus(cluster) - before}
