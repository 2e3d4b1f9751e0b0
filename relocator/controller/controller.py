"""The controller: one named, detached Ray actor, a thin facade over a few state managers in
the style of Ray Serve's controller: nodes (nodes.py), workers (workers.py), demands
(demands.py), suspensions (suspensions.py), relocations (relocations.py) and drains
(drain.py). One reconcile loop calls their `update` steps in order, each caught and timed.

Everything it must remember lives in a sqlite file; on (re)start it re-reads it and completes or
rolls back every relocation that was open when it died.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from relocator.agent.agent import NAMESPACE, start_agent
from relocator.controller.backend import BackendPorts, RayBackend
from relocator.controller.claims import Claims
from relocator.controller.config import ControllerConfig
from relocator.controller.demands import DemandManager, Seaters
from relocator.controller.drain import DrainManager
from relocator.controller.events import EventKind, EventLog
from relocator.controller.inventory import NodeInfo, ray_nodes
from relocator.controller.machine import Machine
from relocator.controller.model import SuspendReason, WorkerState
from relocator.controller.preemption import SetAside
from relocator.controller.nodes import ORPHAN_AFTER_S, NodeManager, ray_placement_groups
from relocator.controller.relocations import BLACKOUT_PHASES, RelocationManager, env_faults
from relocator.controller.states import HOLDING_STATES
from relocator.controller.store import Store
from relocator.controller.suspensions import SUSPEND_BACKOFF_MAX_S, SUSPEND_BACKOFF_S, SuspensionManager
from relocator.controller.workers import WorkerManager, drop_last_image

__all__ = ["BLACKOUT_PHASES", "CONTROLLER_NAME", "Controller", "HOLDING_STATES", "ORPHAN_AFTER_S",
           "SUSPEND_BACKOFF_MAX_S", "SUSPEND_BACKOFF_S", "env_faults", "start_controller"]
CONTROLLER_NAME = "relocator-controller"
NODE_WATCH_S = 0.5  # how often Ray's node table is read for nodes declared dead
log = logging.getLogger("relocator.controller")


class Controller:
    def __init__(self, config: ControllerConfig | dict[str, Any]) -> None:
        self.started_at = time.time()
        self._setup(ControllerConfig.of(config))
        self.event_log = EventLog(self.store, self.base_dir / "events.jsonl")
        ports = BackendPorts(self.inventory, self.node_dir, self.place, self.router, self.store.worker, self.config.get,
                             self.warm_image_for)
        self._wire(RayBackend(ports), lambda kind, **fields: self.event_log.emit(kind, fields))
        self.metrics = self._serve_metrics()
        self.api = self._serve_api()
        self._start()
        self.init_s = round(time.time() - self.started_at, 3)

    @classmethod
    def without_ray(cls, config: ControllerConfig | dict[str, Any], backend: Any, emit: Callable[..., Any],
                    nodes: dict[str, NodeInfo], store: Store | None = None) -> "Controller":
        """The same managers on fakes (a backend, a fixed node table, an event sink): no Ray, no
        threads, nothing recovered. For tests."""
        c = cls.__new__(cls)
        c.started_at, c.init_s, c.metrics, c.recovering, c.agents = time.time(), 0.0, None, [], {}
        c._setup(ControllerConfig.of(config), store)
        c.event_log = EventLog(c.store)  # status reads its cursor; events go to `emit`
        c._wire(backend, emit, list_nodes=lambda known, named: dict(nodes), placement_groups=lambda: [])
        return c

    def _setup(self, config: ControllerConfig, store: Store | None = None) -> None:
        self.config = config
        self.base_dir = Path(config.base_dir)
        self.router_control_url, self.router_token = config.router_control_url, config.router_token
        self.router_url = config.router_url
        self.transfer, self.policy = config.transfer, config.policy
        self.interval = config.reconcile_interval_s
        self.store = store or Store(self.base_dir / "controller.db")
        self.claims = Claims()
        self.loop_stats: dict[str, Any] = {}
        self._stop = threading.Event()

    def _wire(self, backend: Any, emit: Callable[..., Any], list_nodes: Callable[..., dict] = ray_nodes,
              placement_groups: Callable[[], list[dict]] = ray_placement_groups) -> None:
        """Every manager, each given only what it uses."""
        from relocator.controller.periodic import PeriodicConsolidation

        cfg, store, claims = self.config, self.store, self.claims
        self.backend, self.emit = backend, emit
        self.machine = Machine(store, backend, keep_images=cfg.keep_images, keep_last_image=cfg.keep_last_image,
                               handoff_window_s=cfg.handoff_window_s, on_event=lambda kind, fields: emit(kind, **fields))
        self.nodes = NodeManager(store, backend, claims, emit, self.node_dir, cfg.node_names, list_nodes,
                                 placement_groups)
        self.demands = DemandManager(store, claims, emit, self.nodes.inventory, self.nodes.cordoned,
                                     self.policy.value, cfg.make_room_max_moves, rule=cfg.preemption)
        self.workers = WorkerManager(store, backend, claims, emit, self.router, self.demands.place,
                                     has_router=lambda: bool(self.router_control_url))
        self.suspensions = SuspensionManager(store, backend, claims, emit, self.router, self.node_dir,
                                             self.demands.queue, self.transfer, cfg.keep_last_image)
        self.relocations = RelocationManager(store, self.machine, claims, emit, self.nodes.inventory,
                                             self.nodes.check_target, self.demands.view, self.transfer)
        self.drains = DrainManager(store, self.nodes.inventory, lambda: self.demands.view()[0], self.nodes.cordon,
                                   self.policy, self.relocations.relocate, self.suspensions.suspend)
        # a demand's victims go as the preemption rule says (suspended, evicted, paused in place)
        self.set_aside = SetAside(cfg.preemption, store, backend, claims, emit, self.router, self.demands.queue,
                                  self.suspensions.suspend, free_gpus=lambda: {
                                      n.id: n.gpus_free for n in self.nodes.inventory(refresh=True).values()
                                      if n.alive})
        self.demands.seaters = Seaters(claim=self.workers.claim, start=self.workers.start_claimed,
                                       claim_resume=self.suspensions.claim, restore=self.suspensions.restore,
                                       suspend=self.set_aside, run_moves=self.relocations.run_moves)
        self.periodic = PeriodicConsolidation(
            cfg.consolidate, plan=lambda k: self.consolidate(dry_run=True, max_moves=k),
            run=lambda k: self.consolidate(max_moves=k), busy=self.demands.busy)
        self._wire_why()
        self._wire_policies()
        self._wire_warm_copies()

    def _wire_warm_copies(self) -> None:
        """Warm images kept on `prefetch.copies` other nodes, other hosts first (warmcopies.py)."""
        from relocator.controller.inventory import ray_hosts
        from relocator.controller.warmcopies import WarmCopies, busy_nodes, stored_counter

        live = lambda: {n.id: n.ray_node_id for n in self.nodes.inventory().values() if n.alive}  # noqa: E731
        agents = getattr(self.backend, "agents", None)  # a fake backend (without_ray) has none
        self.warm_copies = WarmCopies(
            nodes=lambda: list(live()) if agents is not None else [], keys=lambda n: agents.warm_keys(n),
            fetch=lambda dst, src, key: agents.fetch_warm(dst, src, key), emit=self.emit,
            host_of=lambda: ray_hosts(live()), cordoned=self.cordoned,
            busy=lambda: busy_nodes(self.claims, self.store), count=stored_counter(self.store),
            cancel=lambda dst, key: agents.call(dst, lambda a: a.cancel_warm_copy.remote(key), "cancel_warm_copy", 10))
        self.workers.image_holders = self.warm_copies.holders_of

    def warm_image_for(self, worker_id: str, node: str) -> dict[str, Any]:
        """Whether a start of `worker_id`'s kind on `node` would be warm (controller/warmwhere.py):
        what `auto` picks a handoff on (relocator.controller.transfers.handoff)."""
        from relocator.controller.inventory import ray_hosts
        from relocator.controller.warmwhere import warm_start
        from relocator.warm.config import WarmConfig

        agents = getattr(self.backend, "agents", None)
        if agents is None:  # a fake backend (without_ray)
            return {"warm": "", "why": "no node agents to ask"}
        live = {n.id: n.ray_node_id for n in self.nodes.inventory().values() if n.alive}
        return warm_start(self.workers.kinds.get(worker_id), node, agents.warm_keys, self.warm_copies.holders,
                          lambda: ray_hosts(live), WarmConfig.load())

    def _wire_why(self) -> None:
        """`why` (relocator/controller/explain.py): its inputs, and the launch refusal of a
        request that can never fit."""
        from relocator.controller.explain import Explainer

        store = self.store
        self.explainer = Explainer(
            demands=store.demands, inventory=self.nodes.inventory, view=self.demands.view, cordoned=self.cordoned,
            registered=lambda: {d["id"] for d in store.all("node") if "gpus" in d and "id" in d},
            lost_since=lambda: dict(self.nodes.lost),
            plan=lambda d: self.demands.plan_seating(d, make_room=True).to_dict(),
            expected=lambda: (self.config.node_names or {}).values())
        self.demands.refuse = self.explainer.refusal

    def _serve_api(self):
        """The controller's read-only HTTP API (relocator/controller/httpapi.py: /v1/why/<demand>,
        /v1/pending), beside /metrics; None if it cannot listen: it never keeps the controller from
        running."""
        from relocator.controller.httpapi import ApiServer

        try:
            return ApiServer(self.store, self.why, lambda: self.explainer.annotate(self.pending()),
                             host=self.config.metrics_host)
        except Exception as exc:  # noqa: BLE001
            log.error("controller api not served: %s", exc)
            return None

    def _wire_policies(self) -> None:
        """Policies that start moves (relocator/policies, docs/policies.md): their engine is the
        reconcile loop's last step."""
        from relocator.controller.policyports import policy_engine

        self.policies = policy_engine(self)

    def _start(self) -> None:
        """A restarted controller first finishes the relocations it left open (their workers are
        frozen or held meanwhile), then what launches and suspends it left half done."""
        nodes = self.inventory(refresh=True)
        for name, info in nodes.items():  # agents of a running cluster: handles before recovery
            if info.alive:
                try:
                    self.backend.agent(name)
                except ValueError:  # a new cluster: created below
                    pass
        self.recovering = self.relocations.recover()
        self.agents = {name: start_agent(name, info.ray_node_id, str(self.node_dir(name) / "state"),
                                         str(self.node_dir(name) / "images"), self.config.credentials_of(name))
                       for name, info in nodes.items() if info.alive}
        self._recover_workers()
        self.demands.recover()
        threading.Thread(target=self._loop, name="reconcile", daemon=True).start()
        threading.Thread(target=self.nodes.watch, args=(self._stop, NODE_WATCH_S), name="node-watch",
                         daemon=True).start()

    def _recover_workers(self) -> None:
        """A launch, replacement, suspend or resume the previous controller did not finish."""
        for w in self.store.workers():
            if w.id in self.claims.busy:
                continue
            if w.state == WorkerState.STARTING:
                self.workers.abandon_launch(w)
            elif w.state == WorkerState.REPLACING:  # its half-started copy goes
                self.workers.abandon_launch(w, keep_record=True)
            elif w.state in (WorkerState.SUSPENDING, WorkerState.RESUMING):
                self.suspensions.recover(w)

    # -- plumbing -------------------------------------------------------------------------------
    def _serve_metrics(self):
        """The controller's /metrics (relocator.controller.metrics), or None if it cannot listen:
        metrics never keep the controller from running."""
        from relocator.controller.metrics import MetricsServer

        try:
            return MetricsServer(self.store, self.inventory, host=self.config.metrics_host,
                                 port=self.config.metrics_port)
        except Exception as exc:  # noqa: BLE001
            log.error("controller metrics not served: %s", exc)
            return None

    def node_dir(self, node: str) -> Path:
        return self.base_dir / "nodes" / node

    def router(self):
        from relocator.router.client import RouterControlSync

        if not self.router_control_url:
            raise RuntimeError("the controller has no router configured")
        return RouterControlSync(self.router_control_url, token=self.router_token)

    def inventory(self, refresh: bool = False) -> dict[str, NodeInfo]:
        return self.nodes.inventory(refresh)

    def place(self, gpus: int, exclude: tuple[str, ...] = ()) -> str | None:
        """The live, uncordoned node the planner's policy puts a `gpus`-GPU worker on (None: no
        room): the scheduling view every placement plans on."""
        return self.demands.place(gpus, exclude)

    def ping(self) -> dict:
        return {"pid": os.getpid(), "started_at": self.started_at, "init_s": getattr(self, "init_s", None),
                "recovering": self.recovering}

    # -- reconcile loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        wake = self.claims.wake
        while not self._stop.is_set():
            wake.wait(self.interval)
            wake.clear()
            if not self._stop.is_set():
                self.reconcile_once()

    def steps(self) -> list[tuple[str, Callable[[], None]]]:
        """The reconcile loop's steps, in order (named as before the split: status shows them)."""
        return [("update_nodes", self.nodes.update), ("update_workers", self.workers.update),
                ("update_router", self.workers.update_router),
                ("update_reservations", self.nodes.update_reservations), ("update_cells", self.nodes.update_cells),
                ("update_deadlines", self.demands.update_deadlines), ("update_paused", self.set_aside.in_place.update),
                ("update_demands", self.demands.update),
                ("update_consolidation", self.periodic.update), ("update_policies", self.policies.update),
                ("update_warm_copies", self.warm_copies.update)]

    def reconcile_once(self) -> dict:
        stats = {}
        for name, step in self.steps():
            t0 = time.monotonic()
            try:
                step()
                stats[name] = {"ok": True, "s": round(time.monotonic() - t0, 4)}
            except Exception as exc:  # noqa: BLE001 - one failing step never stops the loop
                stats[name] = {"ok": False, "s": round(time.monotonic() - t0, 4), "error": str(exc)}
        self.loop_stats = {"at": time.time(), **stats}
        return self.loop_stats

    def update_deadlines(self) -> None:
        self.demands.update_deadlines()

    # -- workers and demands ----------------------------------------------------------------------
    def launch(self, model: str = "tiny-llama", gpus: int = 1, node: str | None = None,
               worker_id: str | None = None, engine: str | None = None, priority: int = 0,
               time_limit: str | float | None = None, make_room: bool = True, dry_run: bool = False,
               faults: dict | None = None, labels: dict[str, str] | None = None) -> dict:
        """Start a worker and register it with the router once it serves. Placed by the planner
        unless `node` is given; when no node has `gpus` free GPUs it makes room (the fewest live
        moves, else, for a higher `priority`, the fewest lower-priority workers suspended) unless
        `make_room` is False (then: RuntimeError, as a stock scheduler). A demand that cannot be
        met now is queued: returns {"id", "state": "pending", "demand"}; the reconcile loop starts
        it when capacity allows. `dry_run`: the plan only. `time_limit` (90, "90s", "15m", "2h"):
        after running that long it is preemptible: suspended and requeued only when a waiting
        demand or a drain's deadline needs its GPUs. `faults`: injected into the first move.
        `labels` ({k: v}): what a policy's filter matches (docs/policies.md)."""
        out = self.demands.launch(model, gpus, node, worker_id, engine, priority, time_limit, make_room, dry_run,
                                  faults, new_id=self.workers.new_worker_id, check_target=self.nodes.check_target)
        if labels and not dry_run and out.get("id"):
            self.policies.set_labels(out["id"], labels)
        return out

    def suspend(self, worker_id: str, reason: str = SuspendReason.OPERATOR, by: str | None = None) -> dict:
        """Checkpoint a running worker to the image store and free its GPUs. The router sends its
        model's new requests to a sibling (the streams the suspend cuts continue there), or holds
        them (bounded, 503 on timeout) with the cut streams until it resumes. Suspended for any
        reason but `operator`, it is requeued: a resume demand waits in `pending`."""
        return self.suspensions.suspend(worker_id, reason, by)

    def resume(self, worker_id: str, node: str | None = None) -> dict:
        """Restore a suspended worker on `node` (or wherever the planner seats it, making room as
        a launch does) and switch its traffic back: held requests are released and cut streams
        continue token-exactly. No room now: its resume demand waits in `pending`."""
        return self.suspensions.resume(worker_id, node, seat=self.demands.seat, check_target=self.nodes.check_target)

    def pending(self) -> list[dict]:
        """Demands waiting for GPUs, highest priority first, then oldest."""
        return self.demands.pending()

    def cancel(self, demand_id: str) -> dict:
        """Drop a pending demand (a suspended worker stays suspended: `resume` or `stop` it)."""
        return self.demands.cancel(demand_id)

    def why(self, demand_id: str) -> dict:
        """Why a demand waits, the ordinary causes ruled out first, then fragmentation with the
        free GPUs per node and the plan that would seat it (relocator/controller/why.py).
        KeyError: no such demand."""
        return self.explainer.why(demand_id)

    # -- policies (docs/policies.md) -----------------------------------------------------------
    def list_policies(self, dry_run: bool = False) -> dict:
        """The loaded policies (and the invalid ones, with why); `dry_run`: what each would do now."""
        return self.policies.dry_run() if dry_run else self.policies.listing()

    def apply_policies(self, doc: dict | None = None) -> dict:
        """Replace the policies with `doc` ({"policies": [...]}); None: reload the policies file."""
        return self.policies.reload() if doc is None else self.policies.apply(doc)

    def notice(self, node: str, at: float | None, reason: str = "") -> dict:
        """Tell `node`'s agent that the node goes away at `at` (epoch; None: withdraw the notice)."""
        if node not in self.inventory():
            raise ValueError(f"unknown node {node!r}")
        return {"node": node, "notice": self.backend.agents.set_notice(node, at, reason)}

    def mark_gpus(self, node: str, kind: str, gpus: list[int] | None = None, count: int = 0) -> dict:
        """Fake GPUs: `gpus` (indexes) or `count` idle GPUs of `node` read as `kind` (a pending
        remap, an Xid: relocator.agent.fakenvml.MARKS) from now on (controller/gpuops.py)."""
        from relocator.controller.gpuops import mark_gpus

        return mark_gpus(self, node, kind, gpus, count)

    def clear_gpus(self, node: str, gpus: list[int] | None = None) -> dict:
        """GPUs of `node` reset (None: all its unhealthy ones): Xids forgotten; held GPUs are
        released once they read healthy (controller/gpuops.py)."""
        from relocator.controller.gpuops import clear_gpus

        return clear_gpus(self, node, gpus)

    def stop_worker(self, worker_id: str) -> dict:
        return self.workers.stop(worker_id, cancel=self.demands.cancel)

    # -- relocations and drains ---------------------------------------------------------------------
    def consolidate(self, dry_run: bool = False, max_moves: int = 10, transfer: str | None = None) -> dict:
        """Pack the running workers onto the fewest nodes with live moves (planner.consolidate)."""
        return self.relocations.consolidate(dry_run, max_moves, transfer)

    def relocate(self, worker_id: str, to: str | None = None, transfer: str | None = None,
                 faults: dict | None = None, wait: bool = True, timeout: float = 900.0) -> dict:
        return self.relocations.relocate(worker_id, to, transfer, faults, wait, timeout)

    def wait_relocation(self, relocation_id: str, timeout: float = 900.0) -> dict:
        return self.relocations.wait(relocation_id, timeout)

    def get_relocation(self, relocation_id: str) -> dict | None:
        rel = self.store.relocation(relocation_id)
        return rel.to_dict() if rel else None

    def drain(self, node: str, parallel: int = 1, transfer: str | None = None, by: float | str | None = None) -> dict:
        """Move every worker off `node`, live; `parallel` relocations at a time. With `by` (an
        epoch time, or a duration from now: 600, "10m"), the node is cordoned (nothing is placed
        or resumed on it until `uncordon`), and a worker that fits nowhere else, or whose move
        has not started by then, is suspended instead (requeued: it resumes elsewhere when
        capacity returns). Without `by`, a worker that fits nowhere fails the drain up front."""
        return self.drains.drain(node, parallel, transfer, by)

    def cordoned(self) -> set[str]:
        """Nodes drained with a deadline: nothing is placed or resumed on them until uncordoned."""
        return self.nodes.cordoned()

    def prefetch_images(self, node: str, key: str | None = None, src: str | None = None) -> dict:
        """Copy warm images to `node` now (all it lacks, or `key`; from `src` or any holder)."""
        return self.warm_copies.prefetch(node, key, src)

    def uncordon(self, node: str) -> dict:
        return self.nodes.uncordon(node)

    # -- reporting ---------------------------------------------------------------------------------
    def status(self) -> dict:
        nodes = self.inventory(refresh=True)
        now = time.time()
        return {
            "router_url": self.router_url,
            "router_control_url": self.router_control_url,
            "nodes": [{**n.to_dict(), "lost_at": self.nodes.lost.get(n.id)} for n in nodes.values()],
            "workers": [worker_status(w, now) for w in self.store.workers()],
            "pending": self.explainer.annotate(self.pending()),  # each with its `why`
            "api": self.api.url if getattr(self, "api", None) else None,  # GET /v1/why/<demand>
            "cordoned": sorted(self.cordoned()),
            "gpu_health": self.policies.gpus.states(),  # GPUs not healthy (docs/policies.md)
            "relocations": [r.summary() for r in self.store.relocations()],
            "controller": {**self.ping(), "loop": self.loop_stats, "consolidation": self.periodic.last},
            # where Prometheus scrapes (docs/observability.md) and where events go
            "metrics": {"controller": self.metrics.url if self.metrics else None,
                        "router": f"{self.router_url.rstrip('/')}/metrics" if self.router_url else None},
            "events": {"log": str(self.base_dir / "events.jsonl"), "last": self.event_log.last},
        }

    # -- events ------------------------------------------------------------------------------------
    def events_cursor(self) -> int:
        """The number of the newest event: a subscriber that starts now passes it to wait_events."""
        return self.event_log.last

    def wait_events(self, after: int, timeout: float = 20.0, limit: int = 1000) -> dict:
        """Events numbered above `after`, waiting up to `timeout` s for one (a long poll)."""
        return self.event_log.wait(after, min(float(timeout), 60.0), limit)

    def cells(self) -> dict[str, list[dict]]:
        return {name: self.backend.agents.cells(name, timeout=60) for name, info in self.inventory().items()
                if info.alive}

    def shutdown(self) -> dict:
        """Stop every worker and free every reservation (the cluster itself is stopped by `down`)."""
        self._stop.set()
        self.claims.wake.set()
        out: dict[str, Any] = {"killed": {}, "freed": []}
        self.policies.gpus.release_all()  # withheld GPUs' reservations
        for name, info in self.inventory().items():
            try:
                out["killed"][name] = (self.backend.agents.kill_all(name, timeout=120) if info.alive
                                       else self.backend.fence(name)["killed"])
            except Exception as exc:  # noqa: BLE001
                out["killed"][name] = f"error: {exc}"
        for w in self.store.workers():
            try:
                self.router().remove_replica(w.id)
            except Exception:  # noqa: BLE001
                pass
            self.backend.free(w.reservation)
            out["freed"].append(w.reservation)
            drop_last_image(self.backend, w)
            self.store.delete_worker(w.id)
        return out


