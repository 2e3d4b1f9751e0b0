"""The trace simulator, following the FGD authors' protocol (hkust-adsl/kubernetes-scheduler-simulator,
``experiments/run_scripts``: ``-tune 1.3 -tuneseed S --shuffle-pod=true``):

1. the trace's pods, sorted by name, are shuffled with the seed (``order="shuffle"``, as in the
   authors' run scripts) or kept in submission order (``order="submission"``, by
   ``creation_time``);
2. workload tuning: pods drawn uniformly at random (same seed) from the trace are appended until
   the requested GPU would exceed ``tune_ratio`` x cluster capacity (the authors' test adds the
   per-GPU share ``gpu_milli`` of the drawn pod; we keep that quirk);
3. each pod is placed by the policy where CPU, memory and GPU fit, or fails and is dropped; no
   departures. With ``relocate``, a pod that fits nowhere triggers the defragmentation planner
   (at most ``moves_per_pod`` moves for it, ``max_moves`` in total), and its plan is carried out
   only if it is worth ``min_gain_milli`` of GPU share per move;
4. after each pod: allocated GPU vs arrived GPU demand. The figure at x% load is the mean
   allocation over the pods where arrived demand rounds to x% (the authors' analysis script).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from relocator.choices import Choice
from relocator.planner.cluster import MILLI, Cluster, NodeSpec, Plan, Workload
from relocator.planner.planners import apply_plan, defragment, plan_gain_milli, usable_gpu_milli
from relocator.planner.policies import FGDPolicy, TypicalPods, canonical_policy_name, cluster_fragmentation_milli, get_policy
from relocator.sim.trace import TracePod

ProgressFn = Callable[[int, int], None]


@dataclass
class SimResult:
    policy: str
    relocate: bool
    seed: int
    pods: int
    failed: int
    capacity_gpus: float
    alloc_pct_at_100: float
    alloc_pct_at_130: float
    unalloc_gpus_at_100: float
    unalloc_gpus_at_130: float
    frag_pct_at_end: float
    lower_bound_unalloc_gpus: float
    moves: int
    moved_gpus: float
    seconds: float
    curve_arrived_pct: list[float] = field(default_factory=list, repr=False)
    curve_alloc_pct: list[float] = field(default_factory=list, repr=False)

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("curve_arrived_pct")
        d.pop("curve_alloc_pct")
        return d


class ArrivalOrder(Choice):
    """The order the trace's pods arrive in."""

    SHUFFLE = "shuffle"  # sorted by name, then shuffled with the seed (the authors' runs)
    SUBMISSION = "submission"  # by creation_time


def build_workload(pods: Sequence[TracePod], seed: int, tune_ratio: float, capacity_milli: int, order: str = "shuffle") -> list[TracePod]:
    """Arrival sequence for one seed (steps 1-2 of the protocol)."""
    rng = np.random.default_rng(seed)
    by_name = sorted(pods, key=lambda p: p.workload.id)
    mode = ArrivalOrder(order)  # unknown: ValueError naming the orders
    if mode is ArrivalOrder.SHUFFLE:
        seq = [by_name[i] for i in rng.permutation(len(by_name))]
    elif mode is ArrivalOrder.SUBMISSION:
        seq = sorted(pods, key=lambda p: (p.creation_time, p.workload.id))
    else:  # pragma: no cover - an order added to ArrivalOrder without its sequence
        raise NotImplementedError(f"arrival order {mode}")
    if tune_ratio <= 0:
        return seq
    target = tune_ratio * capacity_milli
    total = sum(p.workload.total_gpu_milli for p in seq)
    if total > target:  # tune down: drop random pods
        seq = list(seq)
        while total > target and seq:
            p = seq.pop(int(rng.integers(len(seq))))
            total -= p.workload.total_gpu_milli
        return seq
    out = list(seq)
    i = 0
    n = len(by_name)
    while True:
        src = by_name[int(rng.integers(n))]
        if total + src.workload.gpu_milli > target:
            break
        w = src.workload
        tuned = type(w)(f"{w.id}-tuned-{i}", w.cpu_milli, w.memory_mib, w.num_gpu, w.gpu_milli, w.gpu_model, w.relocatable, w.move_cost_bytes)
        out.append(TracePod(tuned, src.creation_time))
        total += w.total_gpu_milli
        i += 1
    return out


