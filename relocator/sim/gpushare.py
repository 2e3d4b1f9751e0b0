"""GPU sharing in the replay (issue 31): the fragmentation figures of a run, and the moves of
fractional pods that pack shares onto fewer GPUs (mode ``moves+pack``).

**Fragmented GPUs** (the FGD authors' measure, Weng et al., ATC '23, their simulator's
``NodeGpuShareFragAmountScore`` summed over the nodes): for each node and each shape of the
target workload (``TypicalPods``: the shapes covering 95% of the pod list, CPU-only pods
included, as their experiments run), the free GPU share that a pod of that shape could not use
there: all of the node's free GPU share if the shape does not fit the node at all (too few GPUs
with enough free share, too little CPU, a wrong GPU model, or a CPU-only shape, which uses no
GPU), else the free share on the GPUs too small for it; weighted by the shape's frequency and
summed over shapes and nodes, in GPUs. ``frag_gpus_mean`` is its mean over the measured window
(the series' samples in it: a uniform grid, so a time mean); ``frag_gpus_gpu_mean`` leaves out
the CPU-only shapes' part (their frequency x the free GPUs: no move changes it at a given
allocation). **Nodes with all GPUs free**: nodes with GPUs none of which holds anything,
``free_nodes_mean`` likewise.

**Packing** (``moves+pack``): every ``pack_every_s`` simulated seconds and each time the budget
bucket gains a whole move (:func:`on_arrival`), within the same budget bucket as the moves that
seat a blocked head (:mod:`relocator.sim.replay`), ``planner.pack_shares`` (the planner code
the controller's ``consolidate`` uses for shares) empties partly used GPUs onto other nodes'
partly used GPUs, so that whole GPUs come free, picked by FGD's score against the trace's
target shapes (the GPU whose emptying lowers fragmentation most, each share where it falls most;
planner/fall.py); nodes held for a head's plan neither give nor receive. Its moves are flights
like any other: each moved pod frozen for its blackout, source and destination both held until
done.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

from relocator.planner.cluster import MILLI, Move, Plan
from relocator.planner.policies import cluster_fragmentation_milli

#: the `a` of a replay's _TICK event that is a packing round (0: a consolidation round)
PACK_TICK = 1
#: the series keys this module adds to a replay's samples
SERIES_KEYS = ("frag_gpus", "frag_gpus_gpu", "free_nodes")


def sample(r: Any) -> dict[str, float]:
    """This instant's figures of the replay `r` (a `Replay`)."""
    c, typ = r.cluster, r.typical
    frag = cluster_fragmentation_milli(c, typ) / MILLI
    cpu_share = float(typ.freq[typ.gpu_milli == 0].sum()) if len(typ) else 0.0
    free = float(c.gpu_left.sum()) / MILLI
    whole_free = (c.num_gpus > 0) & (c.gpu_left == c.gpu_cap).all(axis=1)
    return {"frag_gpus": frag, "frag_gpus_gpu": frag - cpu_share * free, "free_nodes": float(whole_free.sum())}


def summary(r: Any) -> dict[str, float | None]:
    """Means over the measured window of the sampled figures, and at its end (the last sample
    in it)."""
    t = np.array(r.series.get("t", []), dtype=np.float64)
    inside = (t >= r.w0) & (t <= r.w1)
    out: dict[str, float | None] = {}
    for k in SERIES_KEYS:
        v = np.array(r.series.get(k, []), dtype=np.float64)
        if len(v) != len(t) or not inside.any():
            out[f"{k}_mean"] = out[f"{k}_end"] = None
            continue
        out[f"{k}_mean"] = round(float(v[inside].mean()), 2)
        out[f"{k}_end"] = round(float(v[inside][-1]), 2)
    out["frag_samples"] = int(inside.sum())
    return out


def pack_tick(r: Any) -> None:
    """One packing round of the replay `r`: at most ``pack_moves`` moves (and no more than the
    budget's tokens), on nodes no head's plan holds."""
    from relocator.planner import pack_shares  # the controller's planner code for shares

    k = min(int(r.cfg.pack_moves), int(math.floor(r._tokens())))
    if k <= 0:
        return
    held = [r.cluster.node_ids[i] for i in r.held]
    plan = pack_shares(r.cluster, max_moves=k, exclude=held, typical=r.typical)  # FGD's score, the measure reported
    moves = independent(plan.moves, busy=lambda wid: r.by_id[wid].busy, held=set(held))
    if moves:
        r._begin_moves(Plan(moves), None)
        r.pack_moves += len(moves)


def on_arrival(r: Any) -> None:
    """A packing round of the replay `r` each time its budget bucket gains a whole move (every
    100 / budget arrivals), beside the rounds every ``pack_every_s``: the rounds follow the
    arrivals whatever the trace's time scale (at load 1.0 gpushare80 brings a pass of 8,152
    arrivals in ~5 simulated seconds, gpushare40 in ~214: rounds by time alone were 2 or 3 in
    the one's window and ~100 in the other's)."""
    whole = int(math.floor(r._tokens()))
    if whole > r.pack_seen:
        pack_tick(r)
        whole = int(math.floor(r._tokens()))
    r.pack_seen = whole


def independent(moves: Sequence[Move], busy: Callable[[str], bool], held: set[str]) -> tuple[Move, ...]:
    """The moves of a plan that can run at once: a flight holds every source until the slowest
    move is done, so a move onto a node that an earlier move of the plan leaves (planned on the
    CPU, memory or GPU share that one frees) is dropped, as is a move of a busy pod or off a
    held node."""
    keep: list[Move] = []
    left: set[str] = set()  # sources of the plan's moves so far (kept or not)
    for m in moves:
        ok = not busy(m.workload) and m.src not in held and m.dst not in left
        left.add(m.src)
        if ok:
            keep.append(m)
    return tuple(keep)