STATUS_FIELDS = ("id", "model", "node", "state", "endpoint", "gpus", "gpu_ids", "replacements", "last_image",
                 "priority", "time_limit_s", "deadline", "image", "suspend_reason", "suspended_at", "suspensions",
                 "suspend_failures", "suspend_retry_at", "suspend_error", "error")


def worker_status(w: Any, now: float) -> dict:
    """One worker as `status` lists it."""
    d = w.to_dict()
    out = {k: d[k] for k in STATUS_FIELDS}
    out.update(state=str(WorkerState(w.state).value), cell=w.cell_id, reservation=w.reservation,
               preemptible=w.past_deadline(now))
    return out


def start_controller(config: dict[str, Any], ray_node_id: str | None = None):
    """The controller actor, created (detached, restarted by Ray if it dies) or found; on the
    head node, or on `ray_node_id` (`relocator deploy`'s `controller.node`)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # Pinned to the head node, like Ray Serve's controller: the cluster lives and dies with the
    # head (GCS) anyway, and a controller on a node that is lost would linger a moment next to
    # the copy Ray restarts elsewhere (seen: two controllers replacing one lost worker twice).
    return ray.remote(Controller).options(
        name=CONTROLLER_NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        max_restarts=-1, max_concurrency=64, num_cpus=0,
        **({"scheduling_strategy": NodeAffinitySchedulingStrategy(ray_node_id, soft=False)} if ray_node_id
           else {"resources": {"node:__internal_head__": 0.001}}),
    ).remote(config)
