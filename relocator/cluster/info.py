"""cluster.json, the record of a running cluster (local, emulated or deployed), and the names
every cluster module shares. Below `local`, `emulated` and `daemon`, so that none of them imports
another to read the record (`local.up` starts `emulated`, which needs these)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

RAY_ENV = {
    # Keep every Ray listener and node address on loopback (see notes/ray-on-one-machine.md).
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
}


class ClusterError(RuntimeError):
    pass


def info_path(base_dir: str | Path) -> Path:
    return Path(base_dir) / "cluster.json"


def read_info(base_dir: str | Path) -> dict[str, Any] | None:
    p = info_path(base_dir)
    if not p.exists():
        return None
    try:
        return json.loads(p.read_text())
    except ValueError:
        return None


def write_deployed(base_dir: str | Path, record: dict[str, Any]) -> None:
    """Describe a deployment (`relocator deploy --cluster-dir`) like a local cluster, so that
    `connect(base_dir)` and the CLI's --cluster-dir reach it; `down` then undeploys it."""
    base = Path(base_dir)
    base.mkdir(parents=True, exist_ok=True)
    info = {"deployed": record["id"], "address": record["address"], "router_url": record["router_url"],
            "base_dir": str(base), "nodes": sorted(record["nodes"])}
    tmp = base / "cluster.json.tmp"
    tmp.write_text(json.dumps(info, indent=2))
    os.replace(tmp, info_path(base))
