"""FGD's score of a live move: the fall in fragmentation (Weng et al., ATC '23; the measure of
`policies.fragmentation`) that placing a workload on a node brings, at the GPUs Ray would give
it there (a live move picks the node; Ray picks the GPU: the fullest that fits a share, the
lowest-numbered free ones for whole GPUs, `Cluster.default_gpus`).

Used by the moves of consolidation where workers hold GPU shares (`pack_shares`, and the
node-evacuating `consolidate` through :class:`RayGpuFGD`), in the controller and in the trace
replay alike (issue 31). The placement policy `fgd` instead chooses the GPU itself, as the
authors' scheduler does when it starts a pod.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from relocator.planner.cluster import MILLI, Cluster, Workload
from relocator.planner.policies import Policy, TypicalPods, fragmentation


def target_shapes(cluster: Cluster, workloads: Iterable[Workload], extra: Iterable[Workload] = ()) -> TypicalPods:
    """What consolidation measures fragmentation against when no trace says: the shapes of
    `workloads` (the running ones) and of `extra` (pending demands), each counted once per
    workload, plus one whole GPU and one whole node of the largest GPU count (consolidation is
    for whole GPUs and whole nodes: freeing one must lower the measure even where only shares
    run). Every shape is kept (no popularity cut: a controller's cluster is small)."""
    ws = [w for w in [*workloads, *extra] if w.num_gpu > 0]
    g = int(cluster.num_gpus.max()) if cluster.num_nodes else 0
    if g > 0:
        ws.append(Workload("_one_gpu", num_gpu=1, gpu_milli=MILLI))
        ws.append(Workload("_one_node", num_gpu=g, gpu_milli=MILLI))
    return TypicalPods.from_workloads(ws, popularity_threshold=100.0)


def ray_gpus(cluster: Cluster, w: Workload, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised `Cluster.default_gpus` over `nodes`: (M, G) bool of the GPUs `w` would take
    on each, and (M,) bool whether it fits there at all (GPU only)."""
    left = cluster.gpu_left[nodes]
    fit = left >= w.gpu_milli
    take = np.zeros_like(fit)
    if w.num_gpu == 0:
        return take, np.ones(len(nodes), dtype=bool)
    if w.is_gpu_share:
        big = np.iinfo(left.dtype).max
        g = np.where(fit, left, big).argmin(axis=1)  # the fullest GPU that fits, first on ties
        ok = fit.any(axis=1)
        take[np.arange(len(nodes)), g] = ok
        return take, ok
    take = fit & (np.cumsum(fit, axis=1) <= w.num_gpu)  # the lowest-numbered free GPUs
    return take, fit.sum(axis=1) >= w.num_gpu


def fall(cluster: Cluster, w: Workload, nodes: np.ndarray, typical: TypicalPods) -> tuple[np.ndarray, np.ndarray]:
    """For each of `nodes`: the fall in its fragmentation (milli-GPU, higher is better) if `w`
    is placed there at Ray's GPUs, and those GPUs ((M, G) bool). -inf where it does not fit."""
    nodes = np.asarray(nodes, dtype=np.int64)
    take, ok = ray_gpus(cluster, w, nodes)
    ok &= (cluster.cpu_left[nodes] >= w.cpu_milli) & (cluster.mem_left[nodes] >= w.memory_mib)
    if w.num_gpu > 0:
        ok &= cluster.model_ok(w)[nodes]
    left = cluster.gpu_left[nodes]
    cpu = cluster.cpu_left[nodes]
    model = cluster.model[nodes]
    before = fragmentation(cpu, left, model, typical, cluster.model_codes)
    after = fragmentation(cpu - w.cpu_milli, left - np.where(take, w.gpu_milli, 0), model, typical, cluster.model_codes)
    return np.where(ok, before - after, -np.inf), take


def node_frag(cluster: Cluster, nodes: np.ndarray, typical: TypicalPods) -> np.ndarray:
    """(M,) fragmentation of `nodes` now, milli-GPU."""
    return fragmentation(cluster.cpu_left[nodes], cluster.gpu_left[nodes], cluster.model[nodes], typical,
                         cluster.model_codes)


class RayGpuFGD(Policy):
    """FGD's choice of node for a live move: the node whose fragmentation falls most (in whole
    milli-GPU; ties to the first node), at the GPUs Ray gives there, against a fixed target
    distribution (:func:`target_shapes` for the controller, the trace's shapes in the replay)."""

    name = "fgd-live"

    def __init__(self, typical: TypicalPods) -> None:
        self.typical = typical

    def scores(self, cluster: Cluster, w: Workload, nodes: np.ndarray):
        f, _ = fall(cluster, w, nodes, self.typical)
        return np.round(np.where(np.isfinite(f), f, -1e12)).astype(np.int64), None
