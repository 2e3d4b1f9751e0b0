"""Embedding entry points: `relocator.connect()` and `relocator.start()`.

    import relocator
    ctl = relocator.start(nodes=2, gpus_per_node=4)      # or relocator.connect()
    w = ctl.launch("tiny-llama", gpus=2)                  # makes room with live moves if needed
    print(ctl.relocate(w["id"]))                          # phases with timings
    ctl.suspend(w["id"]); ctl.resume(w["id"])             # set aside, restored anywhere compatible
    print(ctl.pending(), ctl.consolidate(dry_run=True))   # waiting demands; a packing plan
    for ev in ctl.events():                               # phase changes, rollbacks, lost nodes, ...
        print(ev["kind"], ev)
    ctl.down()
"""

from __future__ import annotations

import os

# Ray reads this when it is first imported: keep every node and listener on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

from relocator.agent.agent import NAMESPACE
from relocator.controller.controller import CONTROLLER_NAME


class ControllerClient:
    """Blocking calls on the controller actor."""

    def __init__(self, handle: Any, info: dict[str, Any] | None = None) -> None:
        self.handle = handle
        self.info = info or {}

    def _call(self, method: str, *args: Any, timeout: float | None = 900, **kw: Any) -> Any:
        import ray
        from ray.exceptions import RayTaskError

        try:
            return ray.get(getattr(self.handle, method).remote(*args, **kw), timeout=timeout)
        except RayTaskError as exc:  # the controller's own exception, not Ray's wrapper
            cause = getattr(exc, "cause", None)
            if isinstance(cause, Exception):
                raise cause from None
            raise

    @property
    def router_url(self) -> str | None:
        return self.info.get("router_url")

    def status(self) -> dict:
        return self._call("status", timeout=60)

    def launch(self, model: str = "tiny-llama", gpus: int = 1, node: str | None = None,
               worker_id: str | None = None, engine: str | None = None, *, priority: int = 0,
               time_limit: str | float | None = None, make_room: bool = True, dry_run: bool = False,
               faults: dict | None = None, labels: dict[str, str] | None = None) -> dict:
        """Start a worker; makes room with live moves (or, for a higher `priority`, suspends
        lower-priority workers) when no node has `gpus` free GPUs. Returns the worker, or
        {"id", "state": "pending", "demand"} when it must wait (the controller starts it when
        capacity returns), or {"dry_run": True, "plan"} with `dry_run`. `make_room=False`: a
        stock scheduler (RuntimeError when nothing fits). `time_limit`: 90, "90s", "15m", "2h";
        past it the worker is preemptible (suspended only when a demand or a drain needs its GPUs)."""
        return self._call("launch", model, gpus, node, worker_id, engine, priority, time_limit, make_room,
                          dry_run, faults, labels)

    def policies(self, dry_run: bool = False) -> dict:
        """The loaded policies and the invalid ones; `dry_run`: what each would do now."""
        return self._call("list_policies", dry_run, timeout=60)

    def apply_policies(self, doc: dict | None = None) -> dict:
        """Replace the policies with `doc` ({"policies": [...]}); None: reload the policies file."""
        return self._call("apply_policies", doc, timeout=60)

    def notice(self, node: str, at: float | None, reason: str = "") -> dict:
        """`node` goes away at `at` (epoch; None: withdraw): the node-notice policies act on it."""
        return self._call("notice", node, at, reason, timeout=60)

    def mark_gpus(self, node: str, kind: str, gpus: list[int] | None = None, count: int = 0) -> dict:
        """Fake GPUs only: `gpus` (indexes) or `count` idle GPUs of `node` read as `kind` ("remap",
        "xid79", ...: relocator.agent.fakenvml.MARKS), so the gpu-health path runs without hardware."""
        return self._call("mark_gpus", node, kind, gpus, count, timeout=60)

    def clear_gpus(self, node: str, gpus: list[int] | None = None) -> dict:
        """GPUs of `node` were reset (None: all its unhealthy ones): their Xids are forgotten and
        their holds released once they read healthy."""
        return self._call("clear_gpus", node, gpus, timeout=60)

    def suspend(self, worker: str) -> dict:
        """Checkpoint `worker` to the image store and free its GPUs (traffic: sibling or held)."""
        return self._call("suspend", worker)

    def resume(self, worker: str, node: str | None = None) -> dict:
        """Restore a suspended worker (on `node`, or where the planner seats it) and switch its
        traffic back; {"state": "pending", ...} when there is no room now."""
        return self._call("resume", worker, node)

    def consolidate(self, dry_run: bool = False, max_moves: int = 10, transfer: str | None = None) -> dict:
        """Pack running workers onto the fewest nodes with live moves: nodes_freed, moves (each
        with its result and blackout_s), gpus_moved."""
        return self._call("consolidate", dry_run, max_moves, transfer, timeout=3600)

    def pending(self) -> list[dict]:
        """Demands waiting for GPUs (launches and requeued resumes): id, kind, model, gpus,
        priority, since, reason."""
        return self._call("pending", timeout=60)

    def prefetch_images(self, node: str, key: str | None = None, src: str | None = None) -> dict:
        """Copy warm images to `node` now: every one it lacks, or `key`; from `src` or any holder."""
        return self._call("prefetch_images", node, key, src, timeout=3600)

    def uncordon(self, node: str) -> dict:
        """Let the planner use a node drained with `by` again."""
        return self._call("uncordon", node, timeout=60)

    def cancel(self, demand: str) -> dict:
        """Drop a pending demand."""
        return self._call("cancel", demand, timeout=60)

    def why(self, demand: str) -> dict:
        """Why a demand waits: cause (never_fits, nodes, priority, fragmentation, capacity,
        fits_now), each check with its evidence, the free GPUs per node, the plan and its cost.
        KeyError: no such demand."""
        return self._call("why", demand, timeout=60)

    def relocate(self, worker: str, to: str | None = None, transfer: str | None = None,
                 faults: dict | None = None, wait: bool = True) -> dict:
        return self._call("relocate", worker, to, transfer, faults, wait)

    def wait_relocation(self, relocation_id: str, timeout: float = 900) -> dict:
        return self._call("wait_relocation", relocation_id, timeout, timeout=timeout + 30)

    def get_relocation(self, relocation_id: str) -> dict | None:
        return self._call("get_relocation", relocation_id, timeout=60)

    def drain(self, node: str, parallel: int = 1, transfer: str | None = None, by: float | str | None = None) -> dict:
        return self._call("drain", node, parallel, transfer, by, timeout=3600)

    def stop_worker(self, worker: str) -> dict:
        return self._call("stop_worker", worker)

    def events(self, since: int | None = None, kinds: Iterable[str] | None = None,
               idle_timeout: float | None = None, wait_s: float = 20.0) -> Iterator[dict]:
        """The controller's events as they happen (relocator.controller.events.EventKind): every
        relocation phase started and ended, rollbacks, relocations finished, nodes and workers
        lost, replacements. Each is a dict with `seq`, `ts`, `kind` and its fields.

        `since`: None = from now on; 0 = the whole stored history first; n = after event n (the
        `seq` of the last one handled: a consumer that restarts misses nothing). `kinds`: only
        these. `idle_timeout`: stop after that many seconds without an event (None: never).
        Underneath, one long-poll call on the controller at a time (`wait_s` each); a restarting
        controller is waited for (its events are stored, so none is lost). "Now" is when
        `events()` is called (a bad `kinds` is refused then too), not when iteration begins."""
        from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_fixed

        from ray.exceptions import GetTimeoutError, RayActorError

        from relocator.controller.events import EventKind

        wanted = {EventKind(k).value for k in kinds} if kinds is not None else None
        retrying = Retrying(stop=stop_after_delay(120), wait=wait_fixed(0.5), reraise=True,
                            retry=retry_if_exception_type((RayActorError, GetTimeoutError)))
        cursor = since if since is not None else retrying(self._call, "events_cursor", timeout=60)
        return self._follow(cursor, wanted, idle_timeout, wait_s, retrying)

    def _follow(self, cursor: int, wanted: set[str] | None, idle_timeout: float | None, wait_s: float,
                retrying: Any) -> Iterator[dict]:
        last_event = time.monotonic()
        while True:
            wait = wait_s if idle_timeout is None else max(0.0, min(wait_s, last_event + idle_timeout - time.monotonic()))
            got = retrying(self._call, "wait_events", cursor, wait, timeout=wait + 60)
            for ev in got["events"]:
                cursor = ev["seq"]
                last_event = time.monotonic()
                if wanted is None or ev["kind"] in wanted:
                    yield ev
            cursor = max(cursor, got["cursor"])
            if not got["events"] and idle_timeout is not None and time.monotonic() - last_event >= idle_timeout:
                return

    def cells(self) -> dict:
        return self._call("cells", timeout=120)

    def ping(self) -> dict:
        return self._call("ping", timeout=60)

    def down(self) -> dict:
        from relocator.cluster.local import down

        base = self.info.get("base_dir")
        try:
            import ray

            ray.shutdown()
        except Exception:  # noqa: BLE001
            pass
        return down(base)


