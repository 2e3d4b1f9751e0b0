"""What a plan is worth in GPU share: usable GPU share per node, and a plan's gain in it."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from relocator.planner.cluster import MILLI, Cluster, Plan, Workload
from relocator.planner.trial import Trial as _Trial


def usable_gpu_milli(
    cluster: Cluster, nodes: Sequence[int] | np.ndarray, cpu_per_gpu: float, mem_per_gpu: float, min_share: int = 200
) -> np.ndarray:
    """GPU share on ``nodes`` that new workloads could still use: free share on GPUs with at
    least ``min_share`` free, capped by the node's free CPU and memory at ``cpu_per_gpu`` /
    ``mem_per_gpu`` per whole GPU (the workload's typical ratios), counted in whole GPUs' worth
    of CPU and memory."""
    idx = np.asarray(nodes, dtype=np.int64)
    gl = cluster.gpu_left[idx]
    share = np.where(gl >= min_share, gl, 0).sum(axis=1).astype(np.float64)
    by_cpu = np.floor(cluster.cpu_left[idx] / max(cpu_per_gpu, 1e-9)) * MILLI
    by_mem = np.floor(cluster.mem_left[idx] / max(mem_per_gpu, 1e-9)) * MILLI
    return np.minimum(share, np.minimum(by_cpu, by_mem))


def plan_gain_milli(
    cluster: Cluster,
    plan: Plan,
    workload: Workload | None,
    cpu_per_gpu: float,
    mem_per_gpu: float,
    min_share: int = 200,
) -> float:
    """What a plan is worth in GPU share: the workload's own GPUs plus the change in
    :func:`usable_gpu_milli` on every node the plan touches (a move that frees CPU next to idle
    GPUs is worth those GPUs; one that takes CPU from beside idle GPUs costs them). Computed by
    applying the plan tentatively; the cluster is left unchanged."""
    touched = sorted({cluster.node_index(m.src) for m in plan.moves} | {cluster.node_index(m.dst) for m in plan.moves}
                     | ({cluster.node_index(plan.placement.node)} if plan.placement is not None else set()))
    before = usable_gpu_milli(cluster, touched, cpu_per_gpu, mem_per_gpu, min_share).sum()
    trial = _Trial(cluster)
    added = False
    try:
        for mv in plan.moves:
            trial.move(mv.workload, mv.dst, mv.gpus)
        if workload is not None and plan.placement is not None:
            cluster.add(workload, plan.placement.node, plan.placement.gpus)
            added = True
        after = usable_gpu_milli(cluster, touched, cpu_per_gpu, mem_per_gpu, min_share).sum()
    finally:
        if added and workload is not None:
            cluster.remove(workload.id)
        trial.undo()
    own = workload.total_gpu_milli if (workload is not None and plan.placement is not None) else 0
    return float(own + after - before)
