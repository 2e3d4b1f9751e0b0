"""The real backend of the state machine: node agents (Ray actors), placement groups, router.

Every call into Ray and the router goes through here, so the machine itself stays pure.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from relocator.agent.agent import NAMESPACE, agent_name
from relocator.controller.model import WorkerRecord

if TYPE_CHECKING:
    from relocator.controller.controller import Controller

AGENT_TIMEOUT_S = 600.0


class RayBackend:
    def __init__(self, ctl: "Controller") -> None:
        self.ctl = ctl

    # -- helpers ------------------------------------------------------------------------------
    def agent(self, node: str):
        import ray

        return ray.get_actor(agent_name(node), namespace=NAMESPACE)

    def call(self, node: str, method: str, *args, timeout: float = AGENT_TIMEOUT_S, **kw):
        import ray

        return ray.get(getattr(self.agent(node), method).remote(*args, **kw), timeout=timeout)

    # -- planning ------------------------------------------------------------------------------
    def pick_target(self, worker: WorkerRecord) -> str:
        from relocator.controller.inventory import best_fit

        nodes = self.ctl.inventory()
        free = {n.id: n.gpus_free for n in nodes.values() if n.alive}
        totals = {n.id: n.gpus_total for n in nodes.values()}
        node = best_fit(free, worker.gpus, exclude=(worker.node,), totals=totals, policy=self.ctl.policy)
        if node is None:
            raise RuntimeError(f"no node other than {worker.node} has {worker.gpus} free GPU(s)")
        return node

    def compatible(self, worker: WorkerRecord, node: str) -> list[str]:
        if node not in self.ctl.inventory():
            return [f"unknown node {node!r}"]
        fp = self.call(worker.node, "worker_fingerprint", worker.cell_id, timeout=60)
        return self.call(node, "compatible", fp, timeout=60)

    def image_dir(self, node: str, relocation_id: str) -> str:
        return str(self.ctl.node_dir(node) / "images" / relocation_id)

    # -- reservations --------------------------------------------------------------------------
    def reserve(self, worker: WorkerRecord, node: str, name: str, timeout: float = 15.0) -> None:
        import ray
        from ray.util import placement_group

        pg = placement_group([{"GPU": float(worker.gpus), f"relocator_node:{node}": 0.001}],
                             strategy="STRICT_PACK", name=name, lifetime="detached")
        try:
            ray.get(pg.ready(), timeout=timeout)
        except Exception as exc:
            ray.util.remove_placement_group(pg)
            raise RuntimeError(f"could not reserve {worker.gpus} GPU(s) on {node} within {timeout:.0f}s "
                               f"({type(exc).__name__})") from None

    def free(self, name: str) -> None:
        import ray

        try:
            pg = ray.util.get_placement_group(name)
        except ValueError:
            return
        ray.util.remove_placement_group(pg)

    # -- router --------------------------------------------------------------------------------
    def _router(self, worker_id: str, fn, endpoint: str | None = None):
        """`fn(router)`; a router that restarted mid-relocation has forgotten the worker (the
        reconcile loop skips busy workers): on 404 register it again, then retry once."""
        from relocator.router.client import ControlError

        rc = self.ctl.router()
        try:
            return fn(rc)
        except ControlError as exc:
            w = self.ctl.store.worker(worker_id)
            if exc.status != 404 or w is None:
                raise
            rc.add_replica(worker_id, w.model, endpoint or w.endpoint)
            return fn(rc)

    def hold(self, worker_id: str) -> None:
        self._router(worker_id, lambda rc: rc.hold(worker_id))

    def switch(self, worker_id: str, endpoint: str) -> dict:
        return self._router(worker_id, lambda rc: rc.switch(worker_id, endpoint), endpoint)

    def release(self, worker_id: str) -> None:
        self._router(worker_id, lambda rc: rc.release(worker_id))

    # -- agents --------------------------------------------------------------------------------
    def dump(self, node: str, cell_id: str, image_dir: str) -> dict:
        return self.call(node, "dump", cell_id, image_dir)

    def transfer(self, src: str, dst: str, image_dir: str, dst_image_dir: str) -> dict:
        return self.call(dst, "receive_image", src, image_dir, dst_image_dir)

    def restore(self, node: str, image_dir: str, cell_id: str, verified: bool = False) -> dict:
        # "auto": a streamed image was hashed on arrival and stamped, a dump on this host
        # stamped its own files; anything else is hashed again before it is restored
        return self.call(node, "restore", image_dir, cell_id, verify="auto")

    def cell_state(self, node: str, cell_id: str) -> str:
        deadline = time.monotonic() + AGENT_TIMEOUT_S
        while True:  # an agent that is restarting answers a moment later
            try:
                return self.call(node, "cell_state", cell_id)
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def resume(self, node: str, cell_id: str) -> None:
        self.call(node, "resume", cell_id)

    def kill(self, node: str, cell_id: str) -> None:
        self.call(node, "kill", cell_id)

    def remove_image(self, node: str, image_dir: str) -> None:
        self.call(node, "remove_image", image_dir)
