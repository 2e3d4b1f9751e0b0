"""Tentative moves on a `Cluster`, undone in reverse order (the planners' and the gain's trials)."""

from __future__ import annotations

from relocator.planner.cluster import Cluster, Move, Placement


class Trial:
    """Apply moves tentatively and undo them in reverse order."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.done: list[tuple[Move, Placement]] = []

    def move(self, wid: str, dst: str, gpus: tuple[int, ...]) -> Move:
        before = self.cluster.placement_of(wid)
        mv = self.cluster.move(wid, dst, gpus)
        self.done.append((mv, before))
        return mv

    def undo(self, to: int = 0) -> None:
        """Undo the moves made after the first `to` (all of them by default)."""
        while len(self.done) > to:
            mv, before = self.done.pop()
            self.cluster.move(mv.workload, before.node, before.gpus)
