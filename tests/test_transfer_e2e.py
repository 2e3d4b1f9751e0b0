"""Transfer modes end to end (issue 14) on the session cluster (tests/conftest.py: 3 raylets,
real CRIU, real vLLM CPU, the router), each under 8 greedy streams checked token by token:
`stream` through the target's page server, `postcopy` (lazy pages, the source released only
once every page arrived), `auto` (the local cluster shares one filesystem: shared).

The post-copy faults (target killed, network cut) run in the chaos smoke
(tests/test_chaos_smoke.py runs every non-destructive fault); the source node lost during a
post-copy takes a raylet away, `relocator chaos --faults postcopy-source-loss` on a cluster of
its own runs it (docs/benchmarks.md)."""

from __future__ import annotations

import asyncio

import pytest

from relocator.cluster.scenario import relocate_under_load
from relocator.cluster.streams import Reference, reference
from tests.helpers import node_of, other_node

pytestmark = pytest.mark.integration
MODEL = "tiny-llama"
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def worker(relocator_cluster):
    w = relocator_cluster.launch(MODEL, gpus=1)
    yield w["id"]
    relocator_cluster.stop_worker(w["id"])


@pytest.fixture(scope="module")
def ref(relocator_cluster, worker) -> Reference:
    return asyncio.run(reference(relocator_cluster.router_url, MODEL, MAX_TOKENS, 8, 8))


def _move(ctl, wid: str, ref: Reference, transfer: str) -> tuple[dict, dict]:
    dst = other_node(ctl, wid)
    res = relocate_under_load(ctl, wid, dst, MODEL, concurrency=8, max_tokens=MAX_TOKENS, ref=ref,
                              transfer=transfer)
    rel, load = res["relocation"], res["load"]
    assert rel["result"] == "done", (rel.get("error"), rel.get("rollback"), rel.get("postcopy"))
    assert load["client_errors"] == 0, load["errors"]
    assert (load["tokens_lost"], load["tokens_duplicated"], load["tokens_mismatched"]) == (0, 0, 0)
    assert load["text_mismatched"] == 0, load["text_bad"]
    assert node_of(ctl, wid) == dst
    return rel, ctl.get_relocation(rel["id"])


def _info(full: dict, phase: str) -> dict:
    return next(p["info"] for p in full["phases"] if p["name"] == phase)


def _check_transient_image(ctl, full: dict) -> None:
    """`transient_images: auto` (the default): the target's image went to its tmpfs when this
    machine's /dev/shm has room for it (else disk, and PLAN says why), and nothing is left there."""
    from pathlib import Path

    from relocator.agent import transient
    from relocator.chaos.leaks import transient_images

    plan, base = _info(full, "PLAN"), ctl.info["base_dir"]
    space = transient.probe(Path("/dev/shm"))
    roomy = space.fstype == "tmpfs" and space.free_bytes >= 8 << 30 and (space.mem_available or 0) >= 8 << 30
    if roomy:
        assert plan["image_on"] == "tmpfs", plan
    if plan["image_on"] == "tmpfs":
        assert full["dst_image_dir"].startswith(str(transient.transient_root(base)) + "/"), full["dst_image_dir"]
    else:
        assert plan["image_why"].startswith("tmpfs: "), plan
    assert not transient_images(base), transient_images(base)  # removed with the move


def test_stream_sends_the_memory_through_the_page_server(relocator_cluster, worker, ref) -> None:
    rel, full = _move(relocator_cluster, worker, ref, "stream")
    assert rel["transfer"] == "stream"
    dump, transfer = _info(full, "DUMP"), _info(full, "TRANSFER")
    assert dump["pages"] == "remote" and dump["bytes"] < 16 << 20  # only the small images stayed
    assert transfer["streamed_pages_bytes"] > 200 << 20 and transfer["verified"]
    assert rel["image_bytes"] == transfer["bytes"]
    _check_transient_image(relocator_cluster, full)


def test_postcopy_releases_the_source_after_the_last_page(relocator_cluster, worker, ref) -> None:
    rel, full = _move(relocator_cluster, worker, ref, "postcopy")
    assert rel["transfer"] == "postcopy"
    pc = rel["postcopy"]
    # every lazy byte reached the target (by request or by the push) before the source went
    assert pc["lazy_bytes"] > 200 << 20 and pc["page_bytes"] == pc["lazy_bytes"], pc
    assert 0 <= pc["pages_after_switch_bytes"] <= pc["page_bytes"] and pc["postcopy_s"] > 0
    # the bulk came by the push channel, not page by page through CRIU's page server
    assert pc["pump_port"] and pc["pushed_bytes"] > 0, pc
    assert _info(full, "DUMP")["pages"] == "lazy"
    _check_transient_image(relocator_cluster, full)
    release = _info(full, "RELEASE")
    assert release["source_dump"]["done"], release  # the source's page server ended before its kill
    # nothing of the move is left running: no keeper, daemon or lazy dump
    from relocator.chaos.leaks import transfer_processes

    base = relocator_cluster.info["base_dir"]
    assert not transfer_processes(base), transfer_processes(base)


def test_auto_picks_handoff_where_the_target_starts_warm_else_shared(relocator_cluster, worker, ref) -> None:
    """auto's order (docs/handoff.md, "What auto does"): a handoff where the target would start
    warm (on the session cluster its host holds the worker's warm image once one launch was
    captured), else shared where the target sees the image store."""
    rel, full = _move(relocator_cluster, worker, ref, "auto")
    plan = _info(full, "PLAN")
    assert plan["requested"] == "auto", plan
    if rel["transfer"] == "handoff":
        assert "make-before-break" in plan["why"], plan
        return
    assert rel["transfer"] == "shared" and "image store" in plan["why"], plan
    assert plan["image_on"] == "disk"  # the shared store: nothing transient
