"""Packing GPU shares: moves that empty partly used GPUs onto other partly used GPUs, so that
whole GPUs come free (a 4-GPU job needs 4 whole ones; four 0.25 shares on four GPUs block it).

Used after :func:`consolidate` (which frees whole nodes) by the controller's `consolidate`, and
by anything replaying a trace with moves of fractional pods (the same code, issue 31). Moves
are between nodes only (a live move changes the node; which GPU a share lands on is the
target's best-fit choice, `Cluster.default_gpus`, as Ray's own allocation of a fractional GPU
resource), and only onto GPUs already in use: a whole free GPU is never broken into. Which GPU
is emptied and where each share goes is FGD's score: the fall in fragmentation at Ray's GPUs
(`relocator/planner/fall.py`).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from relocator.planner.cluster import MILLI, Cluster, Move, Plan, Workload
from relocator.planner.fall import fall, node_frag, target_shapes
from relocator.planner.policies import TypicalPods, fragmentation
from relocator.planner.trial import Trial


def _share_gpus(cluster: Cluster) -> list[tuple[int, int, list[Workload]]]:
    """(node, gpu, its shares) of every partly used GPU that holds only relocatable shares."""
    sl = cluster._slots
    by_gpu: dict[tuple[int, int], list[Workload]] = {}
    blocked: set[tuple[int, int]] = set()
    for s in cluster._live_slots():
        w = cluster._workloads[s]
        node = int(sl.node[s])
        for g in np.nonzero(sl.use[s])[0]:
            if w is None or not w.is_gpu_share or not w.relocatable:
                blocked.add((node, int(g)))
            else:
                by_gpu.setdefault((node, int(g)), []).append(w)
    return [(n, g, ws) for (n, g), ws in sorted(by_gpu.items()) if (n, g) not in blocked]


def _dests(cluster: Cluster, w: Workload, mask: np.ndarray, typical: TypicalPods) -> tuple[np.ndarray, np.ndarray]:
    """Nodes `w` may move to (in `mask`, where Ray's GPU for it is one already in use: a whole
    free GPU is never broken into), best first: the largest fall in fragmentation (whole
    milli-GPU), then the least left on that GPU after (best fit), then the first node; and
    those falls."""
    nodes = np.nonzero(cluster.feasible(w) & mask)[0]
    if not len(nodes):
        return nodes, np.zeros(0)
    f, take = fall(cluster, w, nodes, typical)
    left = np.where(take, cluster.gpu_left[nodes], 0).sum(axis=1)
    ok = np.isfinite(f) & (left < MILLI)
    nodes, f, left = nodes[ok], f[ok], left[ok]
    order = np.lexsort((nodes, left - w.gpu_milli, -np.round(f)))
    return nodes[order], f[order]


def _target(cluster: Cluster, w: Workload, src: int, mask: np.ndarray, typical: TypicalPods) -> int | None:
    """The best node (not `src`) for `w` by :func:`_dests`."""
    nodes, _ = _dests(cluster, w, mask, typical)
    nodes = nodes[nodes != src]
    return int(nodes[0]) if len(nodes) else None


def _estimates(cluster: Cluster, cands: list, mask: np.ndarray, typical: TypicalPods) -> list[float]:
    """Each candidate GPU's fall in fragmentation if it is emptied: its node's fall (exact) plus,
    for each share, the fall at that share's best destination other than its node (each share
    taken alone: an estimate where several go to one node; the plan's step then moves them one
    by one). -inf where a share has no destination."""
    nodes = np.array([n for n, _, _ in cands], dtype=np.int64)
    before = node_frag(cluster, nodes, typical)
    left = cluster.gpu_left[nodes].copy()
    cpu = cluster.cpu_left[nodes].copy()
    for i, (_, g, ws) in enumerate(cands):
        left[i, g] += sum(w.gpu_milli for w in ws)
        cpu[i] += sum(w.cpu_milli for w in ws)
    after = fragmentation(cpu, left, cluster.model[nodes], typical, cluster.model_codes)
    best: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}  # per share shape: its two best destinations
    out = []
    for i, (n, _, ws) in enumerate(cands):
        est = float(before[i] - after[i])
        for w in ws:
            key = (w.cpu_milli, w.memory_mib, w.gpu_milli, w.gpu_model)
            if key not in best:
                d, f = _dests(cluster, w, mask, typical)
                best[key] = (d[:2], f[:2])
            d, f = best[key]
            f = f[d != n]
            est = est + float(f[0]) if len(f) else -math.inf
        out.append(est)
    return out


def pack_shares(cluster: Cluster, max_moves: int, exclude: Sequence[str] = (),
                typical: TypicalPods | None = None) -> Plan:
    """Moves (at most `max_moves`) that each free one more whole GPU, picked by FGD's score:
    of the partly used GPUs with the fewest shares, the one whose emptying lowers
    fragmentation (FGD's measure against `typical`; by default :func:`target_shapes` of the
    running workloads) the most, then the fewest bytes, then the least used; each of its
    shares to the node where fragmentation falls most (:func:`_dests`), as long as all of them
    find room and the step lowers fragmentation at all. Nodes in `exclude` receive nothing.
    The cluster is left as it was given."""
    if typical is None:
        typical = target_shapes(cluster, cluster.running())
    mask = np.ones(cluster.num_nodes, dtype=bool)
    for nid in exclude:
        mask[cluster.node_index(nid)] = False
    trial = Trial(cluster)
    moves: list[Move] = []
    tried: set[tuple[int, int]] = set()
    try:
        while len(moves) < max_moves:
            moved = {mv.workload for mv in moves}  # a share moves once per plan
            cands = [(n, g, ws) for n, g, ws in _share_gpus(cluster)
                     if (n, g) not in tried and not any(w.id in moved for w in ws)
                     and len(moves) + len(ws) <= max_moves]
            if not cands:
                break
            fewest = min(len(ws) for _, _, ws in cands)
            cands = [c for c in cands if len(c[2]) == fewest]
            est = _estimates(cluster, cands, mask, typical)
            keyed = [(-round(e), sum(w.move_cost_bytes for w in ws), MILLI - int(cluster.gpu_left[n, g]), n, g, i)
                     for i, (e, (n, g, ws)) in enumerate(zip(est, cands)) if e > 0.5]
            if not keyed:  # no GPU of this many shares helps: try those with more
                tried.update((n, g) for n, g, _ in cands)
                continue
            *_, n, g, i = min(keyed)
            ws = cands[i][2]
            tried.add((n, g))
            mark = len(trial.done)
            f0 = float(node_frag(cluster, np.arange(cluster.num_nodes), typical).sum())
            ok = True
            for w in sorted(ws, key=lambda w: (-w.gpu_milli, w.id)):
                dst = _target(cluster, w, n, mask, typical)
                if dst is None:
                    ok = False
                    break
                trial.move(w.id, cluster.node_ids[dst], cluster.default_gpus(w, dst))
            if ok and float(node_frag(cluster, np.arange(cluster.num_nodes), typical).sum()) < f0 - 0.5:
                moves.extend(mv for mv, _ in trial.done[mark:])
                tried.clear()  # room changed: a GPU that found none before may find some now
            else:
                trial.undo(to=mark)
    finally:
        trial.undo()
    return Plan(tuple(moves))


def free_gpus(cluster: Cluster) -> int:
    """Whole GPUs nothing uses."""
    return int((cluster.gpu_left >= MILLI).sum())
