"""The real backend of the state machine: node agents (Ray actors), placement groups, router.

Every call into Ray and the router goes through here, so the machine itself stays pure.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from relocator.agent.agent import NAMESPACE, agent_name
from relocator.controller.model import FailureReason, TransferMode, WorkerRecord, tokenizer_of

if TYPE_CHECKING:
    from relocator.controller.controller import Controller

AGENT_TIMEOUT_S = 600.0
NODE_CHECK_S = 1.0  # how often a waiting agent call asks whether the node is still alive


def postcopy_problems(src_info: dict, dst_info: dict) -> list[str]:
    """Why a post-copy from the node of `src_info` to that of `dst_info` (agents'
    transfer_info) cannot run; empty: it can."""
    out = []
    if not dst_info.get("uffd_noncoop", [False])[0]:
        out.append(f"target: no non-cooperative userfaultfd ({dst_info.get('uffd_noncoop', ['', '?'])[1]})")
    if not src_info.get("lazy_dump_pipes", [False])[0]:
        out.append(f"source: {src_info.get('lazy_dump_pipes', ['', '?'])[1]}")
    return out


class NodeLost(RuntimeError):
    """The node's agent cannot be reached because Ray declared the node dead."""

    reason = FailureReason.NODE_LOST

    def __init__(self, node: str) -> None:
        super().__init__(f"node {node} is lost (Ray declared it dead)")
        self.node = node