def _locked_gpu_milli(cluster: Cluster, cpu_per_gpu: float, mem_per_gpu: float, min_share: int = 200) -> float:
    """The most idle GPU share on one node that its free CPU or memory keeps unusable."""
    gl = cluster.gpu_left
    share = np.where(gl >= min_share, gl, 0).sum(axis=1)
    usable = usable_gpu_milli(cluster, np.arange(cluster.num_nodes), cpu_per_gpu, mem_per_gpu, min_share)
    return float((share - usable).max())


def _at(arr_pct: np.ndarray, alloc_pct: np.ndarray, x: int) -> float:
    r = np.round(arr_pct)
    sel = r == x
    if not sel.any():
        sel = (r >= x - 1) & (r <= x + 1)
    if not sel.any():
        # load never reached x%: the last value
        return float(alloc_pct[-1]) if len(alloc_pct) else 0.0
    return float(alloc_pct[sel].mean())


def simulate(
    nodes: Sequence[NodeSpec],
    pods: Sequence[TracePod],
    policy: str,
    seed: int = 42,
    tune_ratio: float = 1.3,
    order: str = "shuffle",
    relocate: bool = False,
    moves_per_pod: int = 2,
    max_moves: int | None = None,
    typical: TypicalPods | None = None,
    progress: ProgressFn | None = None,
    min_gain_milli: int = 0,
) -> SimResult:
    """One run of the protocol for one policy and seed.

    ``min_gain_milli``: a relocation plan of k moves is carried out only if it is worth at least
    ``k * min_gain_milli`` of GPU share (:func:`plan_gain_milli`: the pod's own GPUs plus the GPU
    share its moves make usable or unusable by freeing or taking CPU and memory, at the trace's
    CPU and memory per GPU). 1000: about one move per GPU won; 0: every plan."""
    t0 = time.perf_counter()
    name = canonical_policy_name(policy)
    cluster = Cluster(nodes)
    cap = cluster.gpu_capacity_milli
    if typical is None:
        typical = TypicalPods.from_workloads([p.workload for p in pods])
    pol = get_policy(name, typical=typical) if name == "fgd" else get_policy(name)
    seq = build_workload(pods, seed, tune_ratio, cap, order)
    rng = np.random.default_rng(seed + 1_000_003)
    arrived = 0
    used = 0
    arr = np.zeros(len(seq), dtype=np.float64)
    alloc = np.zeros(len(seq), dtype=np.float64)
    failed = moves = moved_milli = 0
    hopeless: dict[tuple, int] = {}
    gpu_pods = [p.workload for p in pods if p.workload.num_gpu]
    tot_gpu = max(1, sum(x.total_gpu_milli for x in gpu_pods))
    cpu_per_gpu = MILLI * sum(x.cpu_milli for x in gpu_pods) / tot_gpu
    mem_per_gpu = MILLI * sum(x.memory_mib for x in gpu_pods) / tot_gpu
    step = max(1, len(seq) // 100)
    for i, tp in enumerate(seq):
        w = tp.workload
        arrived += w.total_gpu_milli
        pl = pol.select(cluster, w, rng=rng)
        if pl is not None:
            cluster.add(w, pl.node, pl.gpus)
            used += w.total_gpu_milli
        elif relocate and (max_moves is None or moves < max_moves):
            budget = moves_per_pod if max_moves is None else min(moves_per_pod, max_moves - moves)
            plan = _seat_by_moves(cluster, w, budget, pol, rng, hopeless, min_gain_milli, cpu_per_gpu, mem_per_gpu)
            if plan is not None:
                used += w.total_gpu_milli
                moves += plan.num_moves
                moved_milli += plan.moved_gpu_milli
            else:
                failed += 1
        else:
            failed += 1
        arr[i] = 100.0 * arrived / cap
        alloc[i] = 100.0 * used / cap
        if progress is not None and (i % step == 0 or i == len(seq) - 1):
            progress(i + 1, len(seq))
    return _sim_result(name, relocate, seed, cluster, typical, arr, alloc, failed, moves, moved_milli,
                       time.perf_counter() - t0)


def _seat_by_moves(cluster: Cluster, w: Workload, budget: int, pol: Any, rng: np.random.Generator,
                   hopeless: dict[tuple, int], min_gain_milli: int, cpu_per_gpu: float,
                   mem_per_gpu: float) -> Plan | None:
    """Seat `w` with at most `budget` moves (the plan applied to `cluster`), or None: no plan,
    or none worth its moves. `hopeless` remembers the shapes that found none, by cluster clock."""
    key = (w.cpu_milli, w.memory_mib, w.num_gpu, w.gpu_milli, w.gpu_model, budget)
    if min_gain_milli > 0 and budget > 0 and w.total_gpu_milli < min_gain_milli * 1:
        # a plan is worth the pod plus GPU share it unlocks on its target node: skip the
        # search when no node has enough idle GPU share held back by CPU or memory
        locked = _locked_gpu_milli(cluster, cpu_per_gpu, mem_per_gpu)
        if w.total_gpu_milli + locked < min_gain_milli:
            budget = 0
    if budget <= 0 or hopeless.get(key) == cluster._clock:
        return None  # the same shape found no plan and nothing has changed since
    plan = defragment(cluster, w, max_moves=budget, policy=pol, rng=rng)
    if (
        plan is not None
        and plan.num_moves
        and min_gain_milli > 0
        and plan_gain_milli(cluster, plan, w, cpu_per_gpu, mem_per_gpu) < min_gain_milli * plan.num_moves
    ):
        plan = None  # not worth its moves
    if plan is not None and plan.placement is not None:
        apply_plan(cluster, plan, w)
        return plan
    hopeless[key] = cluster._clock
    return None


def _sim_result(name: str, relocate: bool, seed: int, cluster: Cluster, typical: TypicalPods, arr: np.ndarray,
                alloc: np.ndarray, failed: int, moves: int, moved_milli: int, seconds: float) -> SimResult:
    cap = cluster.gpu_capacity_milli
    n = len(arr)
    a100 = _at(arr, alloc, 100)
    a130 = _at(arr, alloc, 130)
    cap_gpus = cap / 1000.0
    frag = cluster_fragmentation_milli(cluster, typical) / cap * 100.0
    # thin the curve to ~400 points for plots and JSON
    idx = np.unique(np.linspace(0, n - 1, min(400, n)).astype(int)) if n else np.zeros(0, int)
    return SimResult(
        policy=name,
        relocate=relocate,
        seed=seed,
        pods=n,
        failed=failed,
        capacity_gpus=cap_gpus,
        alloc_pct_at_100=round(a100, 3),
        alloc_pct_at_130=round(a130, 3),
        unalloc_gpus_at_100=round(cap_gpus * (1 - a100 / 100.0), 2),
        unalloc_gpus_at_130=round(cap_gpus * (1 - a130 / 100.0), 2),
        frag_pct_at_end=round(frag, 3),
        lower_bound_unalloc_gpus=round(packing_lower_bound_milli(cluster) / 1000.0, 2),
        moves=moves,
        moved_gpus=round(moved_milli / 1000.0, 3),
        seconds=round(seconds, 3),
        curve_arrived_pct=[round(float(x), 3) for x in arr[idx]],
        curve_alloc_pct=[round(float(x), 3) for x in alloc[idx]],
    )


def packing_lower_bound_milli(cluster: Cluster) -> int:
    """A lower bound on the free GPU share left by the pods running in ``cluster``, however
    they were packed or moved: a GPU holding a share pod of size s > 500 can only take other
    pods of at most 1000 - s on top. For each threshold t, the GPUs whose big pod leaves at
    most t are filled only by pods of size <= t, so their free share is at least
    sum(1000 - s) - sum(small pods <= t). The bound is the best t. (Free share of the final
    state; the allocation at 130% load is averaged just before it, so its unallocated GPUs are
    at least this.)"""
    sizes = np.array([w.gpu_milli for w in cluster.running() if w.num_gpu == 1 and w.gpu_milli < 1000], dtype=np.int64)
    if len(sizes) == 0:
        return 0
    big = 1000 - sizes[sizes > 500]
    small = np.sort(sizes[sizes <= 500])
    best = 0
    for t in np.unique(big).tolist():
        need = int(big[big <= t].sum())
        fill = int(small[small <= t].sum())
        best = max(best, need - fill)
    return best


def _mean(xs: Sequence[float]) -> float:
    return float(np.mean(xs)) if len(xs) else 0.0


def aggregate(results: Sequence[SimResult]) -> dict:
    """Means over seeds for one (policy, relocate) variant, in the CLI's JSON shape."""
    r0 = results[0]
    return {
        "policy": r0.policy,
        "relocate": r0.relocate,
        "seeds": [r.seed for r in results],
        "unalloc_gpus_at_100": round(_mean([r.unalloc_gpus_at_100 for r in results]), 2),
        "unalloc_gpus_at_130": round(_mean([r.unalloc_gpus_at_130 for r in results]), 2),
        "unalloc_gpus_at_130_min": round(min(r.unalloc_gpus_at_130 for r in results), 2),
        "unalloc_gpus_at_130_max": round(max(r.unalloc_gpus_at_130 for r in results), 2),
        "alloc_pct_at_100": round(_mean([r.alloc_pct_at_100 for r in results]), 3),
        "alloc_pct_at_130": round(_mean([r.alloc_pct_at_130 for r in results]), 3),
        "frag_pct_at_end": round(_mean([r.frag_pct_at_end for r in results]), 3),
        "lower_bound_unalloc_gpus": round(_mean([r.lower_bound_unalloc_gpus for r in results]), 2),
        "moves": round(_mean([r.moves for r in results]), 1),
        "moved_gpus": round(_mean([r.moved_gpus for r in results]), 2),
        "failed_pods": round(_mean([r.failed for r in results]), 1),
        "seconds": round(sum(r.seconds for r in results), 2),
    }


def _run_one(args: tuple) -> SimResult:
    return simulate(*args)


def run_many(
    nodes: Sequence[NodeSpec],
    pods: Sequence[TracePod],
    policies: Sequence[str],
    seeds: Sequence[int],
    relocate: bool = False,
    tune_ratio: float = 1.3,
    order: str = "shuffle",
    moves_per_pod: int = 2,
    max_moves: int | None = None,
    on_run: Callable[[str, bool, int], None] | None = None,
    progress: ProgressFn | None = None,
    min_gain_milli: int = 0,
    jobs: int = 1,
) -> list[tuple[dict, list[SimResult]]]:
    """All (policy, variant) x seeds; with ``relocate`` both the plain and the relocating
    variant of each policy. ``jobs`` > 1 runs them in that many processes (``on_run`` is then
    called as each run finishes, and there is no per-pod ``progress``)."""
    typical = TypicalPods.from_workloads([p.workload for p in pods])
    variants = [False, True] if relocate else [False]
    tasks = [(pol, rel, s) for pol in policies for rel in variants for s in seeds]
    results: dict[tuple[str, bool, int], SimResult] = {}
    if jobs <= 1:
        for pol, rel, s in tasks:
            if on_run is not None:
                on_run(pol, rel, s)
            results[(pol, rel, s)] = simulate(
                nodes, pods, pol, s, tune_ratio, order, rel, moves_per_pod, max_moves, typical, progress, min_gain_milli
            )
    else:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=jobs) as ex:
            futs = {
                ex.submit(_run_one, (nodes, pods, pol, s, tune_ratio, order, rel, moves_per_pod, max_moves, typical, None, min_gain_milli)): (pol, rel, s)
                for pol, rel, s in tasks
            }
            from concurrent.futures import as_completed

            for f in as_completed(futs):
                results[futs[f]] = f.result()
                if on_run is not None:
                    on_run(*futs[f])
    out = []
    for pol in policies:
        for rel in variants:
            runs = [results[(pol, rel, s)] for s in seeds]
            out.append((aggregate(runs), runs))
    return out


__all__ = ["FGDPolicy", "SimResult", "aggregate", "build_workload", "packing_lower_bound_milli", "run_many", "simulate"]
