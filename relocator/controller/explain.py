"""The inputs of `why` (relocator/controller/why.py) gathered on the controller: the nodes as
the scheduling view sees them (free GPUs: the lower of Ray's and the records'), which of them
are lost, cordoned or not yet registered, the pending demands and the make-room planner.

Narrow: it gets the few calls it reads, not the managers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from relocator.controller.inventory import NodeInfo
from relocator.controller.model import Demand, DemandState
from relocator.controller.scheduling import NodeView
from relocator.controller.why import Ask, Explanation, NodeSnap, NodeState, explain, never_fits


def ask_of(d: Demand) -> Ask:
    return Ask(d.id, float(d.gpus), int(d.priority), float(d.since))


def snapshot(inventory: dict[str, NodeInfo], view: Iterable[NodeView], cordoned: set[str], registered: set[str],
             lost_since: dict[str, float], expected: Iterable[str] = ()) -> list[NodeSnap]:
    """Every node the controller knows: live ones with the view's free GPUs, lost ones (size
    unknown when Ray lists them without resources), and `expected` names (a deployed cluster's
    hosts) Ray does not list yet (unregistered, size unknown)."""
    free = {v.id: v.gpus_free for v in view}
    out = []
    for n in inventory.values():
        if not n.alive:
            out.append(NodeSnap(n.id, n.gpus_total or None, (), NodeState.LOST, lost_since.get(n.id)))
            continue
        state = (NodeState.CORDONED if n.id in cordoned else
                 NodeState.READY if n.id in registered else NodeState.UNREGISTERED)
        out.append(NodeSnap.whole(n.id, n.gpus_total, free.get(n.id, n.gpus_free), state))
    for name in sorted(set(expected) - set(inventory)):
        out.append(NodeSnap(name, None, (), NodeState.UNREGISTERED))
    return out


@dataclass
class Explainer:
    """`why(demand_id)` and the `why` of every pending demand in `status`."""

    demands: Callable[[], list[Demand]]  # every stored demand
    inventory: Callable[..., dict[str, NodeInfo]]
    view: Callable[[], tuple[list[NodeView], list[Any]]]
    cordoned: Callable[[], set[str]]
    registered: Callable[[], set[str]]  # nodes whose agent has reported
    lost_since: Callable[[], dict[str, float]]
    plan: Callable[[Demand], dict]  # the make-room planner's seating, as a dict
    expected: Callable[[], Iterable[str]] = tuple

    def nodes(self) -> list[NodeSnap]:
        return snapshot(self.inventory(refresh=True), self.view()[0], self.cordoned(), self.registered(),
                        self.lost_since(), self.expected())

    def explain(self, demand: Demand, stored: list[Demand], nodes: list[NodeSnap]) -> Explanation:
        by_id = {d.id: d for d in stored}
        by_id.setdefault(demand.id, demand)
        pending = [ask_of(d) for d in stored if d.state == DemandState.PENDING]
        return explain(ask_of(demand), nodes, pending, lambda a: self.plan(by_id[a.id]))

    def why(self, demand_id: str) -> dict:
        """Why `demand_id` waits (KeyError: no such demand)."""
        stored = self.demands()
        d = next((d for d in stored if d.id == demand_id), None)
        if d is None:
            raise KeyError(f"unknown demand {demand_id!r} (pending: {', '.join(x.id for x in stored) or 'none'})")
        e = self.explain(d, stored, self.nodes()).to_dict()
        return {**e, "state": d.state.value, "reason": d.reason}

    def annotate(self, pending: list[dict]) -> list[dict]:
        """`pending` (Demand summaries) each with its `why`; an explanation that fails says so
        there and never fails the status."""
        if not pending:
            return pending
        stored = self.demands()
        by_id = {d.id: d for d in stored}
        try:
            nodes = self.nodes()
        except Exception as exc:  # noqa: BLE001 - status must answer
            return [{**p, "why": {"error": f"{type(exc).__name__}: {exc}"}} for p in pending]
        out = []
        for p in pending:
            d = by_id.get(p["id"])
            try:
                why = self.explain(d, stored, nodes).to_dict() if d is not None else {"error": "gone"}
            except Exception as exc:  # noqa: BLE001
                why = {"error": f"{type(exc).__name__}: {exc}"}
            out.append({**p, "why": why})
        return out

    def refusal(self, gpus: float) -> str | None:
        """Why a launch of `gpus` can never fit on this cluster (None: it may)."""
        return never_fits(gpus, self.nodes())
