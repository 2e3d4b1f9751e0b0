"""Why a demand waits: the ordinary causes of a pending GPU job ruled out first, packing last.

Pure: a snapshot of the nodes (each GPU's free share, the node's state), the pending demands
with their priorities and a plan function in; an :class:`Explanation` out. No Ray, no store
(relocator/controller/explain.py gathers the inputs on the controller). The checks, in this
order, each with its evidence; the first that fails is the cause:

1. ``fits_at_all``: some node is big enough (GPUs for a whole-GPU request, one GPU for a
   share). Fails: it can never fit, and `launch` refuses it (:func:`never_fits`) instead of
   letting it wait forever. A node whose size is not known (lost, listed by Ray without its
   resources) keeps the answer open.
2. ``nodes``: nodes lost, not yet registered (their agent has not reported) or cordoned. Fails
   when the demand could only be seated on such nodes: no ready node is big enough, or it would
   fit now on one of them and on no ready node.
3. ``priority``: demands ahead of it in the retry order (a higher priority, or the same and
   older) that can be seated now: they are seated first, and this one is planned on what they
   leave. Demands ahead that cannot be seated either do not hold it back (listed, not the cause).
4. ``room``: free GPUs per node as a map. It fits now (the next retry seats it: cause
   ``fits_now``), or the free share would be enough in all but on no single node
   (``fragmentation``), or it is not there at all (``capacity``); with the plan that would seat
   it and its cost (moves, bytes, expected blackout), or why no plan exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from relocator.choices import Choice

EPS = 1e-6
GB = 1e9


class NodeState(Choice):
    READY = "ready"
    LOST = "lost"
    UNREGISTERED = "unregistered"  # in Ray (or configured), its agent has not reported yet
    CORDONED = "cordoned"  # drained with a deadline: nothing is placed there


class Cause(Choice):
    NEVER_FITS = "never_fits"
    NODES = "nodes"
    PRIORITY = "priority"
    FRAGMENTATION = "fragmentation"
    CAPACITY = "capacity"
    FITS_NOW = "fits_now"


@dataclass(frozen=True)
class NodeSnap:
    """One node as the explainer sees it. `gpus_total` None: size not known (a lost node);
    `free`: the free share of each GPU (1.0: the whole GPU), one entry per GPU."""

    id: str
    gpus_total: int | None
    free: tuple[float, ...] = ()
    state: NodeState = NodeState.READY
    since: float | None = None  # when it was seen lost

    @classmethod
    def whole(cls, id: str, total: int | None, free_gpus: int, state: NodeState = NodeState.READY,
              since: float | None = None) -> "NodeSnap":
        """A node of whole GPUs only: `free_gpus` of its `total` free."""
        n = total or 0
        free = max(0, min(int(free_gpus), n))
        return cls(id, total, tuple([1.0] * free + [0.0] * (n - free)), NodeState(state), since)

    @property
    def whole_free(self) -> int:
        return sum(1 for f in self.free if f >= 1.0 - EPS)

    @property
    def share_free(self) -> float:
        return float(sum(self.free))

    def fits(self, gpus: float) -> bool:
        """Whether `gpus` (a share below 1, else whole GPUs) fits on this node's free GPUs now."""
        if gpus < 1.0:
            return any(f >= gpus - EPS for f in self.free)
        return self.whole_free >= int(round(gpus))

    def big_enough(self, gpus: float) -> bool:
        """Whether this node could hold `gpus` if it were empty (False when its size is unknown)."""
        if self.gpus_total is None:
            return False
        return self.gpus_total >= (1 if gpus < 1.0 else int(round(gpus)))

    def to_dict(self) -> dict:
        return {"id": self.id, "state": self.state.value, "gpus_total": self.gpus_total,
                "free": [round(f, 4) for f in self.free], "free_gpus": self.whole_free,
                "free_share": round(self.share_free, 4), "since": self.since}


@dataclass(frozen=True)
class Ask:
    """A demand: `gpus` whole GPUs (>= 1) or a share of one (< 1)."""

    id: str
    gpus: float
    priority: int = 0
    since: float = 0.0

    def ahead_of(self, other: "Ask") -> bool:
        """Whether this demand comes before `other` in the retry order (priority, then age)."""
        return (self.priority, -self.since, other.id) > (other.priority, -other.since, self.id)

    def to_dict(self) -> dict:
        return {"id": self.id, "gpus": self.gpus, "priority": self.priority, "since": self.since}


