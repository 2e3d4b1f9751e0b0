"""A local multi-node Ray cluster on this machine: `up()` and `down()`.

`up` starts one daemon process (`python -m relocator.cluster.daemon DIR`) that owns everything:
the Ray head and extra raylets (each a "node" with fake GPUs and a `relocator_node:<name>`
resource), the router (a subprocess), and the controller actor with its node agents. The daemon
writes DIR/cluster.json once all of it is up. `down` asks the daemon to stop (it kills every
worker cell, frees reservations, stops the router and the raylets) and falls back to killing the
recorded processes itself if the daemon does not answer.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from relocator import procs, waits
from relocator.cluster.config import REPO, LocalConfig
# re-exported: callers outside cluster/ read the record through local
from relocator.cluster.info import RAY_ENV, ClusterError, info_path, read_info, write_deployed  # noqa: F401


def _alive(pid: int) -> bool:
    return procs.alive(pid)  # never a pid <= 0 (a process group or "every process")


def up(config: LocalConfig | None = None, timeout: float = 120.0) -> dict[str, Any]:
    """Start the local cluster described by `config`; returns cluster.json's content."""
    config = config or LocalConfig.load()
    base = Path(config.cluster.base_dir)
    info = read_info(base)
    if info and _alive(info.get("daemon_pid", -1)):
        raise ClusterError(f"a cluster is already running from {base} (daemon pid {info['daemon_pid']}); "
                           "`relocator down` first")
    if info and info.get("emulated"):
        raise ClusterError(f"emulated hosts are running from {base}; `relocator down` first")
    if config.cluster.emulate_hosts:
        from relocator.cluster.emulated import up_emulated

        return up_emulated(config, timeout=max(timeout, 600.0))
    base.mkdir(parents=True, exist_ok=True)
    info_path(base).unlink(missing_ok=True)
    for stale in base.glob("controller.db*"):  # a new cluster starts with an empty inventory
        stale.unlink()
    (base / "config.json").write_text(config.model_dump_json(indent=2))
    from relocator import credentials

    credentials.save_cluster(base / "credentials", credentials.make_cluster())  # a new cluster: new keys
    log = open(base / "daemon.log", "ab")
    env = {**os.environ, **RAY_ENV, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "relocator.cluster.daemon", str(base)], cwd=REPO, env=env,
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return waits.until(lambda: _started(proc, base), timeout, every=0.2, what="the cluster daemon")
    except waits.WaitTimeout:
        proc.send_signal(signal.SIGTERM)
        raise ClusterError(f"cluster not up after {timeout:.0f}s; see {base / 'daemon.log'}") from None


def _started(proc: subprocess.Popen, base: Path) -> dict[str, Any] | None:
    """cluster.json once the daemon wrote it; a ClusterError when it failed or exited."""
    info = read_info(base)
    if info and info.get("daemon_pid") == proc.pid:
        if info.get("error"):
            proc.wait(30)
            raise ClusterError(f"cluster failed to start: {info['error']}")
        return info
    if proc.poll() is not None:
        tail = (base / "daemon.log").read_text(errors="replace")[-3000:]
        raise ClusterError(f"cluster daemon exited with {proc.returncode}:\n{tail}")
    return None


def down(base_dir: str | Path | None = None, timeout: float = 90.0) -> dict[str, Any]:
    """Stop the cluster started from `base_dir`; returns what was stopped."""
    from relocator.cluster.config import cluster_dir

    base = Path(base_dir) if base_dir else cluster_dir()
    info = read_info(base)
    if info is None:
        return {"stopped": False, "reason": f"no cluster running from {base}"}
    if info.get("emulated"):
        from relocator.cluster.emulated import down_emulated

        return down_emulated(base, info)
    if info.get("deployed"):  # `relocator deploy --cluster-dir`: the Ray cluster is not ours to stop
        from relocator.deploy import undeploy

        out = undeploy(info["address"])
        info_path(base).unlink(missing_ok=True)
        return {"stopped": True, "undeploy": out}
    pid = int(info.get("daemon_pid", -1))
    out: dict[str, Any] = {"stopped": True, "daemon_pid": pid, "forced": []}
    if _alive(pid):
        os.kill(pid, signal.SIGTERM)
        waits.gone(lambda: _alive(pid), timeout, every=0.2)
    # Whatever is still there (daemon killed hard, or it hung): processes it recorded.
    for p in [pid, *info.get("pids", [])]:
        if _alive(p):
            try:
                os.kill(p, signal.SIGKILL)
                out["forced"].append(p)
            except ProcessLookupError:
                pass
    out["cells_killed"] = _kill_leftover_cells(base)
    from relocator.agent.transient import remove_roots

    out["transient_images_removed"] = remove_roots(base)
    info_path(base).unlink(missing_ok=True)
    return out


def _kill_leftover_cells(base: Path) -> list[str]:
    """Cells recorded under any node's state dir (normally none: the daemon kills them)."""
    from relocator.cell.cell import list_cells, using_state_dir

    killed = []
    for state in sorted((base / "nodes").glob("*/state")):
        with using_state_dir(state):
            for cell in list_cells():
                cell.kill()
                killed.append(cell.id)
    return killed
