"""The operator's GPU health commands (`relocator gpus`, docs/policies.md): mark GPUs bad on
fake GPUs (by index, or N of a node's idle ones by count: the gpu-health path without
hardware) and clear GPUs after their reset (Xids forgotten; the hold is released once the GPU
reads healthy, on the next reconcile round)."""

from __future__ import annotations

from typing import Any

from relocator.agent.fakenvml import MARKS
from relocator.controller.model import WorkerState

#: states whose worker holds GPUs on its node (its gpu_ids are in use)
HOLDING = (WorkerState.STARTING, WorkerState.RUNNING, WorkerState.RELOCATING, WorkerState.RESUMING,
           WorkerState.SUSPENDING)


def _node(ctl: Any, node: str) -> Any:
    nodes = ctl.inventory()
    if node not in nodes:
        raise ValueError(f"unknown node {node!r}; known: {', '.join(sorted(nodes)) or 'none'}")
    if not nodes[node].alive:
        raise ValueError(f"node {node} is lost")
    return nodes[node]


def in_use(ctl: Any, node: str) -> list[int]:
    """GPU indexes of `node` that workers hold now."""
    return sorted({g for w in ctl.store.workers() if w.node == node and w.state in HOLDING
                   for g in (w.gpu_ids or [])})


def mark_gpus(ctl: Any, node: str, kind: str, gpus: list[int] | None = None, count: int = 0) -> dict:
    """`gpus` (indexes) or `count` idle GPUs of `node` read as `kind` (fakenvml.MARKS) by its
    agent's NVML stand-in. ValueError: bad input, or a node with real GPUs."""
    info = _node(ctl, node)
    if kind not in MARKS:
        raise ValueError(f"unknown GPU fault {kind!r}; known: {', '.join(MARKS)}")
    if bool(gpus) == bool(count):
        raise ValueError("give GPU indexes or a count (not both)")
    if count < 0:
        raise ValueError(f"count must be positive, not {count}")
    marked = ctl.backend.agents.mark_gpus(node, int(info.gpus_total), kind, [int(g) for g in gpus or []],
                                          int(count), in_use(ctl, node))
    ctl.claims.wake.set()  # the next reconcile round reads them now, not in up to 2 s
    return {"node": node, "kind": kind, "gpus": marked, "in_use": in_use(ctl, node)}


def clear_gpus(ctl: Any, node: str, gpus: list[int] | None = None) -> dict:
    """GPUs of `node` reset: the agent forgets their Xids (and their marked faults on fake GPUs).
    None: every GPU of the node that is not healthy now. Their holds go once they read healthy."""
    info = _node(ctl, node)
    known = [d["gpu"] for d in ctl.policies.gpus.states() if d["node"] == node]
    todo = sorted(set(known if gpus is None else gpus))
    bad = [g for g in todo if not 0 <= int(g) < int(info.gpus_total)]
    if bad:
        raise ValueError(f"no GPU {bad[0]} on {node}: it has GPUs 0-{int(info.gpus_total) - 1}")
    for g in todo:
        ctl.backend.agents.clear_gpu(node, int(g))
    ctl.claims.wake.set()
    return {"node": node, "cleared": todo, "were_unhealthy": sorted(set(todo) & set(known))}