@dataclass(frozen=True)
class BlackoutRates:
    """Expected blackout of a freeze-and-copy move of `bytes`: dump + transfer (none on shared
    storage) + restore + switch, at the CPU reference's measured rates (docs/benchmarks.md:
    dump 1.02 GB in 0.99 s, agent-to-agent stream 1 GB in 1.05 s, restore 1.02 GB in 0.60 s,
    SWITCH 4 ms). A handoff's blackout is only its SWITCH: this is the upper figure."""

    dump_bps: float = 1.03 * GB
    transfer_bps: float = 0.95 * GB
    restore_bps: float = 1.7 * GB
    switch_s: float = 0.004
    shared_storage: bool = False

    def seconds(self, nbytes: int) -> float:
        b = max(0, int(nbytes))
        t = b / self.dump_bps + b / self.restore_bps + self.switch_s
        if not self.shared_storage:
            t += b / self.transfer_bps
        return round(t, 3)


#: a plan for a demand: {"node": str | None, "how", "moves": [{"worker", "from", "to", "gpus",
#: "bytes"}], "suspends": [worker ids], "reason": why no plan (when node is None)}
PlanFn = Callable[[Ask], dict]


@dataclass
class Check:
    name: str
    ok: bool
    line: str
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"check": self.name, "ok": self.ok, "line": self.line, "evidence": self.evidence}


@dataclass
class Explanation:
    demand: Ask
    cause: Cause
    line: str
    checks: list[Check]
    nodes: list[NodeSnap]
    plan: dict | None

    def to_dict(self) -> dict:
        return {"demand": self.demand.to_dict(), "cause": self.cause.value, "line": self.line,
                "checks": [c.to_dict() for c in self.checks],
                "free": {n.id: [round(f, 4) for f in n.free] for n in self.nodes},
                "nodes": [n.to_dict() for n in self.nodes], "plan": self.plan}


def fmt_gpus(gpus: float) -> str:
    return f"a {gpus:g} share of one GPU" if gpus < 1.0 else f"{int(round(gpus))} GPU(s)"


# ---------------------------------------------------------------------------------- checks
def never_fits(gpus: float, nodes: Iterable[NodeSnap]) -> str | None:
    """Why `gpus` can never fit on any of `nodes` (every size known), or None (it may fit, or
    there is no node to judge by yet)."""
    nodes = list(nodes)
    if not nodes or any(n.gpus_total is None for n in nodes):
        return None
    if any(n.big_enough(gpus) for n in nodes):
        return None
    big = min(nodes, key=lambda n: (-(n.gpus_total or 0), n.id))  # the largest, the first by name
    if gpus < 1.0:
        return f"{fmt_gpus(gpus)} can never fit: no node has a GPU"
    return (f"{fmt_gpus(gpus)} can never fit: the largest node, {big.id}, has {big.gpus_total} "
            f"(nodes: {', '.join(f'{n.id} {n.gpus_total}' for n in sorted(nodes, key=lambda n: n.id))})")


def check_fits_at_all(ask: Ask, nodes: Sequence[NodeSnap]) -> Check:
    why = never_fits(ask.gpus, nodes)
    sizes = {n.id: n.gpus_total for n in nodes}
    if why:
        return Check("fits_at_all", False, why, {"node_gpus": sizes})
    unknown = sorted(n.id for n in nodes if n.gpus_total is None)
    line = f"some node can hold {fmt_gpus(ask.gpus)}"
    if not nodes:
        line = "no node is known yet"
    elif unknown and not any(n.big_enough(ask.gpus) for n in nodes):
        line = f"only nodes of unknown size ({', '.join(unknown)}) might hold {fmt_gpus(ask.gpus)}"
    return Check("fits_at_all", True, line, {"node_gpus": sizes})


def check_nodes(ask: Ask, nodes: Sequence[NodeSnap]) -> Check:
    ready = [n for n in nodes if n.state is NodeState.READY]
    down = [n for n in nodes if n.state is not NodeState.READY]
    evidence = {"unavailable": [{"id": n.id, "state": n.state.value, "gpus_total": n.gpus_total, "since": n.since}
                                for n in down],
                "ready": [n.id for n in ready]}
    if not down:
        return Check("nodes", True, "every node is ready", evidence)
    names = ", ".join(f"{n.id} ({n.state.value})" for n in down)
    if not any(n.big_enough(ask.gpus) for n in ready):
        return Check("nodes", False, f"no ready node can hold {fmt_gpus(ask.gpus)}; not ready: {names}", evidence)
    if not any(n.fits(ask.gpus) for n in ready) and (there := [n.id for n in down if n.fits(ask.gpus)]):
        evidence["would_fit_on"] = there
        return Check("nodes", False, f"it would fit now on {', '.join(there)}, which "
                     f"{'is' if len(there) == 1 else 'are'} not ready ({names}); on no ready node", evidence)
    return Check("nodes", True, f"not ready: {names}; ready nodes are big enough", evidence)


