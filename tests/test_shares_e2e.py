"""GPU shares end to end (issue 31) on the session's local Ray cluster (3 nodes x 4 fake GPUs),
reference-engine workers (ready in ~1.5 s), real CRIU and the real router: two 0.25 shares and
a whole GPU mixed on nodes, a share on the same GPU id as another tenant's fractional
reservation, the engine given its memory share, and `consolidate` moving a share onto that GPU
under streaming load (0 client errors, 0 lost, duplicated or mismatched tokens), which frees a
node. The eight-worker scenario is `relocator bench fractional` (docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
import time

import psutil
import pytest

from relocator.cluster.streams import Load, reference
from tests.helpers import clean, wait_for, workers

pytestmark = pytest.mark.integration
MODEL = "tiny-llama"
ENGINE = "reference"
MAX_TOKENS = 48
TENANT = "test-tenant-shares"  # another tenant's fractional reservation: not a worker, never moved


def _share_engines(fraction: str) -> int:
    """Reference-engine processes started with this memory share (its launch flag)."""
    n = 0
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "adapters.reference.server" in cmd and "--memory-fraction" in cmd:
            n += cmd[cmd.index("--memory-fraction") + 1] == fraction
    return n


def _free(ctl) -> dict:
    return {n["id"]: n["gpus_free"] for n in ctl.status()["nodes"]}


def test_shares_mix_on_gpus_and_consolidate_moves_one_under_load(relocator_cluster) -> None:
    import ray
    from ray.util import placement_group

    ctl = relocator_cluster
    for w in ctl.status()["workers"]:  # start from an empty cluster: the layout below is exact
        ctl.stop_worker(w["id"])
    wait_for(lambda: all(n["gpus_free"] == n["gpus_total"] for n in ctl.status()["nodes"]),
             60, "every GPU free after stopping the session's other workers")
    for bad in (0, -1, 0.0001, 1.5, "abc"):
        with pytest.raises(ValueError, match="(?i)gpu"):
            ctl.launch(MODEL, bad, engine=ENGINE)
    pg = placement_group([{"GPU": 0.5, "relocator_node:n1": 0.001}], strategy="STRICT_PACK", name=TENANT)
    ray.get(pg.ready(), timeout=60)
    ids: list[str] = []
    try:
        a = ctl.launch(MODEL, 0.25, node="n1", engine=ENGINE)
        ids.append(a["id"])
        whole = ctl.launch(MODEL, 1, node="n1", engine=ENGINE)
        ids.append(whole["id"])
        b = ctl.launch(MODEL, 0.25, node="n2", engine=ENGINE)
        ids.append(b["id"])
        assert (a["gpus"], b["gpus"], whole["gpus"]) == (0.25, 0.25, 1)
        assert len(a["gpu_ids"]) == 1 and whole["gpu_ids"] != a["gpu_ids"], (a, whole)  # a shares the tenant's GPU
        assert _share_engines("0.025") >= 2  # LaunchSpec.memory_fraction 0.1 x 0.25
        wait_for(lambda: _free(ctl) == {"n1": 2.25, "n2": 3.75, "n3": 4}, 30, "Ray's view of the shares held")

        plan = ctl.consolidate(dry_run=True)
        assert [(m["worker"], m["from"], m["to"], m["gpus"]) for m in plan["moves"]] == [(b["id"], "n2", "n1", 0.25)]
        assert plan["nodes_freed"] == ["n2"], plan

        ref = asyncio.run(reference(ctl.router_url, MODEL, MAX_TOKENS, 2, 2))
        load = Load(ctl.router_url, MODEL, ref, MAX_TOKENS, 3).start()
        time.sleep(1.0)
        out = ctl.consolidate()
        load.stop()
        rep = load.report()
        assert [m["result"] for m in out["moves"]] == ["done"], out
        clean(rep)
        ws = workers(ctl)
        assert (ws[b["id"]]["node"], ws[b["id"]]["gpu_ids"]) == ("n1", a["gpu_ids"]), ws[b["id"]]
        assert out["nodes_freed"] == ["n2"] and out["gpus_moved"] == 0.25
        wait_for(lambda: _free(ctl) == {"n1": 2, "n2": 4, "n3": 4}, 30, "n2 free after the move")
    finally:
        for wid in ids:
            try:
                ctl.stop_worker(wid)
            except Exception:  # noqa: BLE001
                pass
        ray.util.remove_placement_group(pg)
