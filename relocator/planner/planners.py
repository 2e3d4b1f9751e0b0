"""Planners: place, defragment, evacuate, consolidate.

Every function takes the cluster state and returns a :class:`Plan`; none of them changes the
cluster it is given (they try moves and undo them). :func:`apply_plan` executes a plan step by
step, each step checked, so that no node is ever over capacity.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from relocator.planner.cluster import MILLI, Cluster, Move, Placement, Plan, PlannerError, Workload
from relocator.planner.gain import plan_gain_milli, usable_gpu_milli  # noqa: F401 - re-exported
from relocator.planner.policies import Policy, get_policy
from relocator.planner.trial import Trial as _Trial

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
    victim_policy: str | Policy | None = "best-fit",
    allowed: np.ndarray | None = None,
) -> Plan | None:
    """The cheapest set of moves of running workloads after which ``workload`` fits: fewest
    moves, then fewest bytes. Returns a plan with no moves if it fits already, ``None`` if no
    plan within ``max_moves`` exists (among the ``max_candidates`` cheapest victim sets).

    One move: every running workload whose departure would make room is considered at once
    (vectorised). Two or more: :func:`victim_sets` picks, per node, the fewest workloads that
    clear enough GPU share, CPU and memory, nodes visited by a vectorised lower bound.
    The moved workloads leave one target node, each going (by ``victim_policy``, default
    best-fit: the fullest GPU that still fits, i.e. into other GPUs' slivers; ``None``: by
    ``policy``) to another node where it fits without further moves; ``workload`` is then placed
    on the target node by ``policy``. Each move is valid on its own, in order. ``max_sets`` is
    kept for compatibility (unused). ``allowed`` (N,) bool, optional: the only nodes the plan may
    use, as target and as destinations of the moved workloads (e.g. without nodes already
    promised to another workload); ``None``: all (the behaviour without it)."""
    pol = _policy(policy)
    direct = pol.select(cluster, workload, rng=rng, mask=allowed)
    if direct is not None:
        return Plan((), workload.id, direct)
    if max_moves <= 0:
        return None
    live = _live_slots(cluster, workload, allowed)
    if live is None:
        return None
    movable: dict[int, bool] = {}

    def can_leave(s: int) -> bool:
        """Does the workload in slot ``s`` fit on some other node right now?"""
        if s not in movable:
            w = cluster._workloads[s]
            assert w is not None
            feas = cluster.feasible(w)
            feas[int(cluster._slots.node[s])] = False
            if allowed is not None:
                feas &= allowed
            movable[s] = bool(feas.any())
        return movable[s]

    sets = _one_move_sets(cluster, workload, live, max_candidates, can_leave)
    if sets:
        plan = _try_sets(cluster, workload, pol, rng, sets, victim_policy=victim_policy, allowed=allowed)
        if plan is not None:
            return plan

    # ---- k >= 2 moves: per node, the fewest victims that clear enough GPU, CPU and memory
    if max_moves < 2:
        return None
    sets = victim_sets(cluster, workload, max_moves, max_sets=max_candidates, allowed=allowed)
    return _try_sets(cluster, workload, pol, rng, [v for _, _, _, v in sets], victim_policy=victim_policy, allowed=allowed)


def _live_slots(cluster: Cluster, workload: Workload, allowed: np.ndarray | None) -> np.ndarray | None:
    """The slots of movable running workloads on nodes whose capacity could ever hold
    ``workload`` (within ``allowed``); None if there are none."""
    sl = cluster._slots
    static = (cluster.cpu_cap >= workload.cpu_milli) & (cluster.mem_cap >= workload.memory_mib)
    if workload.num_gpu:
        static &= (cluster.num_gpus >= workload.num_gpu) & cluster.model_ok(workload)
    if allowed is not None:
        static &= allowed
    if not static.any():
        return None
    live = np.nonzero((sl.node >= 0) & sl.reloc)[0]
    live = live[static[sl.node[live]]]
    return live if len(live) else None


def _one_move_sets(cluster: Cluster, workload: Workload, live: np.ndarray, max_candidates: int,
                   can_leave: Callable[[int], bool]) -> list[list[int]]:
    """One move, vectorised over all running workloads: the cheapest single victims (fewest
    bytes, then least GPU share) whose departure makes room and that can go elsewhere."""
    sl = cluster._slots
    nodes = sl.node[live]
    ok = (cluster.cpu_left[nodes] + sl.cpu[live] >= workload.cpu_milli) & (
        cluster.mem_left[nodes] + sl.mem[live] >= workload.memory_mib
    )
    if workload.num_gpu:
        left = cluster.gpu_left[nodes] + sl.use[live]
        ok &= (left >= workload.gpu_milli).sum(axis=1) >= workload.num_gpu
    cands1 = live[ok]
    sets: list[list[int]] = []
    if len(cands1):
        order = np.lexsort((cands1, sl.use[cands1].sum(axis=1), sl.nbytes[cands1]))
        for s in cands1[order][: 4 * max_candidates].tolist():
            if can_leave(s):
                sets.append([s])
                if len(sets) >= max_candidates:
                    break
    return sets


def _slot_shapes(cluster: Cluster, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(num_gpu, gpu_milli) of the workloads in ``slots``, from the slot arrays."""
    use = cluster._slots.use[slots]
    return (use > 0).sum(axis=1), use.max(axis=1) if use.shape[1] else np.zeros(len(slots), np.int64)


