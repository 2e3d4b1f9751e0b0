"""`deploy` and `undeploy`: relocator on a Ray cluster that someone else runs.

deploy: pick the nodes (those with the `relocator` resource), name them (hostname, told apart by
Ray node id), run the preflight on every one of them (a task pinned to the node: its own kernel,
CRIU, tools, state dir, cell subnet, real GPUs) plus the checks across hosts, then start the
router (an actor on the controller's node) and the controller (named, detached), which starts one
agent per node. Everything started is recorded in Ray's internal KV under one deployment id, so
`undeploy` removes exactly that: the workers and their reservations (the controller's shutdown),
the controller, the router, the agents, and the deployment's directory on every host.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from relocator.agent.agent import NAMESPACE, agent_name
from relocator.deploy.config import DeployConfig

KV_KEY = b"relocator/deployment"
PROBE_TIMEOUT_S = 180.0


class DeployError(RuntimeError):
    """Deploy refused or failed; `report` holds the per-host preflight when there is one."""

    def __init__(self, message: str, report: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.report = report or {}


def _refuse(problem: str | None) -> None:
    if problem:
        raise DeployError(problem)


def init_ray(address: str) -> None:
    """Attach to the cluster at `address`: `ray://HOST:10001` (Ray Client, from anywhere) or
    `HOST:6379` / `auto` (from a node of the cluster)."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return
    kw: dict[str, Any] = {"namespace": NAMESPACE, "logging_level": "error"}
    if not address.startswith("ray://"):
        kw["log_to_driver"] = False
        ray.init(address=address, **kw)
        return
    from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_fixed

    # the Ray Client server starts a process per client; on a busy head it may miss its own
    # deadline once (ConnectionAbortedError): try again
    for attempt in Retrying(stop=stop_after_attempt(3), wait=wait_fixed(2), reraise=True,
                            retry=retry_if_exception_type(ConnectionError), before_sleep=lambda _: ray.shutdown()):
        with attempt:
            ray.init(address=address, **kw)


def _kv_get() -> dict[str, Any] | None:
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(KV_KEY, namespace=NAMESPACE)
    return json.loads(raw) if raw else None


def _kv_put(record: dict[str, Any] | None) -> None:
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_put

    if record is None:
        _internal_kv_del(KV_KEY, namespace=NAMESPACE)
    else:
        _internal_kv_put(KV_KEY, json.dumps(record), overwrite=True, namespace=NAMESPACE)


def deployment(address: str | None = None) -> dict[str, Any] | None:
    """The current deployment's record (None: nothing deployed)."""
    if address:
        init_ray(address)
    return _kv_get()


def _actor(name: str):
    import ray

    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def _pinned(fn, node_id: str):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return ray.remote(fn).options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))


def _pick_controller_node(nodes: list[dict[str, Any]], names: dict[str, str], want: str | None) -> dict[str, Any]:
    if want is None:
        head = [n for n in nodes if "node:__internal_head__" in n.get("Resources", {})]
        if not head:
            raise DeployError("no head node in Ray's node table")
        return head[0]
    for n in nodes:
        if want in (n["NodeID"], n.get("NodeManagerAddress"), n.get("NodeManagerHostname"), names.get(n["NodeID"])):
            return n
    raise DeployError(f"controller.node {want!r} matches no live node (hostname, IP or Ray node id)")


