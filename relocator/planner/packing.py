"""Packing GPU shares: moves that empty partly used GPUs onto other partly used GPUs, so that
whole GPUs come free (a 4-GPU job needs 4 whole ones; four 0.25 shares on four GPUs block it).

Used after :func:`consolidate` (which frees whole nodes) by the controller's `consolidate`, and
by anything replaying a trace with moves of fractional pods (the same code, issue 31). Moves
are between nodes only (a live move changes the node; which GPU a share lands on is the
target's best-fit choice, `Cluster.default_gpus`, as Ray's own allocation of a fractional GPU
resource), and only onto GPUs already in use: a whole free GPU is never broken into.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from relocator.planner.cluster import MILLI, Cluster, Move, Plan, Workload
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


def _target(cluster: Cluster, w: Workload, src: int, mask: np.ndarray) -> tuple[int, tuple[int, ...]] | None:
    """The node (not `src`) whose best-fit GPU for `w` is one already in use, least left after."""
    best: tuple[int, int, tuple[int, ...]] | None = None
    for n in np.nonzero(cluster.feasible(w) & mask)[0]:
        n = int(n)
        if n == src:
            continue
        gpus = cluster.default_gpus(w, n)
        left = int(cluster.gpu_left[n, gpus[0]])
        if left >= MILLI:  # its best fit is a whole free GPU: not broken into
            continue
        key = (left - w.gpu_milli, n)
        if best is None or key < (best[0], best[1]):
            best = (key[0], n, gpus)
    return None if best is None else (best[1], best[2])


def pack_shares(cluster: Cluster, max_moves: int, exclude: Sequence[str] = ()) -> Plan:
    """Moves (at most `max_moves`) that each free one more whole GPU: the partly used GPU with
    the fewest shares (then fewest bytes, then least used) is emptied onto other nodes' partly
    used GPUs, best fit, as long as all of its shares find room. Nodes in `exclude` receive
    nothing. The cluster is left as it was given."""
    mask = np.ones(cluster.num_nodes, dtype=bool)
    for nid in exclude:
        mask[cluster.node_index(nid)] = False
    trial = Trial(cluster)
    moves: list[Move] = []
    tried: set[tuple[int, int]] = set()
    try:
        while len(moves) < max_moves:
            moved = {mv.workload for mv in moves}  # a share moves once per plan
            cands = [(len(ws), sum(w.move_cost_bytes for w in ws), MILLI - int(cluster.gpu_left[n, g]), n, g, ws)
                     for n, g, ws in _share_gpus(cluster)
                     if (n, g) not in tried and not any(w.id in moved for w in ws)]
            if not cands:
                break
            *_, n, g, ws = min(cands, key=lambda c: c[:5])
            tried.add((n, g))
            if len(moves) + len(ws) > max_moves:
                continue
            mark = len(trial.done)
            ok = True
            for w in sorted(ws, key=lambda w: (-w.gpu_milli, w.id)):
                dst = _target(cluster, w, n, mask)
                if dst is None:
                    ok = False
                    break
                trial.move(w.id, cluster.node_ids[dst[0]], dst[1])
            if ok:
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
