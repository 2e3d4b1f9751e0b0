"""`relocator up --emulate-hosts N` and its `down`: emulated hosts (relocator/cluster/emulate.py)
with relocator deployed on them by the `relocator deploy` command, as on real machines.

Deploy and undeploy run as CLI subprocesses: the caller's process stays free of any Ray
connection (a test session may be attached to another cluster), and the path is exactly the
operator's. The cluster describes itself in BASE/cluster.json with `emulated` (hosts, bridge)
and `address` (the Ray Client address through which `relocator.connect()` attaches).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from relocator.cluster.config import REPO, LocalConfig
from relocator.cluster.emulate import RAY_CLIENT_ENV
from relocator.cluster.info import ClusterError, info_path
from relocator.vocab import TransferMode


def _write(base: Path, info: dict) -> None:
    tmp = base / "cluster.json.tmp"
    tmp.write_text(json.dumps(info, indent=2))
    os.replace(tmp, info_path(base))


def _cli(args: list[str], log: Path, timeout: float) -> dict[str, Any]:
    """`relocator ARGS --json` in a fresh process; its JSON, or ClusterError with its message."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update({"PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0", **RAY_CLIENT_ENV})
    with open(log, "ab") as err:
        proc = subprocess.run([sys.executable, "-m", "relocator", *args, "--json"], cwd=REPO, env=env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, timeout=timeout)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        raise ClusterError(f"relocator {args[0]} failed (exit {proc.returncode}): {' '.join(tail)}")
    return json.loads(proc.stdout)


def deploy_config(config: LocalConfig) -> dict[str, Any]:
    """The deploy configuration of an emulated cluster: the local config's controller and router
    settings, fake GPUs allowed, Ray without tokens accepted, and `stream` where the local
    default would be `shared` (the hosts share no filesystem; deploy refuses `shared` there)."""
    ctl = config.controller.model_dump(mode="json")
    if ctl["transfer"] == TransferMode.SHARED.value:
        ctl["transfer"] = TransferMode.STREAM.value
    # insecure: the emulated hosts' Ray has no token authentication (docs/deploy.md) and their
    # router serves this machine's private bridge only, to our own tools, with no key
    return {"nodes": {"fake_gpus": True}, "insecure": True,
            "controller": ctl,
            "router": {"port": config.router.port, "control_port": config.router.control_port,
                       "control_token": config.router.control_token}}


def up_emulated(config: LocalConfig, timeout: float = 600.0) -> dict[str, Any]:
    import yaml

    from relocator.cluster import emulate

    c = config.cluster
    base = Path(c.base_dir)
    base.mkdir(parents=True, exist_ok=True)
    info_path(base).unlink(missing_ok=True)
    t0 = time.monotonic()
    emu = emulate.start(c.emulate_hosts, base / "emulated", gpus=c.gpus_per_node, cpus=c.cpus_per_node,
                        object_store_mb=c.object_store_mb, health_check_period_ms=c.health_check_period_ms,
                        health_check_failure_threshold=c.health_check_failure_threshold)
    ray_s = time.monotonic() - t0
    info: dict[str, Any] = {"base_dir": str(base), "emulated": emu.to_dict(), "address": emu.client_address,
                            "ray_env": RAY_CLIENT_ENV,
                            "gpus_per_node": c.gpus_per_node, "started_at": time.time()}
    _write(base, info)  # from here on, `down` finds what to stop
    try:
        cfg_file = base / "deploy.yaml"
        cfg_file.write_text(yaml.safe_dump(deploy_config(config)))
        dep = _cli(["deploy", "--address", emu.client_address, "--config", str(cfg_file)], base / "deploy.log",
                   timeout)
    except BaseException:
        down_emulated(base, info)
        raise
    info.update({"router_url": dep["router_url"], "deployment": dep["id"], "nodes": sorted(dep["nodes"]),
                 "preflight": {h: r["ok"] for h, r in dep["preflight"].items()},
                 "controller_host": dep["controller_node"]["hostname"],
                 "startup_s": round(time.monotonic() - t0, 3), "ray_startup_s": round(ray_s, 3),
                 "deploy_s": dep["deploy_s"]})
    _write(base, info)
    return info


def down_emulated(base: Path, info: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
    """Undeploy (workers, controller, router, agents), then stop the hosts and their network."""
    from relocator.cluster import emulate

    out: dict[str, Any] = {"stopped": True, "emulated": True}
    try:
        out["undeploy"] = _cli(["undeploy", "--address", info["address"]], base / "deploy.log", timeout)
    except Exception as exc:  # noqa: BLE001 - a broken cluster is still stopped below
        out["undeploy_error"] = str(exc)
    out["hosts"] = emulate.stop(emulate.EmulatedCluster.from_dict(info["emulated"]))
    # the hosts share this machine's /dev/shm (not one of their private directories), so the
    # tmpfs roots (relocator.agent.transient) of every deployment made on them (each under
    # <deploy base_dir>/<id>; a redeploy is a new one) are removed from here
    try:
        from relocator.agent.transient import remove_roots
        from relocator.deploy.config import DeployConfig

        cfg = base / "deploy.yaml"
        dep_base = (DeployConfig.load(cfg) if cfg.exists() else DeployConfig()).base_dir
        out["transient_images_removed"] = remove_roots(dep_base, below=True)
    except Exception as exc:  # noqa: BLE001 - a broken config leaves only files in /dev/shm
        out["transient_images_error"] = str(exc)
    info_path(base).unlink(missing_ok=True)
    return out
