"""`relocator bench fractional` (issue 31): eight 0.25-GPU workers scattered over 3 nodes of 4
GPUs (on 6 GPUs), one `consolidate` under streaming load packs them onto 2 GPUs and frees a
whole node, then a 4-GPU launch lands there. Side by side: the same cluster before the moves
(GPUs in use, whole nodes free, whether the 4-GPU launch fits without moves).

The scatter is made with another tenant's fractional reservations (Ray placement groups, not
workers): Ray packs shares best fit, so a filler that tops a GPU up sends the next share to
the next GPU; the fillers are removed before the consolidation.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

MODEL = "tiny-llama"
SHARE = 0.25
MAX_TOKENS = 64
STREAMS = 8
#: per node: shares launched, then a filler that tops that GPU up, then shares on the next GPU
LAYOUT = {"n1": (2, 0.5, 1), "n2": (1, 0.75, 1), "n3": (2, 0.5, 1)}


def _used_gpus(ctl: Any) -> dict[str, Any]:
    ws = [w for w in ctl.status()["workers"] if w["state"] == "running"]
    gpus = sorted({(w["node"], g) for w in ws for g in w["gpu_ids"]})
    free_nodes = [n["id"] for n in ctl.status()["nodes"] if n["gpus_free"] == n["gpus_total"]]
    return {"gpus_in_use": len(gpus), "gpus": [f"{n}:{g}" for n, g in gpus], "whole_nodes_free": free_nodes,
            "shares_per_gpu": {f"{n}:{g}": sum(1 for w in ws if g in w["gpu_ids"] and w["node"] == n and w["gpus"] < 1)
                               for n, g in gpus}}


def _scatter(ctl: Any, engine: str, say: Callable[[str], None]) -> list[str]:
    import ray
    from ray.util import placement_group

    ids: list[str] = []
    for node, (first, filler, then) in LAYOUT.items():
        for _ in range(first):
            ids.append(ctl.launch(MODEL, SHARE, node=node, engine=engine)["id"])
        pg = placement_group([{"GPU": filler, f"relocator_node:{node}": 0.001}], strategy="STRICT_PACK")
        ray.get(pg.ready(), timeout=60)
        for _ in range(then):
            ids.append(ctl.launch(MODEL, SHARE, node=node, engine=engine)["id"])
        ray.util.remove_placement_group(pg)
        say(f"{node}: {first + then} share worker(s) launched")
    return ids


def scenario(ctl: Any, engine: str, max_moves: int, say: Callable[[str], None]) -> dict[str, Any]:
    """The scenario on a running, empty cluster `ctl` (3 nodes x 4 GPUs)."""
    from relocator.cluster.streams import Load, reference
    from relocator.waits import until

    t0 = time.monotonic()
    _scatter(ctl, engine, say)
    until(lambda: sum(n["gpus_free"] for n in ctl.status()["nodes"]) == 12 - 8 * SHARE, 60, every=0.5,
          what="the fillers' GPUs free")
    before = _used_gpus(ctl)
    say(f"scattered in {time.monotonic() - t0:.1f}s: {before}")
    try:
        ctl.launch(MODEL, 4, engine=engine, make_room=False)
        big_without_moves = "fits"
    except RuntimeError as exc:
        big_without_moves = f"refused: {exc}"
    plan = ctl.consolidate(dry_run=True, max_moves=max_moves)
    ref = asyncio.run(reference(ctl.router_url, MODEL, MAX_TOKENS, STREAMS, STREAMS))
    load = Load(ctl.router_url, MODEL, ref, MAX_TOKENS, STREAMS).start()
    time.sleep(2.0)
    t1 = time.monotonic()
    out = ctl.consolidate(max_moves=max_moves)
    consolidate_s = time.monotonic() - t1
    after = _used_gpus(ctl)
    t2 = time.monotonic()
    big = ctl.launch(MODEL, 4, engine=engine)
    big_s = time.monotonic() - t2
    time.sleep(1.0)
    load.stop()
    rep = load.report()
    return {
        "engine": engine, "before": before, "after": after, "plan_moves": len(plan["moves"]),
        "moves": len(out["moves"]), "move_results": [m["result"] for m in out["moves"]],
        "blackout_s_max": max((m.get("blackout_s", 0.0) for m in out["moves"]), default=0.0),
        "nodes_freed": out["nodes_freed"], "gpus_freed": out.get("gpus_freed"), "consolidate_s": round(consolidate_s, 2),
        "big_launch_without_moves": big_without_moves,
        "big_launch": {"node": big.get("node"), "state": big.get("state"), "moves": len(big.get("moves", [])),
                       "seconds": round(big_s, 2), "on_freed_node": big.get("node") in out["nodes_freed"]},
        "requests": rep["requests"], "client_errors": rep["client_errors"], "tokens_lost": rep["tokens_lost"],
        "tokens_duplicated": rep["tokens_duplicated"], "tokens_mismatched": rep["tokens_mismatched"],
        "text_mismatched": rep["text_mismatched"],
        "targets": {"packed_onto_2_gpus": after["gpus_in_use"] == 2,
                    "frees_a_node_le_6_moves": bool(out["nodes_freed"]) and len(out["moves"]) <= 6,
                    "big_launch_lands_on_freed_node": big.get("node") in out["nodes_freed"],
                    "clean": rep["client_errors"] == rep["tokens_lost"] == rep["tokens_duplicated"]
                    == rep["tokens_mismatched"] == rep["text_mismatched"] == 0},
        "seconds": round(time.monotonic() - t0, 1),
    }


def run(base_dir: str, engine: str, max_moves: int = 6, say: Callable[[str], None] = print) -> dict[str, Any]:
    """The scenario on a fresh local cluster of its own (3 nodes x 4 fake GPUs)."""
    import relocator

    t = time.monotonic()
    ctl = relocator.start(nodes=3, gpus_per_node=4, base_dir=base_dir)
    try:
        say(f"cluster up in {time.monotonic() - t:.1f}s")
        return scenario(ctl, engine, max_moves, say)
    finally:
        ctl.down()
