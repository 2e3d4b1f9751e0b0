"""The router on a deployed cluster: a detached Ray actor on the controller's node that owns
the router process (relocator.cluster.routerproc.RouterSupervisor: the listening socket, a
replacement when a router exits, the routing table in a state file)."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

from relocator.agent.agent import NAMESPACE

ROUTER_ACTOR = "relocator-router"
log = logging.getLogger("relocator.deploy")


class RouterHost:
    def __init__(self, host: str, port: int, control_port: int, token: str | None, state_dir: str,
                 api_keys: list[str] | None = None, metrics_public: bool = False, insecure: bool = False) -> None:
        from relocator.cluster.config import REPO
        from relocator.ports import free_port
        from relocator.cluster.routerproc import RouterSupervisor

        Path(state_dir).mkdir(parents=True, exist_ok=True)
        self.control_port = control_port or free_port()
        env = {**os.environ, "PYTHONPATH": str(REPO), "RELOCATOR_ROUTER_CONTROL_HOST": "127.0.0.1"}
        if token:
            env["RELOCATOR_ROUTER_CONTROL_TOKEN"] = token
        env.pop("RELOCATOR_API_KEY", None)  # the deployment's keys only
        if api_keys:  # in a file only we read, not in the router's environment
            from relocator.deploy.security import write_key_file

            env["RELOCATOR_ROUTER_API_KEY_FILE"] = str(write_key_file(Path(state_dir) / "api-keys", api_keys))
        env["RELOCATOR_ROUTER_METRICS_PUBLIC"] = "1" if metrics_public else "0"
        env["RELOCATOR_ROUTER_INSECURE"] = "1" if insecure else "0"
        self.sup = RouterSupervisor(port=port, control_port=self.control_port,
                                    state_file=Path(state_dir) / "router-state.json",
                                    log_file=open(Path(state_dir) / "router.log", "ab"), env=env, cwd=REPO,
                                    extra_args=["--log-level", "info"], host=host)
        try:  # a SIGTERMed router tells us (SIGUSR1) to start its replacement while it drains
            self.sup.install_signal()
        except ValueError:  # not the main thread: no SIGUSR1 (it would kill us); a replacement
            self.sup.env["RELOCATOR_ROUTER_SUPERVISED"] = "0"  # starts when the old router exits
        self.host = host
        self.sup.start()
        self._stop = threading.Event()
        threading.Thread(target=self._poll, daemon=True).start()

    def _poll(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.sup.poll()
            except Exception as exc:  # noqa: BLE001
                log.error("router supervisor: %s", exc)

    def info(self) -> dict[str, Any]:
        return {"router_url": f"http://{self.host}:{self.sup.port}",
                "router_control_url": f"http://127.0.0.1:{self.control_port}", "pids": self.sup.pids(),
                "restarts": self.sup.restarts}

    def stop(self) -> bool:
        self._stop.set()
        self.sup.stop()
        return True


def start_router(ray_node_id: str, host: str, port: int, control_port: int, token: str | None, state_dir: str,
                 **auth: Any):
    """`auth`: RouterHost's api_keys, metrics_public, insecure."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return ray.remote(RouterHost).options(
        name=ROUTER_ACTOR, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(ray_node_id, soft=False),
    ).remote(host, port, control_port, token, state_dir, **auth)
