"""The real backend of the state machine: node agents (Ray actors), placement groups, router.

Every call into Ray and the router goes through here, so the machine itself stays pure. The
backend holds only the ports it uses (`BackendPorts`: inventory, node directories, placement,
router, worker records, settings), not the controller; agents are called through the typed
`AgentClient`. Each transfer mode's own agent calls are its strategy's (relocator.controller
.transfers: RayBackend inherits them).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tenacity import Retrying, retry_if_not_exception_type, stop_after_delay, wait_fixed

from relocator.agent.agent import NAMESPACE, agent_name
from relocator.cell.cell import CellState
from relocator.controller.errors import NodeLost, PlanError
from relocator.controller.model import WorkerRecord, tokenizer_of
from relocator.controller.transfers import MODE_CALLS
from relocator.waits import WaitTimeout, until

AGENT_TIMEOUT_S = 600.0
NODE_CHECK_S = 1.0  # how often a waiting agent call asks whether the node is still alive


@dataclass(frozen=True)
class BackendPorts:
    """The controller's parts the backend uses, and nothing else."""

    inventory: Callable[..., dict[str, Any]]  # inventory(refresh=False) -> {node: NodeInfo}
    node_dir: Callable[[str], Path]  # a node's directory (state/, images/)
    place: Callable[..., str | None]  # place(gpus, exclude=(...)) -> a node with room, or None
    router: Callable[[], Any]  # the router's control client
    worker: Callable[[str], WorkerRecord | None]  # a worker record by id
    setting: Callable[[str], Any]  # a cluster setting (transient_images, node_names)
    #: warm_image(worker id, node) -> whether a start of the worker's kind there is warm
    #: (controller/warmwhere.py: {warm: here|near|"", why}); `auto`'s handoff choice
    warm_image: Callable[[str, str], dict[str, Any]] = lambda worker_id, node: {}

    @classmethod
    def of(cls, ctl: Any) -> "BackendPorts":
        """The ports of a controller (its inventory, node_dir, place, router, store, config)."""
        return cls(ctl.inventory, ctl.node_dir, ctl.place, ctl.router, ctl.store.worker, ctl.config.get,
                   getattr(ctl, "warm_image_for", lambda worker_id, node: {}))


