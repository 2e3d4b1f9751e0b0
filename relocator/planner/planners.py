"""Planners: place, defragment, evacuate, consolidate.

Every function takes the cluster state and returns a :class:`Plan`; none of them changes the
cluster it is given (they try moves and undo them). :func:`apply_plan` executes a plan step by
step, each step checked, so that no node is ever over capacity.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

from relocator.planner.cluster import Cluster, Move, Placement, Plan, PlannerError, Workload
from relocator.planner.policies import Policy, get_policy

DEFAULT_POLICY = "fgd"


def _policy(policy: str | Policy) -> Policy:
    return get_policy(policy)


def place(
    cluster: Cluster,
    workload: Workload,
    policy: str | Policy = DEFAULT_POLICY,
    rng: np.random.Generator | None = None,
    exclude: Sequence[str] = (),
) -> Placement | None:
    """Where the policy would start ``workload`` now, without moving anything (``None``: no node
    has room). Nodes in ``exclude`` are not considered."""
    pol = _policy(policy)
    mask = None
    if exclude:
        mask = np.ones(cluster.num_nodes, dtype=bool)
        for nid in exclude:
            mask[cluster.node_index(nid)] = False
    return pol.select(cluster, workload, rng=rng, mask=mask)


def apply_plan(cluster: Cluster, plan: Plan, workload: Workload | None = None, check: bool = False) -> None:
    """Apply ``plan`` to ``cluster`` in place: each move in order (each validated), then start
    ``workload`` at ``plan.placement`` if both are given. ``check`` re-verifies all books after
    every step (slow; for tests)."""
    for mv in plan.moves:
        cur = cluster.placement_of(mv.workload)
        if cur.node != mv.src:
            raise PlannerError(f"plan is stale: {mv.workload!r} runs on {cur.node!r}, not {mv.src!r}")
        cluster.move(mv.workload, mv.dst, mv.gpus)
        if check:
            cluster.check()
    if workload is not None and plan.placement is not None:
        cluster.add(workload, plan.placement.node, plan.placement.gpus)
        if check:
            cluster.check()


class _Trial:
    """Apply moves tentatively and undo them in reverse order."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.done: list[tuple[Move, Placement]] = []

    def move(self, wid: str, dst: str, gpus: tuple[int, ...]) -> Move:
        before = self.cluster.placement_of(wid)
        mv = self.cluster.move(wid, dst, gpus)
        self.done.append((mv, before))
        return mv

    def undo(self) -> None:
        while self.done:
            mv, before = self.done.pop()
            self.cluster.move(mv.workload, before.node, before.gpus)


def _fits_after_removal(w: Workload, base: tuple[int, int, list[int]], items: Sequence[tuple[int, int, list[int]]]) -> bool:
    """Would ``w`` fit on a node with free ``base`` = (cpu, mem, per-GPU milli) once the
    workloads ``items`` (cpu, mem, per-GPU use) have left it? Plain Python: called in loops on
    a handful of small lists."""
    cpu = base[0] + sum(it[0] for it in items)
    if cpu < w.cpu_milli:
        return False
    mem = base[1] + sum(it[1] for it in items)
    if mem < w.memory_mib:
        return False
    if w.num_gpu == 0:
        return True
    left = list(base[2])
    for it in items:
        for g, u in enumerate(it[2]):
            if u:
                left[g] += u
    return sum(1 for x in left if x >= w.gpu_milli) >= w.num_gpu


