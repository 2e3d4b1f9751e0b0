"""The controller's side of the policies (relocator.policies): the ports the policy engine
uses, built from the controller's managers, and where its policies file is."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from relocator.controller.model import SuspendReason, WorkerRecord
from relocator.policies.engine import PolicyEngine
from relocator.policies.runner import PolicyPorts

POLICIES_ENV = "RELOCATOR_POLICIES"  # a policies file (else the config's policies_file, else DEFAULT_FILE)
DEFAULT_FILE = Path(__file__).resolve().parents[2] / "configs" / "policies.yaml"
HEALTH_TIMEOUT_S = 3.0  # an agent's health report: the reconcile round waits no longer
WORKER_FIELDS = ("id", "node", "state", "gpus", "gpu_ids", "engine", "model", "priority")


def hold_name(node: str, gpu: int) -> str:
    """A withheld GPU's reservation (not `relocator-*`: the leaked-reservation sweep keeps it)."""
    return f"gpuhold-{node}-{gpu}"


def policies_file(ctl: Any) -> Path | None:
    path = os.environ.get(POLICIES_ENV) or ctl.config.get("policies_file")
    if path:
        return Path(path)
    return DEFAULT_FILE if DEFAULT_FILE.is_file() else None


def _replace(ctl: Any, worker: str) -> dict:
    """A worker whose GPU failed: its copy is killed (fenced) and the reconcile loop replaces it
    as any lost worker, from its warm image, its streams continued."""
    w = ctl.store.worker(worker)
    if w is None:
        raise KeyError(f"unknown worker {worker!r}")
    ctl.backend.kill(w.node, w.cell_id)
    ctl.claims.wake.set()
    return {"worker": worker, "node": w.node, "killed": w.cell_id}


def _nodes(ctl: Any) -> dict[str, dict]:
    shut = ctl.cordoned()
    return {n.id: {"gpus_total": n.gpus_total, "gpus_free": n.gpus_free, "alive": n.alive, "cordoned": n.id in shut}
            for n in ctl.inventory().values()}


def ports(ctl: Any) -> PolicyPorts:
    b, store = ctl.backend, ctl.store
    return PolicyPorts(
        store=store,
        emit=lambda kind, **fields: ctl.emit(kind, **fields),
        workers=lambda: [{k: w.to_dict()[k] for k in WORKER_FIELDS} | {"state": str(w.state.value)}
                         for w in store.workers()],
        nodes=lambda: _nodes(ctl),
        health=lambda node: b.agents.health(node, timeout=HEALTH_TIMEOUT_S),
        pending=ctl.pending,
        relocations=lambda: [r.summary() for r in store.relocations()],
        relocate=lambda worker, to=None, transfer=None, wait=False: ctl.relocations.relocate(
            worker, to, transfer, None, wait),
        relocation=ctl.get_relocation,
        suspend=lambda worker: ctl.suspensions.suspend(worker, SuspendReason.DRAIN),
        replace=lambda worker: _replace(ctl, worker),
        consolidate=lambda k: ctl.consolidate(max_moves=k),
        cordon=lambda node, until: ctl.nodes.cordon(node, float(until or 0.0)),
        uncordon=ctl.uncordon,
        hold_gpu=lambda node, gpu: b.reserve(WorkerRecord(id=hold_name(node, gpu), model="", node=node, gpus=1),
                                             node, hold_name(node, gpu), timeout=5.0),
        release_gpu=lambda node, gpu: b.free(hold_name(node, gpu)),
        # the worker's kind's warm image copied to the node (every image it lacks when the
        # worker's kind is not known: it was not started through this controller)
        prefetch=lambda worker, node: ctl.prefetch_images(node, ctl.workers.kinds.get(worker)),
    )


def policy_engine(ctl: Any) -> PolicyEngine:
    return PolicyEngine(ports(ctl), policies_file(ctl))