class AgentClient:
    """Typed calls on the node agents: each method names the agent's method it runs, so a
    reader finds every use of an agent call by name. `call` is the one way they are made."""

    def __init__(self, node_alive: Callable[[str, bool], bool]) -> None:
        self.node_alive = node_alive
        self._handles: dict[str, Any] = {}  # handles survive an agent's restarts

    def handle(self, node: str) -> Any:
        """The agent's actor handle, looked up once (a lookup is a GCS round trip: a restarted
        controller's first calls on the recovery path paid ~0.25 s each)."""
        import ray

        h = self._handles.get(node)
        if h is None:
            h = self._handles[node] = ray.get_actor(agent_name(node), namespace=NAMESPACE)
        return h

    def call(self, node: str, invoke: Callable[[Any], Any], what: str, timeout: float = AGENT_TIMEOUT_S) -> Any:
        """`invoke(handle)` (an actor method's `.remote(...)`) on `node`'s agent, its result.
        Fails fast with NodeLost once Ray declares the node dead: a call queued on the agent of
        a dead node (restarting, unplaceable) would never end."""
        import ray

        if not self.node_alive(node, False):
            raise NodeLost(node)
        ref = invoke(self.handle(node))

        def ready() -> bool:
            done, _ = ray.wait([ref], timeout=NODE_CHECK_S)
            if not done and not self.node_alive(node, True):
                ray.cancel(ref, force=False)
                raise NodeLost(node)
            return bool(done)

        try:
            until(ready, timeout, every=0.0, what=f"agent of {node}: {what}")
        except WaitTimeout:
            ray.cancel(ref, force=False)
            raise TimeoutError(f"agent of {node}: {what} did not answer within {timeout:.0f}s") from None
        try:
            return ray.get(ref)
        except ray.exceptions.ActorDiedError:
            self._handles.pop(node, None)  # gone for good: a new agent is a new actor
            raise

    # -- the agents' calls, typed ------------------------------------------------------------
    def gpus(self, node: str, timeout: float = 30) -> list[dict]:
        return self.call(node, lambda a: a.gpus.remote(), "gpus", timeout)

    def health(self, node: str, timeout: float = 10) -> dict:
        return self.call(node, lambda a: a.health.remote(), "health", timeout)

    def set_notice(self, node: str, at: float | None, reason: str = "") -> dict | None:
        return self.call(node, lambda a: a.set_notice.remote(at, reason), "set_notice", 30)

    def clear_gpu(self, node: str, index: int) -> None:
        self.call(node, lambda a: a.clear_gpu.remote(index), "clear_gpu", 30)

    def mark_gpus(self, node: str, total: int, kind: str, gpus: list[int], count: int,
                  avoid: list[int]) -> list[int]:
        return self.call(node, lambda a: a.mark_gpus.remote(total, kind, gpus, count, avoid), "mark_gpus", 30)

    def cells(self, node: str, timeout: float = 60) -> list[dict]:
        return self.call(node, lambda a: a.cells.remote(), "cells", timeout)

    def warm_keys(self, node: str, timeout: float = 10) -> list[str]:
        return self.call(node, lambda a: a.warm_keys.remote(), "warm_keys", timeout)

    def fetch_warm(self, node: str, src: str, key: str, timeout: float = 600) -> dict:
        return self.call(node, lambda a: a.fetch_warm.remote(src, key), "fetch_warm", timeout)

    def kill_all(self, node: str, timeout: float = 120) -> list[str]:
        return self.call(node, lambda a: a.kill_all.remote(), "kill_all", timeout)

    def cell_state(self, node: str, cell_id: str, timeout: float = AGENT_TIMEOUT_S) -> str:
        return self.call(node, lambda a: a.cell_state.remote(cell_id), "cell_state", timeout)

    def last_words(self, node: str, cell_id: str, timeout: float = 30) -> str | None:
        return self.call(node, lambda a: a.last_words.remote(cell_id), "last_words", timeout)

    def worker_profile(self, node: str, cell_id: str) -> dict:
        return self.call(node, lambda a: a.worker_profile.remote(cell_id), "worker_profile", 60)

    def compatible(self, node: str, fingerprint: dict, launch: dict | None = None, engine: str | None = None,
                   timeout: float = 60) -> list[str]:
        return self.call(node, lambda a: a.compatible.remote(fingerprint, launch, engine), "compatible", timeout)

    def launch(self, node: str, cell_id: str, model_dir: str, served_name: str, timeout: float = AGENT_TIMEOUT_S,
               **kw: Any) -> dict:
        return self.call(node, lambda a: a.launch.remote(cell_id, model_dir, served_name, **kw), "launch", timeout)

    def transient_image_dir(self, node: str, name: str, size_hint: int | None, mode: str) -> dict:
        return self.call(node, lambda a: a.transient_image_dir.remote(name, size_hint, mode),
                         "transient_image_dir", 60)

    def dump(self, node: str, cell_id: str, image_dir: str, page_server: dict | None = None) -> dict:
        return self.call(node, lambda a: a.dump.remote(cell_id, image_dir, page_server=page_server), "dump")

    def receive_image(self, node: str, src: str, image_dir: str, dst_image_dir: str) -> dict:
        return self.call(node, lambda a: a.receive_image.remote(src, image_dir, dst_image_dir), "receive_image")

    def restore(self, node: str, image_dir: str, cell_id: str, gpu_ids: list[int] | None = None,
                page_source: dict | None = None) -> dict:
        # "auto": a streamed image was hashed on arrival and stamped, a dump on this host
        # stamped its own files; anything else is hashed again before it is restored
        return self.call(node, lambda a: a.restore.remote(image_dir, cell_id, verify="auto", gpu_ids=gpu_ids,
                                                          page_source=page_source), "restore")

    def resume(self, node: str, cell_id: str) -> None:
        self.call(node, lambda a: a.resume.remote(cell_id), "resume")

    def signal(self, node: str, cell_id: str, sig: int) -> None:
        self.call(node, lambda a: a.signal.remote(cell_id, sig), "signal")

    def kill(self, node: str, cell_id: str) -> None:
        self.call(node, lambda a: a.kill.remote(cell_id), "kill")

    def remove_image(self, node: str, image_dir: str) -> None:
        self.call(node, lambda a: a.remove_image.remote(image_dir), "remove_image")


