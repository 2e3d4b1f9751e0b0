"""Actions: what a policy does about a firing. Each is a pydantic model of its own args with
`plan(firing, workers, ctx)`, the steps it would take (pure: the engine's dry run prints them,
its runner carries them out). Registered by kind in ACTIONS (an explicit table)."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from relocator.policies.base import Context, Firing, Step

RUNNING = "running"


def affected(firing: Firing, workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The running workers a firing is about: those on its GPU, else on its node, else all."""
    out = [w for w in workers if w.get("state") == RUNNING]
    if firing.node is not None:
        out = [w for w in out if w.get("node") == firing.node]
    if firing.gpu is not None:
        out = [w for w in out if firing.gpu in (w.get("gpu_ids") or [])]
    return out


def room(ctx: Context, leaving: str | None) -> dict[str, float]:
    """Free GPUs on every node a worker may go to (alive, not cordoned, not the one left)."""
    return {n: float(v.get("gpus_free") or 0) for n, v in sorted(ctx.nodes.items())
            if n != leaving and v.get("alive", True) and not v.get("cordoned")}


def best_fit(free: dict[str, float], gpus: float) -> str | None:
    """The node with the least room that still fits (packs; keeps big holes for big workers)."""
    fits = [(left, n) for n, left in free.items() if left >= gpus]
    return min(fits)[1] if fits else None


def evacuation(firing: Firing, workers: list[dict[str, Any]], ctx: Context, parallel: int,
               suspend_if_no_room: bool) -> list[Step]:
    """Every affected worker moved once (the fewest moves), highest priority first, `parallel`
    at a time; what fits nowhere is suspended. Each step says whether it is expected to finish
    before the firing's deadline (moves of one wave run side by side: independent workers)."""
    todo = sorted(affected(firing, workers), key=lambda w: (-int(w.get("priority") or 0), -float(w.get("gpus") or 0),
                                                          w["id"]))
    free = room(ctx, firing.node)
    steps: list[Step] = []
    for w in todo:
        dst = best_fit(free, float(w.get("gpus") or 0))
        prio = int(w.get("priority") or 0)
        if dst is None:
            if suspend_if_no_room:
                steps.append(Step("suspend", worker=w["id"], node=w.get("node"), priority=prio))
            continue
        free[dst] -= float(w.get("gpus") or 0)
        steps.append(Step("move", worker=w["id"], node=w.get("node"), to=dst, priority=prio))
    if firing.deadline is not None:
        for i, s in enumerate(steps):
            ends = ctx.now + (math.floor(i / max(1, parallel)) + 1) * ctx.move_s
            s.fits_deadline = ends <= firing.deadline
    return steps


class _Action(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def plan(self, firing: Firing, workers: list[dict[str, Any]], ctx: Context) -> list[Step]:  # pragma: no cover
        raise NotImplementedError


class MoveAction(_Action):
    """Live moves off the firing's GPU or node (a failed GPU's worker is replaced instead: from
    its warm image, its streams continued). A node's firing cordons it first."""

    kind: Literal["move"]
    parallel: int = Field(4, ge=1, le=64)
    transfer: str | None = None  # a TransferMode; None: the controller's
    suspend_if_no_room: bool = True

    def plan(self, firing: Firing, workers: list[dict[str, Any]], ctx: Context) -> list[Step]:
        if firing.severity == "failed":
            return [Step("replace", worker=w["id"], node=w.get("node"), priority=int(w.get("priority") or 0))
                    for w in affected(firing, workers)]
        steps = evacuation(firing, workers, ctx, self.parallel, self.suspend_if_no_room)
        if firing.node is not None and firing.gpu is None:
            steps.insert(0, Step("cordon", node=firing.node, args={"until": firing.until or firing.deadline}))
        return steps


class SuspendAction(_Action):
    """Checkpoint the affected workers to the image store (they resume elsewhere later)."""

    kind: Literal["suspend"]

    def plan(self, firing: Firing, workers: list[dict[str, Any]], ctx: Context) -> list[Step]:
        return [Step("suspend", worker=w["id"], node=w.get("node"), priority=int(w.get("priority") or 0))
                for w in affected(firing, workers)]


class ConsolidateAction(_Action):
    """Pack the running workers onto fewer nodes with live moves (at most `max_moves`)."""

    kind: Literal["consolidate"]
    max_moves: int = Field(4, ge=1, le=64)

    def plan(self, firing: Firing, workers: list[dict[str, Any]], ctx: Context) -> list[Step]:
        return [Step("consolidate", args={"max_moves": self.max_moves})]


class PrefetchImageAction(_Action):
    """Copy the warm image of each affected worker's kind to `nodes` (all live nodes when
    empty; relocator/controller/warmcopies.py), so a later start there is a restore."""

    kind: Literal["prefetch-image"]
    nodes: list[str] = Field(default_factory=list)

    def plan(self, firing: Firing, workers: list[dict[str, Any]], ctx: Context) -> list[Step]:
        kinds = {(w.get("model"), w.get("engine")): w for w in workers if w.get("state") == RUNNING}
        targets = self.nodes or [n for n, v in sorted(ctx.nodes.items()) if v.get("alive", True)]
        return [Step("prefetch", worker=w["id"], to=n) for w in kinds.values() for n in targets
                if n != w.get("node")]


class CordonAction(_Action):
    """Nothing new placed on the firing's node (until the window's end, if it has one)."""

    kind: Literal["cordon"]

    def plan(self, firing: Firing, workers: list[dict[str, Any]], ctx: Context) -> list[Step]:
        return [Step("cordon", node=firing.node, args={"until": firing.until or firing.deadline})] if firing.node else []


ACTIONS = (MoveAction, SuspendAction, ConsolidateAction, PrefetchImageAction, CordonAction)
#: the steps that count against a policy's moves-per-hour budget
BUDGETED = frozenset({"move", "replace", "suspend", "consolidate"})