def placeable_elsewhere(cluster: Cluster, slots: np.ndarray) -> np.ndarray:
    """(len(slots),) bool: could the workload in each slot start on some other node right now?
    Vectorised over distinct shapes (CPU, memory, GPU count, share) x nodes; GPU-model
    constraints are checked when a plan is tried."""
    sl = cluster._slots
    if len(slots) == 0:
        return np.zeros(0, dtype=bool)
    num, milli = _slot_shapes(cluster, slots)
    # one int64 key per shape (CPU < 2^24 milli, memory < 2^24 MiB, GPUs < 2^5, share < 2^11)
    key = (((sl.cpu[slots] << 24) | sl.mem[slots]) << 16) | (num << 11) | milli
    _, first, inv = np.unique(key, return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    shapes = np.stack([sl.cpu[slots][first], sl.mem[slots][first], num[first], milli[first]], axis=1)
    gl = cluster.gpu_left
    maxfree = gl.max(axis=1)
    whole = (gl >= MILLI).sum(axis=1)
    sc, sm, sn, sg = (shapes[:, i : i + 1] for i in range(4))
    feas = (cluster.cpu_left[None, :] >= sc) & (cluster.mem_left[None, :] >= sm)
    feas &= (sn == 0) | ((sn == 1) & (maxfree[None, :] >= sg)) | ((sn > 1) & (whole[None, :] >= sn))
    count = feas.sum(axis=1)
    own = feas[inv, sl.node[slots]]
    return (count[inv] - own) > 0


def victim_sets(
    cluster: Cluster,
    workload: Workload,
    max_moves: int,
    max_sets: int = 16,
    max_nodes: int = 256,
    allowed: np.ndarray | None = None,
) -> list[tuple[int, int, int, list[int]]]:
    """Candidate victim sets for :func:`defragment`, cheapest first: ``(moves, bytes, node,
    slots)``. For each node that could hold ``workload`` once some of its relocatable workloads
    leave, the fewest of them that free enough GPU share on ``num_gpu`` GPUs (largest occupants
    first), then enough CPU and memory (the smallest workload that covers what is missing, else
    the largest). Only workloads that could fit somewhere else at all are considered (a cheap
    vectorised test against the cluster's largest free resources; the exact test is done when
    the plan is tried). Nodes are visited by a lower bound on their move count (vectorised), so
    the search stops early. ``allowed`` (N,) bool, optional: only these nodes may be targets.
    Pure; the cluster is not changed."""
    sl = cluster._slots
    w = workload
    static = (cluster.cpu_cap >= w.cpu_milli) & (cluster.mem_cap >= w.memory_mib)
    if w.num_gpu:
        static &= (cluster.num_gpus >= w.num_gpu) & cluster.model_ok(w)
    if allowed is not None:
        static = static & allowed
    live = np.nonzero((sl.node >= 0) & sl.reloc)[0]
    if not static.any() or len(live) == 0:
        return []
    maybe = placeable_elsewhere(cluster, live)
    mv = live[maybe]
    if len(mv) == 0:
        return []
    nodes_mv = sl.node[mv]
    n_nodes = cluster.num_nodes
    cpu_f = cluster.cpu_left + np.bincount(nodes_mv, weights=sl.cpu[mv], minlength=n_nodes).astype(np.int64)
    mem_f = cluster.mem_left + np.bincount(nodes_mv, weights=sl.mem[mv], minlength=n_nodes).astype(np.int64)
    ok = static & (cpu_f >= w.cpu_milli) & (mem_f >= w.memory_mib)
    lb = (cluster.cpu_left < w.cpu_milli) | (cluster.mem_left < w.memory_mib)
    lb = lb.astype(np.int64)
    if w.num_gpu:
        gl = cluster.gpu_left
        free_f = gl.copy()
        np.add.at(free_f, nodes_mv, sl.use[mv])
        ok &= (free_f >= w.gpu_milli).sum(axis=1) >= w.num_gpu
        # GPUs that need at least one move: num_gpu minus the GPUs that already have room
        have = (gl >= w.gpu_milli).sum(axis=1)
        lb = np.maximum(lb, np.maximum(w.num_gpu - have, 0))
    cand = np.nonzero(ok)[0]
    if len(cand) == 0:
        return []
    occ = np.bincount(nodes_mv, minlength=n_nodes)
    cand = cand[np.lexsort((occ[cand], lb[cand]))][:max_nodes]
    maybe_set = set(mv.tolist())
    out: list[tuple[int, int, int, list[int]]] = []
    best = max_moves
    for n in cand.tolist():
        if lb[n] > best or (len(out) >= max_sets and lb[n] > min(o[0] for o in out)):
            break
        vs = _node_victims(cluster, w, n, maybe_set)
        if vs is None or len(vs) > max_moves:
            continue
        out.append((len(vs), int(sum(int(sl.nbytes[v]) for v in vs)), n, vs))
        if len(out) >= 4 * max_sets:
            break
    out.sort(key=lambda t: (t[0], t[1], t[2]))
    return out[:max_sets]


def _node_victims(cluster: Cluster, w: Workload, n: int, maybe: set[int]) -> list[int] | None:
    """The workloads to move off node ``n`` so that ``w`` fits there (see :func:`victim_sets`)."""
    sl = cluster._slots
    occupants = [s for s in cluster._on_node[n] if s in maybe]
    victims: list[int] = []
    chosen: set[int] = set()
    if w.num_gpu:
        left = cluster.gpu_left[n]
        per_gpu: list[tuple[int, int, list[int]]] = []
        for g in range(int(cluster.num_gpus[n])):
            need = w.gpu_milli - int(left[g])
            if need <= 0:
                per_gpu.append((0, 0, [g]))
                continue
            on_g = sorted((s for s in occupants if sl.use[s, g] > 0), key=lambda s: (-int(sl.use[s, g]), int(sl.nbytes[s])))
            take: list[int] = []
            for s in on_g:
                take.append(s)
                need -= int(sl.use[s, g])
                if need <= 0:
                    break
            if need > 0:
                continue
            per_gpu.append((len(take), int(sum(int(sl.nbytes[s]) for s in take)), take))
        if len(per_gpu) < w.num_gpu:
            return None
        per_gpu.sort(key=lambda t: (t[0], t[1]))
        for cnt, _, take in per_gpu[: w.num_gpu]:
            if cnt:
                for s in take:
                    if s not in chosen:
                        chosen.add(s)
                        victims.append(s)
    cpu = int(cluster.cpu_left[n]) + sum(int(sl.cpu[s]) for s in victims)
    mem = int(cluster.mem_left[n]) + sum(int(sl.mem[s]) for s in victims)
    rest = [s for s in occupants if s not in chosen]
    while cpu < w.cpu_milli or mem < w.memory_mib:
        dc, dm = w.cpu_milli - cpu, w.memory_mib - mem
        cover = [s for s in rest if sl.cpu[s] >= dc and sl.mem[s] >= dm]
        if cover:
            # the smallest that covers both (GPU-free workloads first: they are easiest to place)
            s = min(cover, key=lambda s: (int(sl.use[s].sum()) > 0, int(sl.cpu[s]) + int(sl.mem[s]) // 4, int(sl.nbytes[s])))
        elif rest:
            s = max(rest, key=lambda s: (max(0, min(int(sl.cpu[s]), dc)) / max(dc, 1) + max(0, min(int(sl.mem[s]), dm)) / max(dm, 1)))
        else:
            return None
        rest.remove(s)
        victims.append(s)
        cpu += int(sl.cpu[s])
        mem += int(sl.mem[s])
    return victims


def _try_sets(
    cluster: Cluster,
    workload: Workload,
    pol: Policy,
    rng: np.random.Generator | None,
    sets: list[list[int]],
    victim_policy: str | Policy | None = None,
    allowed: np.ndarray | None = None,
) -> Plan | None:
    vpol = pol if victim_policy is None else _policy(victim_policy)
    sl = cluster._slots
    for victims in sets:
        node = int(sl.node[victims[0]])
        trial = _Trial(cluster)
        moves: list[Move] = []
        try:
            mask = np.ones(cluster.num_nodes, dtype=bool) if allowed is None else np.array(allowed, dtype=bool)
            mask[node] = False
            ok = True
            # largest first: they are the hardest to place
            for s in sorted(victims, key=lambda x: -int(sl.use[x].sum())):
                w = cluster._workloads[s]
                assert w is not None
                dst = vpol.select(cluster, w, rng=rng, mask=mask)
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
                trial.undo(to=mark)
    finally:
        trial.undo()
    return Plan(tuple(moves))