class RayBackend:
    def __init__(self, ctl: "Controller") -> None:
        self.ctl = ctl
        self._agents: dict[str, object] = {}  # handles survive an agent's restarts
        # a worker's expected image size, from the source's answer at compatible() to the
        # transient_image_dir() of the same PLAN (saves a second call)
        self._image_bytes: dict[str, int | None] = {}

    # -- helpers ------------------------------------------------------------------------------
    def agent(self, node: str):
        """The agent's actor handle, looked up once (a lookup is a GCS round trip: a restarted
        controller's first calls on the recovery path paid ~0.25 s each)."""
        import ray

        h = self._agents.get(node)
        if h is None:
            h = self._agents[node] = ray.get_actor(agent_name(node), namespace=NAMESPACE)
        return h

    def node_alive(self, node: str, fresh: bool = False) -> bool:
        info = self.ctl.inventory(refresh=fresh).get(node)
        return info is not None and info.alive

    def call(self, node: str, method: str, *args, timeout: float = AGENT_TIMEOUT_S, **kw):
        """`method` on `node`'s agent. Fails fast with NodeLost once Ray declares the node dead:
        a call queued on the agent of a dead node (restarting, unplaceable) would never end."""
        import ray

        if not self.node_alive(node):
            raise NodeLost(node)
        ref = getattr(self.agent(node), method).remote(*args, **kw)
        deadline = time.monotonic() + timeout
        while True:
            ready, _ = ray.wait([ref], timeout=min(NODE_CHECK_S, max(0.0, deadline - time.monotonic())))
            if ready:
                try:
                    return ray.get(ref)
                except ray.exceptions.ActorDiedError:
                    self._agents.pop(node, None)  # gone for good: a new agent is a new actor
                    raise
            if not self.node_alive(node, fresh=True):
                ray.cancel(ref, force=False)
                raise NodeLost(node)
            if time.monotonic() >= deadline:
                ray.cancel(ref, force=False)
                raise TimeoutError(f"agent of {node}: {method} did not answer within {timeout:.0f}s")

    def fence(self, node: str, cell_ids: list[str] | None = None) -> dict:
        """Stop a lost node's cells without its agent (see relocator.cell.fence)."""
        from relocator.cell.fence import fence_cells

        return fence_cells(self.ctl.node_dir(node) / "state", cell_ids)

    # -- planning ------------------------------------------------------------------------------
    def pick_target(self, worker: WorkerRecord) -> str:
        node = self.ctl.place(worker.gpus, exclude=(worker.node,))
        if node is None:
            raise RuntimeError(f"no node other than {worker.node} has {worker.gpus} free GPU(s)")
        return node

    def compatible(self, worker: WorkerRecord, node: str) -> list[str]:
        """The target's reasons it cannot restore `worker`: the source's fingerprint against
        the one the target computes for the worker's launch record (its own engine version and
        weights, as its restore will; computing it now caches it there for that restore)."""
        if node not in self.ctl.inventory():
            return [f"unknown node {node!r}"]
        prof = self.call(worker.node, "worker_profile", worker.cell_id, timeout=60)
        self._image_bytes[worker.cell_id] = prof.get("image_bytes")
        return self.call(node, "compatible", prof["fingerprint"], prof["launch"], prof["engine"], timeout=60)

    def image_dir(self, node: str, relocation_id: str) -> str:
        return str(self.ctl.node_dir(node) / "images" / relocation_id)

    def transient_image_dir(self, worker: WorkerRecord, node: str, relocation_id: str) -> tuple[str, str, str]:
        """(path, "tmpfs" | "disk", why) of the target's image directory for a stream or
        postcopy move: the cluster's `transient_images` setting, decided by the target agent
        (it knows its own /dev/shm) for the worker's expected image size."""
        from relocator.agent.transient import TransientImages
        from relocator.controller.machine import PlanError

        mode = TransientImages(self.ctl.config.get("transient_images") or TransientImages.AUTO)
        if mode is TransientImages.DISK:
            return self.image_dir(node, relocation_id), "disk", "transient_images: disk"
        size = self._image_bytes.pop(worker.cell_id, None)
        if size is None:
            size = self.call(worker.node, "worker_profile", worker.cell_id, timeout=60).get("image_bytes")
        got = self.call(node, "transient_image_dir", relocation_id, size, mode.value, timeout=60)
        if got.get("refused"):
            raise PlanError(f"transient_images tmpfs: {node} cannot keep the image on a tmpfs: {got['refused']}")
        return got["path"], got["on"], got.get("why", "")

    # -- reservations --------------------------------------------------------------------------
    def reserve(self, worker: WorkerRecord, node: str, name: str, timeout: float = 15.0) -> list[int]:
        """Hold `worker.gpus` GPUs on `node` in placement group `name`; returns the node's GPU
        indices Ray gave it (fixed for the group's life: what the worker's cell gets)."""
        import ray
        from ray.util import placement_group

        info = self.ctl.inventory().get(node)
        if self.ctl.config.get("node_names") and info is not None:
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
            rc.add_replica(worker_id, w.model, endpoint or w.endpoint, tokenizer_of(w), w.engine)
            return fn(rc)

    def hold(self, worker_id: str) -> None:
        self._router(worker_id, lambda rc: rc.hold(worker_id))

    def switch(self, worker_id: str, endpoint: str) -> dict:
        return self._router(worker_id, lambda rc: rc.switch(worker_id, endpoint), endpoint)

    def release(self, worker_id: str) -> None:
        self._router(worker_id, lambda rc: rc.release(worker_id))

    # -- agents --------------------------------------------------------------------------------
    def dump(self, node: str, cell_id: str, image_dir: str, page_server: dict | None = None) -> dict:
        if page_server is not None:
            return self.call(node, "dump", cell_id, image_dir, page_server=page_server)
        return self.call(node, "dump", cell_id, image_dir)

    # -- transfer modes (relocator.agent.transfers) ---------------------------------------------
    def shared_storage(self, src: str, dst: str) -> bool:
        """Whether `dst` sees `src`'s image store (a token written by one, read by the other)."""
        probe = self.call(src, "store_token", timeout=30)
        try:
            return bool(self.call(dst, "sees", probe["path"], probe["token"], timeout=30))
        finally:
            try:
                self.call(src, "drop_token", probe["path"], timeout=30)
            except Exception:  # noqa: BLE001 - a leftover probe file is harmless
                pass

    def transfer_plan(self, worker: WorkerRecord, dst: str, requested: TransferMode) -> tuple[TransferMode, str]:
        """The mode for a move of `worker` to `dst`: `auto` resolved (shared when both see the
        image store, postcopy when both nodes' kernels and CRIU allow it, else stream); an
        explicit postcopy that a node cannot do is refused before anything moves."""
        from relocator.controller.machine import PlanError

        requested = TransferMode(requested)
        if requested in (TransferMode.SHARED, TransferMode.STREAM):
            return requested, ""
        src_info = self.call(worker.node, "transfer_info", timeout=60)
        dst_info = self.call(dst, "transfer_info", timeout=60)
        problems = postcopy_problems(src_info, dst_info)
        if requested is TransferMode.POSTCOPY:
            if problems:
                raise PlanError("transfer postcopy is not possible: " + "; ".join(problems))
            return requested, ""
        if self.shared_storage(worker.node, dst):
            return TransferMode.SHARED, f"{dst} sees {worker.node}'s image store"
        if not problems:
            return TransferMode.POSTCOPY, "no shared image store; both kernels support post-copy"
        return TransferMode.STREAM, "no shared image store; no post-copy: " + "; ".join(problems)

    def open_page_server(self, node: str, image_dir: str) -> dict:
        return self.call(node, "open_page_server", image_dir, timeout=60)

    def dump_lazy(self, node: str, cell_id: str, image_dir: str) -> dict:
        return self.call(node, "dump_lazy", cell_id, image_dir)

    def postcopy_status(self, node: str, cell_id: str) -> dict:
        return self.call(node, "postcopy_status", cell_id, timeout=30)

    def postcopy_wait(self, node: str, cell_id: str, timeout: float = 1.0) -> dict:
        """The target's post-copy, once ended or after `timeout`; a lost target node counts as
        the copy being gone."""
        try:
            return self.call(node, "postcopy_wait", cell_id, timeout, timeout=timeout + 30)
        except NodeLost:
            return {"state": "failed", "why": "target", "error": f"target node {node} lost"}

    def lazy_dump_wait(self, node: str, cell_id: str, timeout: float = 1.0) -> dict:
        try:
            return self.call(node, "lazy_dump_wait", cell_id, timeout, timeout=timeout + 30)
        except NodeLost:
            return {"done": True, "lost": True}

    def transfer(self, src: str, dst: str, image_dir: str, dst_image_dir: str) -> dict:
        return self.call(dst, "receive_image", src, image_dir, dst_image_dir)

    def restore(self, node: str, image_dir: str, cell_id: str, verified: bool = False,
                gpu_ids: list[int] | None = None, page_source: dict | None = None) -> dict:
        # "auto": a streamed image was hashed on arrival and stamped, a dump on this host
        # stamped its own files; anything else is hashed again before it is restored
        if page_source is not None:
            return self.call(node, "restore", image_dir, cell_id, verify="auto", gpu_ids=gpu_ids,
                             page_source=page_source)
        return self.call(node, "restore", image_dir, cell_id, verify="auto", gpu_ids=gpu_ids)

    def cell_state(self, node: str, cell_id: str) -> str:
        """running | stopped | absent, or lost when the node is gone."""
        deadline = time.monotonic() + AGENT_TIMEOUT_S
        while True:  # an agent that is restarting answers a moment later
            try:
                return self.call(node, "cell_state", cell_id)
            except NodeLost:
                return "lost"
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def resume(self, node: str, cell_id: str) -> None:
        self.call(node, "resume", cell_id)

    def kill(self, node: str, cell_id: str) -> None:
        """Kill a cell through its agent; on a lost node (or an agent that died with it),
        fence it from here."""
        try:
            self.call(node, "kill", cell_id)
        except NodeLost:
            self.fence(node, [cell_id])
        except Exception:
            if self.node_alive(node, fresh=True):
                raise
            self.fence(node, [cell_id])

    def remove_image(self, node: str, image_dir: str) -> None:
        try:
            self.call(node, "remove_image", image_dir)
        except NodeLost:
            import shutil

            # shared storage (or this very host): the files are reachable from here
            shutil.rmtree(image_dir, ignore_errors=True)


def bundle_gpu_ids(pg, gpus: int, timeout: float = 15.0) -> list[int]:
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