class RayBackend(*MODE_CALLS):  # type: ignore[misc]  # each transfer mode's agent calls
    def __init__(self, ports: BackendPorts) -> None:
        # a controller passed whole (callers not yet on BackendPorts): only its ports are kept
        self.ports = ports if isinstance(ports, BackendPorts) else BackendPorts.of(ports)
        self.agents = AgentClient(self.node_alive)
        # a worker's expected image size, from the source's answer at compatible() to the
        # transient_image_dir() of the same PLAN (saves a second call)
        self._image_bytes: dict[str, int | None] = {}

    # -- helpers ------------------------------------------------------------------------------
    def agent(self, node: str) -> Any:
        return self.agents.handle(node)

    def node_alive(self, node: str, fresh: bool = False) -> bool:
        info = self.ports.inventory(refresh=fresh).get(node)
        return info is not None and info.alive

    def fence(self, node: str, cell_ids: list[str] | None = None) -> dict:
        """Stop a lost node's cells without its agent (see relocator.cell.fence)."""
        from relocator.cell.fence import fence_cells

        return fence_cells(self.ports.node_dir(node) / "state", cell_ids)

    # -- planning ------------------------------------------------------------------------------
    def pick_target(self, worker: WorkerRecord) -> str:
        node = self.ports.place(worker.gpus, exclude=(worker.node,))
        if node is None:
            raise RuntimeError(f"no node other than {worker.node} has {worker.gpus} free GPU(s)")
        return node

    def compatible(self, worker: WorkerRecord, node: str) -> list[str]:
        """The target's reasons it cannot restore `worker`: the source's fingerprint against
        the one the target computes for the worker's launch record (its own engine version and
        weights, as its restore will; computing it now caches it there for that restore)."""
        if node not in self.ports.inventory():
            return [f"unknown node {node!r}"]
        prof = self.agents.worker_profile(worker.node, worker.cell_id)
        self._image_bytes[worker.cell_id] = prof.get("image_bytes")
        return self.agents.compatible(node, prof["fingerprint"], prof["launch"], prof["engine"])

    def image_dir(self, node: str, relocation_id: str) -> str:
        return str(self.ports.node_dir(node) / "images" / relocation_id)

    def transient_image_dir(self, worker: WorkerRecord, node: str, relocation_id: str) -> tuple[str, str, str]:
        """(path, "tmpfs" | "disk", why) of the target's image directory for a stream or
        postcopy move: the cluster's `transient_images` setting, decided by the target agent
        (it knows its own /dev/shm) for the worker's expected image size."""
        from relocator.agent.transient import TransientImages

        mode = TransientImages(self.ports.setting("transient_images") or TransientImages.AUTO)
        if mode is TransientImages.DISK:
            return self.image_dir(node, relocation_id), "disk", "transient_images: disk"
        size = self._image_bytes.pop(worker.cell_id, None)
        if size is None:
            size = self.agents.worker_profile(worker.node, worker.cell_id).get("image_bytes")
        got = self.agents.transient_image_dir(node, relocation_id, size, mode.value)
        if got.get("refused"):
            raise PlanError(f"transient_images tmpfs: {node} cannot keep the image on a tmpfs: {got['refused']}")
        return got["path"], got["on"], got.get("why", "")

    # -- reservations --------------------------------------------------------------------------
    def reserve(self, worker: WorkerRecord, node: str, name: str, timeout: float = 15.0) -> list[int]:
        """Hold `worker.gpus` GPUs on `node` in placement group `name`; returns the node's GPU
        indices Ray gave it (fixed for the group's life: what the worker's cell gets)."""
        import ray
        from ray.util import placement_group

        info = self.ports.inventory().get(node)
        if self.ports.setting("node_names") and info is not None:
            # a deployed cluster's nodes carry no relocator_node resource: pinned by Ray node id
            pg = placement_group([{"GPU": float(worker.gpus)}], strategy="STRICT_PACK", name=name,
                                 lifetime="detached", bundle_label_selector=[{"ray.io/node-id": info.ray_node_id}])
        else:
            pg = placement_group([{"GPU": float(worker.gpus), f"relocator_node:{node}": 0.001}],
                                 strategy="STRICT_PACK", name=name, lifetime="detached")
        try:
            ray.get(pg.ready(), timeout=timeout)
            return bundle_gpu_ids(pg, worker.gpus, timeout)
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
    def _router(self, worker_id: str, fn: Callable[[Any], Any], endpoint: str | None = None) -> Any:
        """`fn(router)`; a router that restarted mid-relocation has forgotten the worker (the
        reconcile loop skips busy workers): on 404 register it again, then retry once."""
        from relocator.router.client import ControlError

        rc = self.ports.router()
        try:
            return fn(rc)
        except ControlError as exc:
            w = self.ports.worker(worker_id)
            if exc.status != 404 or w is None:
                raise
            rc.add_replica(worker_id, w.model, endpoint or w.endpoint, tokenizer_of(w), w.engine, w.gpus)
            return fn(rc)

    def hold(self, worker_id: str) -> dict:
        return self._router(worker_id, lambda rc: rc.hold(worker_id))

    def switch(self, worker_id: str, endpoint: str) -> dict:
        return self._router(worker_id, lambda rc: rc.switch(worker_id, endpoint), endpoint)

    def release(self, worker_id: str) -> None:
        self._router(worker_id, lambda rc: rc.release(worker_id))

    # -- agents --------------------------------------------------------------------------------
    def dump(self, node: str, cell_id: str, image_dir: str, page_server: dict | None = None) -> dict:
        return self.agents.dump(node, cell_id, image_dir, page_server)

    def transfer(self, src: str, dst: str, image_dir: str, dst_image_dir: str) -> dict:
        return self.agents.receive_image(dst, src, image_dir, dst_image_dir)

    def restore(self, node: str, image_dir: str, cell_id: str, verified: bool = False,
                gpu_ids: list[int] | None = None, page_source: dict | None = None) -> dict:
        return self.agents.restore(node, image_dir, cell_id, gpu_ids, page_source)

    def cell_state(self, node: str, cell_id: str) -> str:
        """running | stopped | absent, or lost when the node is gone. An agent that is
        restarting answers a moment later: asked again until AGENT_TIMEOUT_S."""
        retrying = Retrying(stop=stop_after_delay(AGENT_TIMEOUT_S), wait=wait_fixed(0.1), reraise=True,
                            retry=retry_if_not_exception_type(NodeLost))
        try:
            return retrying(self.agents.cell_state, node, cell_id)
        except NodeLost:
            return CellState.LOST

    def resume(self, node: str, cell_id: str) -> None:
        self.agents.resume(node, cell_id)

    def kill(self, node: str, cell_id: str) -> None:
        """Kill a cell through its agent; on a lost node (or an agent that died with it),
        fence it from here."""
        try:
            self.agents.kill(node, cell_id)
        except NodeLost:
            self.fence(node, [cell_id])
        except Exception:
            if self.node_alive(node, fresh=True):
                raise
            self.fence(node, [cell_id])

    def remove_image(self, node: str, image_dir: str) -> None:
        try:
            self.agents.remove_image(node, image_dir)
        except NodeLost:
            # shared storage (or this very host): the files are reachable from here
            shutil.rmtree(image_dir, ignore_errors=True)


def bundle_gpu_ids(pg: Any, gpus: int, timeout: float = 15.0) -> list[int]:
    """The GPU indices of a placement group's bundle 0: what Ray gives a task scheduled in it
    (Ray fixes a bundle's GPU instances when it commits the bundle, so every task in it sees
    the same ones). On fake-GPU nodes these are Ray's logical indices."""
    if gpus <= 0:
        return []
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    probe = ray.remote(num_cpus=0, num_gpus=gpus)(_gpu_ids).options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0))
    return [int(i) for i in ray.get(probe.remote(), timeout=timeout)]


def _gpu_ids() -> list:
    import ray

    return ray.get_gpu_ids()


__all__ = ["AGENT_TIMEOUT_S", "AgentClient", "BackendPorts", "NodeLost", "RayBackend", "bundle_gpu_ids"]
