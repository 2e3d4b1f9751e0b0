"""The process that owns a local cluster (started by `relocator up`, stopped by SIGTERM)."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from relocator.cluster.config import REPO, LocalConfig
from relocator.cluster.info import RAY_ENV, info_path
from relocator.cluster.routerproc import RouterSupervisor
from relocator.ports import free_port

log = logging.getLogger("relocator.cluster")


def _write(base: Path, info: dict) -> None:
    tmp = base / "cluster.json.tmp"
    tmp.write_text(json.dumps(info, indent=2))
    os.replace(tmp, info_path(base))


def _wait_http(url: str, timeout: float = 30.0) -> None:
    import urllib.request

    from relocator import waits

    def answers() -> bool:
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return True
        except Exception:  # noqa: BLE001
            return False

    try:
        waits.until(answers, timeout, every=0.1, what=url)
    except waits.WaitTimeout:
        raise RuntimeError(f"{url} did not answer within {timeout:.0f}s") from None


def node_name(i: int) -> str:
    return f"n{i + 1}"


def _start_ray(cfg: LocalConfig) -> Any:
    """The head and the extra raylets, each a node with fake GPUs and its `relocator_node:` resource."""
    from ray.cluster_utils import Cluster

    c = cfg.cluster

    def node_args(i: int) -> dict:
        return {"num_cpus": c.cpus_per_node, "num_gpus": c.gpus_per_node,
                "resources": {f"relocator_node:{node_name(i)}": 1.0},
                "object_store_memory": c.object_store_mb << 20,
                "include_dashboard": False, "node_ip_address": "127.0.0.1"}

    head_args = {**node_args(0), "_system_config": {
        "health_check_period_ms": c.health_check_period_ms,
        "health_check_timeout_ms": max(c.health_check_period_ms, 1000),
        "health_check_failure_threshold": c.health_check_failure_threshold}}
    cluster = Cluster(initialize_head=True, head_node_args=head_args, shutdown_at_exit=True)
    for i in range(1, c.nodes):
        cluster.add_node(**node_args(i))
    cluster.wait_for_nodes()
    return cluster


def _start_router(cfg: LocalConfig, base: Path) -> tuple[RouterSupervisor, int]:
    """The router: we own its public listening socket and pass it down, so while a router
    restarts new connections wait in the backlog instead of being refused; its table survives
    in a state file (relocator/cluster/routerproc.py, docs/router.md "Restarts")."""
    control_port = cfg.router.control_port or free_port()
    state_file = base / "router-state.json"
    state_file.unlink(missing_ok=True)  # a new cluster starts with an empty table
    renv = {**os.environ, "PYTHONPATH": str(REPO), "RELOCATOR_ROUTER_CONTROL_HOST": "127.0.0.1"}
    if cfg.router.control_token:
        renv["RELOCATOR_ROUTER_CONTROL_TOKEN"] = cfg.router.control_token
    routers = RouterSupervisor(port=cfg.router.port, control_port=control_port, state_file=state_file,
                               log_file=open(base / "router.log", "ab"), env=renv, cwd=REPO,
                               extra_args=["--log-level", "info"], session_nice=cfg.router.session_nice)
    routers.install_signal()  # before the first router can be SIGTERMed
    routers.start()
    return routers, control_port


def _start_controller(cfg: LocalConfig, base: Path, cluster: Any, routers: RouterSupervisor,
                      router_url: str, control_url: str, stop: threading.Event) -> Any:
    """The controller and its agents, on the cluster just started; its actor handle."""
    import ray

    from relocator import credentials
    from relocator.controller.controller import start_controller

    ray.init(address=cluster.address, namespace="relocator", log_to_driver=False)
    # ray.init installs its own SIGTERM handler (exit at once): put ours back, so that a
    # stop kills the workers and frees their reservations before the raylets go.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    routers.install_signal()
    creds = credentials.for_nodes(credentials.load_cluster(base / "credentials"),
                                  [node_name(i) for i in range(cfg.cluster.nodes)])
    ctl = start_controller({
        "base_dir": str(base), "router_url": router_url, "router_control_url": control_url,
        "router_token": cfg.router.control_token, "credentials": creds, **cfg.controller.model_dump()})
    ray.get(ctl.ping.remote(), timeout=120)
    return ctl


def _serve(base: Path, info: dict, ray_pids: list[int], routers: RouterSupervisor, ctl: Any,
           stop: threading.Event) -> None:
    """Until stopped: restart the router when it dies (recorded), then shut the controller down."""
    import ray

    while not stop.wait(0.05):
        if routers.poll():  # a replacement: the current router last (tools take pids[-1])
            info.update({"pids": ray_pids + routers.pids(), "router_pid": routers.pids()[-1]})
            _write(base, info)
    log.info("stopping")
    try:
        log.info("controller shutdown: %s", ray.get(ctl.shutdown.remote(), timeout=120))
    except Exception as exc:  # noqa: BLE001
        log.error("controller shutdown failed: %s", exc)


def _shutdown(base: Path, info: dict, cluster: Any, routers: RouterSupervisor | None) -> None:
    if routers is not None:
        routers.stop()
    try:
        import ray

        ray.shutdown()
    except Exception:  # noqa: BLE001
        pass
    if cluster is not None:
        cluster.shutdown()
    if "error" not in info:
        info_path(base).unlink(missing_ok=True)


def main(base: Path) -> int:
    os.environ.update(RAY_ENV)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    cfg = LocalConfig.model_validate_json((base / "config.json").read_text())
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    cluster = routers = None
    info: dict = {"daemon_pid": os.getpid(), "base_dir": str(base)}
    try:
        t0 = time.monotonic()
        cluster = _start_ray(cfg)
        ray_s = time.monotonic() - t0
        routers, control_port = _start_router(cfg, base)
        router_url = f"http://127.0.0.1:{routers.port}"
        control_url = f"http://127.0.0.1:{control_port}"
        _wait_http(router_url + "/health")
        ctl = _start_controller(cfg, base, cluster, routers, router_url, control_url, stop)
        ray_pids = [p.process.pid for n in cluster.list_all_nodes() for procs in n.all_processes.values()
                    for p in procs if p.process is not None]
        c = cfg.cluster
        info.update({"address": cluster.address, "router_url": router_url, "router_control_url": control_url,
                     "nodes": [node_name(i) for i in range(c.nodes)], "gpus_per_node": c.gpus_per_node,
                     "pids": ray_pids + routers.pids(), "router_pid": routers.pids()[-1], "started_at": time.time(),
                     "startup_s": round(time.monotonic() - t0, 3), "ray_startup_s": round(ray_s, 3)})
        _write(base, info)
        log.info("cluster up: %s", info)
        _serve(base, info, ray_pids, routers, ctl, stop)
        return 0
    except Exception as exc:  # noqa: BLE001
        log.error("cluster failed: %s", traceback.format_exc())
        info["error"] = f"{type(exc).__name__}: {exc}"
        _write(base, info)
        return 1
    finally:
        _shutdown(base, info, cluster, routers)


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
