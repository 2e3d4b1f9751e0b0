"""The routing table on disk: what a restarted router needs to serve at once.

`save` writes the table atomically (temporary file + `os.replace`) after every control-API
change; `load` reads it back (a missing, unreadable or corrupt file gives `None` and a
warning, never an exception); `restore` fills a fresh table; `follow` applies the changes a
newer router process wrote to the table of an older one that is still draining (switch,
release, hold, add; removals are left to the old process's own failure handling). No
transport here."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from .table import ReplicaState, RoutingTable

log = logging.getLogger(__name__)
VERSION = 1


def dump(table: RoutingTable, tokenizers: dict[str, str] | None = None) -> dict[str, Any]:
    """`tokenizers`: {model: tokenizer path}, kept with each replica of the model."""
    tokenizers = tokenizers or {}
    return {"version": VERSION, "written_at": time.time(), "pid": os.getpid(),
            "replicas": [{"worker_id": r.worker_id, "model": r.model, "endpoint": r.endpoint,
                          "held": r.state is ReplicaState.HELD and not r.suspect,
                          "generation": r.generation,
                          **({"engine": r.engine} if r.engine else {}),
                          **({"gpus": r.gpus} if r.gpus is not None else {}),
                          **({"tokenizer": tokenizers[r.model]} if r.model in tokenizers else {})}
                         for r in table.replicas()]}


def save(path: str | Path, table: RoutingTable, tokenizers: dict[str, str] | None = None) -> None:
    """Atomic: a reader sees the old file or the new one, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(dump(table, tokenizers), f, separators=(",", ":"))
    os.replace(tmp, path)


def _engine(e: dict) -> str | None:
    return e["engine"] if isinstance(e.get("engine"), str) and e["engine"] else None


def _gpus(e: dict) -> float | None:
    g = e.get("gpus")
    return g if isinstance(g, (int, float)) and not isinstance(g, bool) and g > 0 else None


def tokenizers_of(replicas: list[dict]) -> dict[str, str]:
    """{model: tokenizer path} recorded in `load`'s result."""
    return {e["model"]: e["tokenizer"] for e in replicas if isinstance(e.get("tokenizer"), str)}


def _valid(e: Any) -> bool:
    return (isinstance(e, dict) and all(isinstance(e.get(k), str) and e[k]
                                        for k in ("worker_id", "model", "endpoint"))
            and e["endpoint"].startswith(("http://", "https://"))
            and isinstance(e.get("generation", 0), int) and isinstance(e.get("held", False), bool))


def load(path: str | Path) -> list[dict] | None:
    """The persisted replicas, or None (with a warning unless the file is just absent)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("router state %s unreadable (%s); starting with an empty table", path, e)
        return None
    try:
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError(f"unknown format (version {data.get('version') if isinstance(data, dict) else None!r})")
        reps = data["replicas"]
        if not isinstance(reps, list) or not all(_valid(e) for e in reps):
            raise ValueError("malformed replica entry")
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        log.warning("router state %s is corrupt (%s); starting with an empty table", path, e)
        return None
    return reps


def restore(table: RoutingTable, replicas: list[dict]) -> int:
    """Fill `table` (a router that is starting) from `load`'s result."""
    n = 0
    for e in replicas:
        try:
            r = table.add(e["worker_id"], e["model"], e["endpoint"], _engine(e), _gpus(e))
        except ValueError as exc:  # same worker id, another model: keep the first
            log.warning("router state: %s", exc)
            continue
        r.generation = max(r.generation, e.get("generation", 0))
        if e.get("held"):
            table.hold(r.worker_id)
        n += 1
    return n


def follow(table: RoutingTable, replicas: list[dict]) -> list[tuple[str, str]]:
    """Bring an older process's table in line with what the newer one wrote: a higher
    generation is a switch (the old process's streams on that worker are cut and continued on
    the new endpoint, its hold queue released unless still held); held -> active is a release.
    Returns the actions taken, (action, worker)."""
    done: list[tuple[str, str]] = []
    for e in replicas:
        w, ep, gen, held = e["worker_id"], e["endpoint"].rstrip("/"), e.get("generation", 0), e.get("held", False)
        try:
            r = table.get(w)
        except KeyError:
            try:
                r = table.add(w, e["model"], ep, _engine(e))
            except ValueError:  # pragma: no cover - model clash
                continue
            r.generation = gen
            if held:
                table.hold(w)
            done.append(("add", w))
            continue
        if r.model != e["model"]:
            continue
        if gen > r.generation:
            table.switch(w, ep, release=not held)
            r.generation = gen
            done.append(("switch", w))
        elif ep != r.endpoint:
            r.endpoint = ep
            done.append(("repoint", w))
        if not held and r.state is ReplicaState.HELD and not r.suspect:
            table.release(w)
            done.append(("release", w))
        elif held and r.state is ReplicaState.ACTIVE:
            table.hold(w)
            done.append(("hold", w))
    return done