def connect(base_dir: str | Path | None = None, address: str | None = None) -> ControllerClient:
    """Attach to a running cluster: the one `relocator up` started from `base_dir` (default
    $RELOCATOR_CLUSTER_DIR or /var/lib/relocator/cluster), or a Ray cluster at `address`
    where the controller already runs."""
    import ray

    from relocator.cluster.config import cluster_dir
    from relocator.cluster.local import RAY_ENV, read_info

    info: dict[str, Any] = {}
    if address is None:
        base = Path(base_dir) if base_dir else cluster_dir()
        info = read_info(base) or {}
        if not info.get("address"):
            raise RuntimeError(f"no local cluster running from {base} (run `relocator up`)")
        address = info["address"]
    for k, v in {**RAY_ENV, **info.get("ray_env", {})}.items():
        os.environ.setdefault(k, v)
    if not ray.is_initialized():
        if address.startswith("ray://"):  # Ray Client (a deployed or emulated cluster, from outside it)
            from relocator.deploy.deploy import init_ray

            init_ray(address)
        else:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="error")
    if not info.get("router_url"):  # a deployed cluster (`relocator deploy`) describes itself in Ray
        from relocator.deploy import deployment

        info = {**(deployment() or {}), **info}
    handle = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    return ControllerClient(handle, info)


def start(config: Any = None, **cluster: Any) -> ControllerClient:
    """Start a local cluster (configs/local.yaml, overridden by `cluster` keys such as
    nodes=2, gpus_per_node=4, base_dir=...) and connect to its controller."""
    from relocator.cluster.config import LocalConfig
    from relocator.cluster.local import up

    if not isinstance(config, LocalConfig):
        config = LocalConfig.load(config, cluster=cluster)
    info = up(config)
    return connect(info["base_dir"])