def check_priority(ask: Ask, pending: Sequence[Ask], plan: PlanFn, limit: int = 16) -> Check:
    ahead = sorted((d for d in pending if d.id != ask.id and d.ahead_of(ask)),
                   key=lambda d: (-d.priority, d.since, d.id))
    rows = []
    for d in ahead[:limit]:
        p = plan(d)
        rows.append({**d.to_dict(), "seatable": p.get("node") is not None, "node": p.get("node"),
                     "how": p.get("how")})
    first = [r for r in rows if r["seatable"]]
    evidence = {"ahead": rows, "ahead_total": len(ahead)}
    if not ahead:
        return Check("priority", True, "no demand is ahead of it", evidence)
    if first:
        return Check("priority", False, f"{len(first)} demand(s) ahead of it are seated first: "
                     + ", ".join(f"{r['id']} (priority {r['priority']}, {fmt_gpus(r['gpus'])}, on {r['node']})"
                                 for r in first), evidence)
    return Check("priority", True, f"{len(ahead)} demand(s) ahead of it, none of which can be seated now", evidence)


def plan_cost(p: dict, rates: BlackoutRates) -> dict:
    """The plan with its cost: moves, bytes and expected blackout (each move's, the longest: the
    moves of one plan run concurrently, each worker paused only for its own)."""
    moves = [{**m, "blackout_s": rates.seconds(int(m.get("bytes") or 0))} for m in p.get("moves") or []]
    return {**p, "moves": moves, "cost": {"moves": len(moves), "suspends": len(p.get("suspends") or []),
                                          "bytes": sum(int(m.get("bytes") or 0) for m in moves),
                                          "blackout_s_max": max((m["blackout_s"] for m in moves), default=0.0),
                                          "blackout_s_total": round(sum(m["blackout_s"] for m in moves), 3)}}


def check_room(ask: Ask, nodes: Sequence[NodeSnap], plan: PlanFn, rates: BlackoutRates) -> tuple[Check, Cause, dict]:
    ready = [n for n in nodes if n.state is NodeState.READY]
    whole = sum(n.whole_free for n in ready)
    share = round(sum(n.share_free for n in ready), 4)
    p = plan_cost(plan(ask), rates)
    evidence = {"free_gpus": whole, "free_share": share,
                "largest_free": max((n.whole_free for n in ready), default=0),
                "largest_share": round(max((max(n.free, default=0.0) for n in ready), default=0.0), 4)}
    if any(n.fits(ask.gpus) for n in ready):
        return Check("room", True, f"it fits now (free GPUs: {whole}); the next retry seats it", evidence), \
            Cause.FITS_NOW, p
    cost = p["cost"]
    if p.get("node") is not None:
        seat = (f"plan: {cost['moves']} move(s)" + (f", {cost['suspends']} suspend(s)" if cost["suspends"] else "")
                + f", {cost['bytes'] / GB:.2f} GB, expected blackout {cost['blackout_s_max']:.1f} s, then on {p['node']}")
    else:
        seat = f"no plan: {p.get('reason') or 'the planner found none'}"
    if share + EPS >= ask.gpus:
        kind, what = Cause.FRAGMENTATION, (f"fragmentation: {share:g} GPU(s) free in all ({whole} whole), "
                                           f"not {fmt_gpus(ask.gpus)} on any one "
                                           f"{'GPU' if ask.gpus < 1.0 else 'node'}")
    else:
        kind, what = Cause.CAPACITY, f"capacity: only {share:g} GPU(s) free on the ready nodes, {fmt_gpus(ask.gpus)} asked"
    return Check("room", False, f"{what}; {seat}", evidence), kind, p


# ---------------------------------------------------------------------------------- explain
def explain(ask: Ask, nodes: Sequence[NodeSnap], pending: Sequence[Ask], plan: PlanFn,
            rates: BlackoutRates | None = None) -> Explanation:
    """Why `ask` waits, the checks in the order of the module's docstring."""
    rates = rates or BlackoutRates()
    nodes = sorted(nodes, key=lambda n: n.id)
    checks = [check_fits_at_all(ask, nodes), check_nodes(ask, nodes), check_priority(ask, pending, plan)]
    room, room_cause, p = check_room(ask, nodes, plan, rates)
    checks.append(room)
    causes = {"fits_at_all": Cause.NEVER_FITS, "nodes": Cause.NODES, "priority": Cause.PRIORITY}
    failed = next((c for c in checks if not c.ok), None)
    cause = causes.get(failed.name, room_cause) if failed is not None else room_cause
    line = failed.line if failed is not None else room.line
    return Explanation(ask, cause, f"{ask.id} waits: {line}" if cause is not Cause.FITS_NOW else f"{ask.id}: {line}",
                       checks, nodes, p)