def preflight(nodes: dict[str, dict[str, Any]], cfg: DeployConfig, base_dir: str,
              marker: str | None) -> dict[str, dict[str, Any]]:
    """Every selected host's report and verdict: {name: {ok, failed, warnings, hostname, ...}}."""
    import ray

    from relocator.deploy import hosts

    refs = {name: _pinned(hosts.probe, n["NodeID"]).remote(base_dir, marker) for name, n in nodes.items()}
    reports: dict[str, dict[str, Any]] = {}
    for name, ref in refs.items():
        try:
            reports[name] = ray.get(ref, timeout=PROBE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a host that cannot run the probe fails it
            reports[name] = {"checks": [{"name": "probe", "ok": False, "detail": f"{type(exc).__name__}: {exc}"}],
                             "cell_pool": "", "cell_routes": []}
    gpu_counts = {name: int(n.get("Resources", {}).get("GPU", 0)) for name, n in nodes.items()}
    extra = hosts.cross_checks(reports, gpu_counts, fake_gpus=cfg.nodes.fake_gpus,
                               shared=cfg.controller.transfer.value == "shared")
    out = {}
    for name, r in reports.items():
        n = nodes[name]
        out[name] = {**hosts.summarize(r, extra.get(name, [])), "ray_node_id": n["NodeID"],
                     "ip": n.get("NodeManagerAddress"), "ray_gpus": gpu_counts[name],
                     **{k: r.get(k) for k in ("hostname", "kernel", "criu", "cell_pool", "cell_routes", "boot_id")},
                     "real_gpus": len(r.get("gpus") or [])}
    return out


def _check_access(cfg: DeployConfig, address: str, keys: list[str]) -> bool:
    """Connect, refusing an open router or an open Ray cluster (unless insecure); whether the
    driver holds a Ray token."""
    from relocator.deploy import security

    if cfg.router.host:  # known before connecting: refuse at once
        _refuse(security.router_problem(cfg.router.host, keys, cfg.insecure))
    init_ray(address)
    has_token = security.driver_has_token()
    anonymous = security.cluster_anonymous_access() if has_token and not cfg.insecure else None
    _refuse(security.ray_problem(has_token, anonymous, cfg.insecure))
    return has_token


def _refuse_existing() -> None:
    """Refuse when relocator runs on the cluster already; drop a stale record."""
    from relocator.controller.controller import CONTROLLER_NAME

    old = _kv_get()
    if old is not None:
        if _actor(CONTROLLER_NAME) is not None:
            raise DeployError(f"relocator is deployed on this cluster already (deployment {old['id']}); "
                              "`relocator undeploy` first")
        _kv_put(None)  # a record whose controller is gone (cluster restarted): stale
    if _actor(CONTROLLER_NAME) is not None:
        raise DeployError("a relocator controller runs on this cluster but was not started by deploy "
                          "(a local cluster?); stop it first")


def _select_nodes(cfg: DeployConfig) -> tuple[dict[str, dict], dict]:
    """({name: Ray node} of the nodes with the resource, the controller's Ray node)."""
    import ray

    from relocator.deploy import hosts

    alive = [n for n in ray.nodes() if n.get("Alive")]
    selected = [n for n in alive if n.get("Resources", {}).get(cfg.nodes.resource, 0) > 0]
    if not selected:
        raise DeployError(f"no live node has the {cfg.nodes.resource!r} resource (start the raylets with "
                          f"`ray start --resources '{{\"{cfg.nodes.resource}\": 1}}'`)")
    names = hosts.name_nodes(selected, cfg.nodes.names)
    ctl_node = _pick_controller_node(alive, names, cfg.controller.node)
    return {names[n["NodeID"]]: n for n in selected}, ctl_node


def _checked_preflight(cfg: DeployConfig, by_name: dict[str, dict], ctl_node: dict, base: str) -> dict[str, Any]:
    """Every host's preflight; DeployError (the probes' directories removed) if one failed,
    unless allow_failed_preflight."""
    import ray

    from relocator.deploy import hosts

    marker = None
    if cfg.controller.transfer.value == "shared":
        marker = uuid.uuid4().hex
        ray.get(_pinned(hosts.write_marker, ctl_node["NodeID"]).remote(base, marker), timeout=60)
    report = preflight(by_name, cfg, base, marker)
    bad = {h: r["failed"] for h, r in report.items() if not r["ok"]}
    if bad and not cfg.allow_failed_preflight:
        for n in {**by_name, "_ctl": ctl_node}.values():  # the probes' directories
            ray.get(_pinned(hosts.remove_dir, n["NodeID"]).remote(base), timeout=60)
        lines = "; ".join(f"{h}: {', '.join(f)}" for h, f in sorted(bad.items()))
        raise DeployError(f"preflight failed on {len(bad)} of {len(report)} host(s): {lines}", report)
    return report


def _node_record(n: dict) -> dict[str, Any]:
    return {"ray_node_id": n["NodeID"], "ip": n.get("NodeManagerAddress"), "hostname": n.get("NodeManagerHostname")}


def _start(cfg: DeployConfig, base: str, by_name: dict[str, dict], ctl_node: dict, router_host: str,
           keys: list[str]) -> tuple[dict, dict[str, Any]]:
    """The router actor, the controller and (through it) the agents: (router info, {name: ping})."""
    import ray

    from relocator import credentials
    from relocator.controller.controller import start_controller
    from relocator.deploy.routeractor import start_router

    router = start_router(ctl_node["NodeID"], router_host,
                          cfg.router.port, cfg.router.control_port, cfg.router.control_token,
                          str(Path(base) / "router"), api_keys=keys,
                          metrics_public=cfg.router.metrics_public, insecure=cfg.insecure)
    rinfo = ray.get(router.info.remote(), timeout=120)
    ctl_cfg = cfg.controller.model_dump(mode="json", exclude={"node"})
    ctl = start_controller({"base_dir": base, "router_url": rinfo["router_url"],
                            "router_control_url": rinfo["router_control_url"],
                            "router_token": cfg.router.control_token,
                            "node_names": {n["NodeID"]: name for name, n in by_name.items()},
                            # every agent's TLS certificate and the image key (relocator.credentials)
                            "credentials": credentials.for_nodes(credentials.make_cluster(), sorted(by_name)),
                            **ctl_cfg},
                           ray_node_id=ctl_node["NodeID"] if cfg.controller.node else None)
    ray.get(ctl.ping.remote(), timeout=300)
    agents = {}
    for name in sorted(by_name):
        a = _actor(agent_name(name))
        agents[name] = ray.get(a.ping.remote(), timeout=120) if a is not None else None
    missing = [n for n, a in agents.items() if a is None]
    if missing:
        raise DeployError(f"no agent came up on {', '.join(missing)}")
    return rinfo, agents


def deploy(address: str, config: DeployConfig | str | Path | None = None) -> dict[str, Any]:
    """Start relocator on the Ray cluster at `address`; returns the deployment's record with the
    per-host preflight. Refuses (DeployError) when something is deployed already, no node has
    the resource, or a host fails its preflight (unless `allow_failed_preflight`)."""
    cfg = config if isinstance(config, DeployConfig) else DeployConfig.load(config)
    t0 = time.monotonic()
    from relocator.deploy import security

    keys = security.router_keys(cfg.router.api_keys, cfg.router.api_key_file)
    has_token = _check_access(cfg, address, keys)
    from relocator.controller.controller import CONTROLLER_NAME  # (Ray and the controller: once allowed)
    from relocator.deploy.routeractor import ROUTER_ACTOR

    _refuse_existing()
    by_name, ctl_node = _select_nodes(cfg)
    router_host = cfg.router.host or ctl_node["NodeManagerAddress"]
    _refuse(security.router_problem(router_host, keys, cfg.insecure))
    dep_id = f"d{uuid.uuid4().hex[:8]}"
    base = str(Path(cfg.base_dir) / dep_id)
    report = _checked_preflight(cfg, by_name, ctl_node, base)
    preflight_s = time.monotonic() - t0
    record: dict[str, Any] = {
        "id": dep_id, "address": address, "base_dir": base, "started_at": time.time(),
        "nodes": {name: _node_record(n) for name, n in sorted(by_name.items())},
        "controller_node": _node_record(ctl_node),
        "actors": [CONTROLLER_NAME, ROUTER_ACTOR, *[agent_name(n) for n in sorted(by_name)]],
        "transfer": cfg.controller.transfer.value,
        "router_auth": "api_key" if keys else "none", "ray_auth": "token" if has_token else "none",
    }
    _kv_put(record)  # before anything starts: an undeploy after a failure here finds it all
    try:
        rinfo, agents = _start(cfg, base, by_name, ctl_node, router_host, keys)
    except BaseException:
        try:
            undeploy(address)
        except Exception:  # noqa: BLE001 - the first error is the one to report
            pass
        raise
    record.update({"router_url": rinfo["router_url"], "router_control_url": rinfo["router_control_url"],
                   "agents": {n: {"pid": a["pid"], "state_dir": a["state_dir"]} for n, a in agents.items()}})
    _kv_put(record)
    return {**record, "preflight": report, "preflight_s": round(preflight_s, 3),
            "deploy_s": round(time.monotonic() - t0, 3)}


def undeploy(address: str, timeout: float = 180.0) -> dict[str, Any]:
    """Remove what `deploy` started on the cluster at `address` and nothing else."""
    import ray

    init_ray(address)
    from relocator.controller.controller import CONTROLLER_NAME
    from relocator.deploy import hosts
    from relocator.deploy.routeractor import ROUTER_ACTOR

    record = _kv_get()
    if record is None:
        return {"undeployed": False, "reason": "nothing deployed on this cluster"}
    out: dict[str, Any] = {"undeployed": True, "id": record["id"], "errors": [], "killed_actors": [], "hosts": {}}
    ctl = _actor(CONTROLLER_NAME)
    if ctl is not None:
        try:
            out["workers"] = ray.get(ctl.shutdown.remote(), timeout=timeout)
        except Exception as exc:  # noqa: BLE001
            out["errors"].append(f"controller shutdown: {type(exc).__name__}: {exc}")
    router = _actor(ROUTER_ACTOR)
    if router is not None:
        try:
            ray.get(router.stop.remote(), timeout=60)
        except Exception as exc:  # noqa: BLE001
            out["errors"].append(f"router stop: {type(exc).__name__}: {exc}")
    for name in record["actors"]:
        a = _actor(name)
        if a is not None:
            ray.kill(a, no_restart=True)
            out["killed_actors"].append(name)
    # the reservations of the deployment's workers, if the controller could not free them
    try:
        from ray.util import placement_group_table, remove_placement_group
        from ray.util.placement_group import get_placement_group

        for pg in placement_group_table().values():
            if pg.get("name", "").startswith("relocator-") and pg.get("state") != "REMOVED":
                remove_placement_group(get_placement_group(pg["name"]))
                out.setdefault("freed_reservations", []).append(pg["name"])
    except Exception as exc:  # noqa: BLE001
        out["errors"].append(f"reservations: {type(exc).__name__}: {exc}")
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    targets = {**{name: n["ray_node_id"] for name, n in record["nodes"].items()},
               "controller": record["controller_node"]["ray_node_id"]}
    refs = {name: _pinned(hosts.remove_dir, nid).remote(record["base_dir"])
            for name, nid in targets.items() if nid in alive}
    for name, ref in refs.items():
        try:
            out["hosts"][name] = ray.get(ref, timeout=120)
        except Exception as exc:  # noqa: BLE001
            out["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
    for name in set(targets) - set(refs):
        out["hosts"][name] = {"lost": True}
    _kv_put(None)
    return out