def defragment(
    cluster: Cluster,
    workload: Workload,
    max_moves: int = 2,
    policy: str | Policy = DEFAULT_POLICY,
    rng: np.random.Generator | None = None,
    max_candidates: int = 16,
    max_sets: int = 4000,
) -> Plan | None:
    """The cheapest set of moves of running workloads after which ``workload`` fits: fewest
    moves, then fewest bytes. Returns a plan with no moves if it fits already, ``None`` if no
    plan within ``max_moves`` exists (among the ``max_candidates`` cheapest victim sets, of at
    most ``max_sets`` enumerated, per move count).

    The moved workloads leave one target node, each going (by ``policy``) to another node where
    it fits without further moves; ``workload`` is then placed on the target node. Each move is
    valid on its own, in order."""
    pol = _policy(policy)
    direct = pol.select(cluster, workload, rng=rng)
    if direct is not None:
        return Plan((), workload.id, direct)
    if max_moves <= 0:
        return None
    sl = cluster._slots
    # nodes whose capacity could ever hold the workload
    static = (cluster.cpu_cap >= workload.cpu_milli) & (cluster.mem_cap >= workload.memory_mib)
    if workload.num_gpu:
        static &= (cluster.num_gpus >= workload.num_gpu) & cluster.model_ok(workload)
    if not static.any():
        return None
    live = np.nonzero((sl.node >= 0) & sl.reloc)[0]
    live = live[static[sl.node[live]]]
    if len(live) == 0:
        return None

    movable: dict[int, bool] = {}

    def can_leave(s: int) -> bool:
        """Does the workload in slot ``s`` fit on some other node right now?"""
        if s not in movable:
            w = cluster._workloads[s]
            assert w is not None
            feas = cluster.feasible(w)
            feas[int(sl.node[s])] = False
            movable[s] = bool(feas.any())
        return movable[s]

    # ---- one move, vectorised over all running workloads
    nodes = sl.node[live]
    ok = (cluster.cpu_left[nodes] + sl.cpu[live] >= workload.cpu_milli) & (
        cluster.mem_left[nodes] + sl.mem[live] >= workload.memory_mib
    )
    if workload.num_gpu:
        left = cluster.gpu_left[nodes] + sl.use[live]
        ok &= (left >= workload.gpu_milli).sum(axis=1) >= workload.num_gpu
    cands1 = live[ok]
    if len(cands1):
        order = np.lexsort((cands1, sl.use[cands1].sum(axis=1), sl.nbytes[cands1]))
        sets: list[list[int]] = []
        for s in cands1[order][: 4 * max_candidates].tolist():
            if can_leave(s):
                sets.append([s])
                if len(sets) >= max_candidates:
                    break
        plan = _try_sets(cluster, workload, pol, rng, sets)
        if plan is not None:
            return plan

    # ---- k >= 2 moves: enumerate minimal sets per node, pruned
    if max_moves < 2:
        return None
    by_node: dict[int, list[int]] = {}
    for s in live.tolist():
        by_node.setdefault(int(sl.node[s]), []).append(s)
    item = {s: (int(sl.cpu[s]), int(sl.mem[s]), sl.use[s].tolist()) for s in live.tolist()}
    base = {n: (int(cluster.cpu_left[n]), int(cluster.mem_left[n]), cluster.gpu_left[n].tolist()) for n in by_node}
    for k in range(2, max_moves + 1):
        sets3: list[tuple[int, int, list[int]]] = []
        budget = max_sets
        for node, slots in by_node.items():
            if len(slots) < k:
                continue
            b = base[node]
            if not _fits_after_removal(workload, b, [item[s] for s in slots]):
                continue
            slots = [s for s in slots if can_leave(s)]
            for combo in itertools.combinations(slots, k):
                budget -= 1
                if budget < 0:
                    break
                its = [item[c] for c in combo]
                if not _fits_after_removal(workload, b, its):
                    continue
                # minimal sets only: every member is needed
                if any(_fits_after_removal(workload, b, its[:j] + its[j + 1 :]) for j in range(k)):
                    continue
                cost = sum(int(sl.nbytes[c]) for c in combo)
                gm = sum(sum(item[c][2]) for c in combo)
                sets3.append((cost, gm, list(combo)))
            if budget < 0:
                break
        if not sets3:
            continue
        sets3.sort(key=lambda t: (t[0], t[1], t[2]))
        plan = _try_sets(cluster, workload, pol, rng, [c for _, _, c in sets3[:max_candidates]])
        if plan is not None:
            return plan
    return None


def _try_sets(
    cluster: Cluster, workload: Workload, pol: Policy, rng: np.random.Generator | None, sets: list[list[int]]
) -> Plan | None:
    sl = cluster._slots
    for victims in sets:
        node = int(sl.node[victims[0]])
        trial = _Trial(cluster)
        moves: list[Move] = []
        try:
            mask = np.ones(cluster.num_nodes, dtype=bool)
            mask[node] = False
            ok = True
            # largest first: they are the hardest to place
            for s in sorted(victims, key=lambda x: -int(sl.use[x].sum())):
                w = cluster._workloads[s]
                assert w is not None
                dst = pol.select(cluster, w, rng=rng, mask=mask)
                if dst is None:
                    ok = False
                    break
                moves.append(trial.move(w.id, dst.node, dst.gpus))
            if not ok:
                continue
            only = np.zeros(cluster.num_nodes, dtype=bool)
            only[node] = True
            final = pol.select(cluster, workload, rng=rng, mask=only)
            if final is None:
                continue
            return Plan(tuple(moves), workload.id, final)
        finally:
            trial.undo()
    return None


def evacuate(
    cluster: Cluster,
    node_id: str,
    policy: str | Policy = DEFAULT_POLICY,
    rng: np.random.Generator | None = None,
    exclude: Sequence[str] = (),
) -> Plan:
    """Moves that empty ``node_id`` onto the rest of the cluster (not onto nodes in
    ``exclude``). Raises :class:`PlannerError` naming the workload that cannot go anywhere."""
    pol = _policy(policy)
    ni = cluster.node_index(node_id)
    mask = np.ones(cluster.num_nodes, dtype=bool)
    mask[ni] = False
    for nid in exclude:
        mask[cluster.node_index(nid)] = False
    ws = sorted(cluster.workloads_on(node_id), key=lambda w: (-w.total_gpu_milli, -w.cpu_milli, w.id))
    for w in ws:
        if not w.relocatable:
            raise PlannerError(f"cannot evacuate {node_id!r}: workload {w.id!r} is not relocatable")
    trial = _Trial(cluster)
    moves: list[Move] = []
    try:
        for w in ws:
            dst = pol.select(cluster, w, rng=rng, mask=mask)
            if dst is None:
                raise PlannerError(f"cannot evacuate {node_id!r}: workload {w.id!r} fits on no other node")
            moves.append(trial.move(w.id, dst.node, dst.gpus))
    finally:
        trial.undo()
    return Plan(tuple(moves))


def consolidate(
    cluster: Cluster,
    max_moves: int,
    policy: str | Policy = "best-fit",
    rng: np.random.Generator | None = None,
) -> Plan:
    """Free whole nodes while the cluster runs: evacuate the least-loaded nodes onto nodes that
    are already in use, as long as the total number of moves stays within ``max_moves``.
    Nodes holding a non-relocatable workload are left alone."""
    pol = _policy(policy)
    sl = cluster._slots
    trial = _Trial(cluster)
    moves: list[Move] = []
    freed: set[int] = set()
    try:
        counts = np.bincount(sl.node[sl.node >= 0], minlength=cluster.num_nodes)
        used_gpu = (cluster.gpu_cap - cluster.gpu_left).sum(axis=1)
        candidates = [int(n) for n in np.lexsort((used_gpu, counts)) if counts[n] > 0]
        for n in candidates:
            ws = cluster.workloads_on(cluster.node_ids[n])
            if not ws or len(moves) + len(ws) > max_moves or any(not w.relocatable for w in ws):
                continue
            in_use = np.bincount(sl.node[sl.node >= 0], minlength=cluster.num_nodes) > 0
            mask = in_use.copy()
            mask[n] = False
            for f in freed:
                mask[f] = False
            mark = len(trial.done)
            ok = True
            for w in sorted(ws, key=lambda w: (-w.total_gpu_milli, -w.cpu_milli, w.id)):
                dst = pol.select(cluster, w, rng=rng, mask=mask)
                if dst is None:
                    ok = False
                    break
                trial.move(w.id, dst.node, dst.gpus)
            if ok:
                moves.extend(mv for mv, _ in trial.done[mark:])
                freed.add(n)
            else:
                while len(trial.done) > mark:
                    mv, before = trial.done.pop()
                    cluster.move(mv.workload, before.node, before.gpus)
    finally:
        trial.undo()
    return Plan(tuple(moves))
