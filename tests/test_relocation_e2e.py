"""Live relocation end to end on a real local Ray cluster (3 raylets, fake GPUs), real CRIU,
real vLLM CPU workers and the real router, under 8 concurrent greedy streams.

One cluster and two workers for the whole module (cold starts are the expensive part); the
tests run in order: move, injected faults, controller crash, drain.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from relocator.cluster.scenario import relocate_under_load
from relocator.cluster.streams import PROMPTS, Reference, compare_ids, reference, stream_once
from tests.helpers import why_not_done

pytestmark = pytest.mark.integration
MODEL = "tiny-llama"
MAX_TOKENS = 160


def gpus_free(ctl) -> dict[str, int]:
    # Ray creates and frees placement groups asynchronously; on a loaded 2-core machine its
    # resource view was seen to lag more than 10 s (a CI run with load average 11)
    deadline = time.monotonic() + 30
    while True:
        free = {n["id"]: n["gpus_free"] for n in ctl.status()["nodes"]}
        if time.monotonic() > deadline or free == expected_free(ctl):
            return free
        time.sleep(0.3)


def expected_free(ctl) -> dict[str, int]:
    st = ctl.status()
    free = {n["id"]: n["gpus_total"] for n in st["nodes"]}
    for w in st["workers"]:
        free[w["node"]] -= w["gpus"]
    return free


def assert_gpu_ids_from_ray(st: dict) -> None:
    """Each running worker holds as many of its node's GPU indices as it asked for (Ray's ids of
    its reservation), and workers on one node hold disjoint ones."""
    total = {n["id"]: n["gpus_total"] for n in st["nodes"]}
    taken: dict[str, list[int]] = {}
    for w in st["workers"]:
        if w["state"] == "running":
            assert len(w["gpu_ids"]) == w["gpus"] and all(0 <= i < total[w["node"]] for i in w["gpu_ids"]), w
            taken.setdefault(w["node"], []).extend(w["gpu_ids"])
    assert all(len(ids) == len(set(ids)) for ids in taken.values()), taken


def live_cells(ctl, worker: str) -> list[tuple[str, str]]:
    out = []
    for node, cells in ctl.cells().items():
        for c in cells:
            if c["id"].startswith(worker + "-") and c["alive"] and not c["stopped"]:
                out.append((node, c["id"]))
    return out


def all_cells(ctl, worker: str) -> list[tuple[str, str]]:
    return [(n, c["id"]) for n, cells in ctl.cells().items() for c in cells if c["id"].startswith(worker + "-")]


def greedy_ok(url: str, ref: Reference, n: int = 2) -> None:
    async def go():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(stream_once(s, url, MODEL, PROMPTS[i], MAX_TOKENS, prompt_idx=i)
                                          for i in range(n)))

    for r in asyncio.run(go()):
        assert not r.error, r.error
        assert compare_ids(ref[r.prompt].tokens, r.tokens)["first_divergence"] == -1
        assert r.text == ref[r.prompt].text


@pytest.fixture(scope="module")
def w1(relocator_cluster):
    ctl = relocator_cluster
    w = ctl.launch(MODEL, gpus=2, node="n1")
    assert w["state"] == "running" and w["node"] == "n1"
    return w["id"]


@pytest.fixture(scope="module")
def ref(relocator_cluster, w1) -> Reference:
    return asyncio.run(reference(relocator_cluster.router_url, MODEL, MAX_TOKENS, 8, 8))


def test_relocate_under_eight_streams(relocator_cluster, w1, ref) -> None:
    ctl = relocator_cluster
    assert gpus_free(ctl) == {"n1": 2, "n2": 4, "n3": 4}
    assert_gpu_ids_from_ray(ctl.status())
    res = relocate_under_load(ctl, w1, "n2", MODEL, concurrency=8, max_tokens=MAX_TOKENS, ref=ref)
    rel, load = res["relocation"], res["load"]
    assert rel["result"] == "done", why_not_done(rel)
    assert list(rel["phases"]) == ["PLAN", "RESERVE", "HOLD", "DUMP", "TRANSFER", "RESTORE", "SWITCH", "RELEASE"]
    assert load["client_errors"] == 0, load["errors"]
    assert (load["tokens_lost"], load["tokens_duplicated"], load["tokens_mismatched"]) == (0, 0, 0)
    assert load["text_mismatched"] == 0, load["text_bad"]
    assert all(c["verified"] == c["requests"] for c in load["clients"]) and len(load["clients"]) == 8
    assert load["blackout_max_s"] > 0
    st = ctl.status()
    (w,) = [w for w in st["workers"] if w["id"] == w1]
    assert (w["node"], w["state"]) == ("n2", "running")
    assert live_cells(ctl, w1) == [("n2", w["cell"])] and all_cells(ctl, w1) == [("n2", w["cell"])]
    assert gpus_free(ctl) == {"n1": 4, "n2": 2, "n3": 4}
    assert_gpu_ids_from_ray(st)
    assert {"id", "worker", "from", "to", "phase", "result"} <= set(st["relocations"][-1])


@pytest.mark.parametrize("phase", ["dump", "transfer", "restore"])
def test_injected_fault_rolls_back_and_source_serves(relocator_cluster, w1, ref, phase: str) -> None:
    ctl = relocator_cluster
    before = ctl.status()
    (w_before,) = [w for w in before["workers"] if w["id"] == w1]
    res = relocate_under_load(ctl, w1, "n3", MODEL, concurrency=8, max_tokens=MAX_TOKENS, ref=ref,
                              faults={phase: True}, warmup_s=1.0)
    rel, load = res["relocation"], res["load"]
    assert rel["result"] == "rolled_back", rel
    assert rel["error"].startswith(phase.upper())
    # a bound, not a target (the benchmarks report the figure): 4.1 s was seen once on the shared
    # 2-core machine with the target's restored copy still being killed
    assert rel["rollback"]["source_serving_s"] < 8.0, rel["rollback"]
    assert not rel["rollback"]["errors"]
    assert load["client_errors"] == 0, load["errors"]
    assert (load["tokens_lost"], load["tokens_duplicated"], load["tokens_mismatched"]) == (0, 0, 0)
    assert load["text_mismatched"] == 0, load["text_bad"]
    (w,) = [w for w in ctl.status()["workers"] if w["id"] == w1]
    assert (w["node"], w["cell"], w["state"], w["endpoint"]) == ("n2", w_before["cell"], "running",
                                                                 w_before["endpoint"])
    assert live_cells(ctl, w1) == [("n2", w["cell"])] and all_cells(ctl, w1) == [("n2", w["cell"])]
    assert gpus_free(ctl) == {"n1": 4, "n2": 2, "n3": 4}  # the target's reservation is gone
    greedy_ok(ctl.router_url, ref)


def _wait_after_crash(ctl, rid: str, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            rel = ctl.get_relocation(rid)
            if rel and rel["result"] != "running":
                return rel
        except Exception:  # noqa: BLE001 - the controller actor is restarting
            pass
        time.sleep(0.5)
    raise TimeoutError(rid)


@pytest.mark.parametrize("phase,expect", [("DUMP", "rolled_back"), ("SWITCH", "done")])
def test_controller_killed_mid_relocation(relocator_cluster, w1, ref, phase: str, expect: str) -> None:
    """The controller process dies during `phase` (an agent call may be in flight); Ray restarts
    it, and it rolls back (before SWITCH) or completes (from SWITCH on): never two live copies."""
    ctl = relocator_cluster
    pid_before = ctl.ping()["pid"]
    (w0,) = [w for w in ctl.status()["workers"] if w["id"] == w1]
    dst = "n1" if w0["node"] != "n1" else "n3"
    summary = ctl.relocate(w1, to=dst, faults={"crash": {"phase": phase, "after_s": 1.0 if phase == "DUMP" else 0.0}},
                           wait=False)
    rel = _wait_after_crash(ctl, summary["id"])
    assert ctl.ping()["pid"] != pid_before  # it really died and came back
    assert rel["recovered"] and rel["result"] == expect, rel
    (w,) = [w for w in ctl.status()["workers"] if w["id"] == w1]
    assert w["state"] == "running" and w["node"] == (w0["node"] if expect == "rolled_back" else dst)
    assert live_cells(ctl, w1) == [(w["node"], w["cell"])] and all_cells(ctl, w1) == [(w["node"], w["cell"])]
    assert gpus_free(ctl) == expected_free(ctl)
    greedy_ok(ctl.router_url, ref)


def test_agent_restart_readopts_cells(relocator_cluster, w1, ref) -> None:
    """Cells are not the agent's children: kill the agent actor, Ray restarts it, it re-adopts
    the worker's cell, which never stopped serving."""
    import ray

    from relocator.agent import NAMESPACE, agent_name

    ctl = relocator_cluster
    (w,) = [w for w in ctl.status()["workers"] if w["id"] == w1]
    agent = ray.get_actor(agent_name(w["node"]), namespace=NAMESPACE)
    pid = ray.get(agent.ping.remote())["pid"]
    ray.kill(agent, no_restart=False)
    deadline = time.monotonic() + 60
    info = None
    while time.monotonic() < deadline:
        try:
            info = ray.get(agent.ping.remote(), timeout=10)
            if info["pid"] != pid:
                break
        except Exception:  # noqa: BLE001 - restarting
            time.sleep(0.3)
    assert info and info["pid"] != pid and w["cell"] in info["adopted"]
    assert live_cells(ctl, w1) == [(w["node"], w["cell"])]
    greedy_ok(ctl.router_url, ref)


def test_drain_node_with_two_workers(relocator_cluster, w1, ref) -> None:
    """Both workers on one node move off it, live, the image streamed agent to agent."""
    ctl = relocator_cluster
    node = next(w["node"] for w in ctl.status()["workers"] if w["id"] == w1)
    w2 = ctl.launch(MODEL, gpus=1, node=node)["id"]
    from relocator.cluster.streams import Load

    load = Load(ctl.router_url, MODEL, ref, MAX_TOKENS, 8).start()
    time.sleep(1.0)
    out = ctl.drain(node, parallel=2, transfer="stream")  # two workers move at the same time
    load.stop()
    rep = load.report()
    why = "\n".join(why_not_done(r) for r in out["relocations"])
    assert out["drained"] and out["workers_left"] == [], why
    assert [r["result"] for r in out["relocations"]] == ["done", "done"], why
    assert all(r["transfer"] == "stream" for r in out["relocations"])
    assert rep["client_errors"] == 0 and (rep["tokens_lost"], rep["tokens_duplicated"], rep["tokens_mismatched"]) == (0, 0, 0)
    assert rep["text_mismatched"] == 0, rep["text_bad"]
    st = ctl.status()
    assert all(w["node"] != node and w["state"] == "running" for w in st["workers"])
    assert {n["id"]: n["gpus_free"] for n in st["nodes"]}[node] == 4
    for wid in (w1, w2):
        assert len(live_cells(ctl, wid)) == 1 and len(all_cells(ctl, wid)) == 1
    assert gpus_free(ctl) == expected_free(ctl)
    assert_gpu_ids_from_ray(st)
    greedy_ok(ctl.router_url, ref)


def test_router_killed_requests_wait_for_the_next_one(relocator_cluster, w1, ref) -> None:
    """SIGKILL the router: the cluster daemon owns its listening socket, so requests sent while
    no router runs wait in the backlog; the next router loads the persisted table and serves
    them. Not one retry: the first requests after the kill must succeed."""
    import os
    import signal

    from relocator.cluster.local import read_info

    ctl = relocator_cluster
    base = ctl.info["base_dir"]
    old = read_info(base)["router_pid"]
    os.kill(old, signal.SIGKILL)
    greedy_ok(ctl.router_url, ref, n=2)
    assert read_info(base)["router_pid"] != old


def test_cli_status_json_and_clean_errors(relocator_cluster, w1) -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    d = ["--cluster-dir", relocator_cluster.info["base_dir"]]
    proc = subprocess.run([sys.executable, "-m", "relocator", "status", "--json", *d], capture_output=True,
                          text=True, cwd=repo, timeout=120)
    assert proc.returncode == 0, proc.stderr
    st = json.loads(proc.stdout)
    assert st["router_url"] == relocator_cluster.router_url
    assert {"id", "gpus_total", "gpus_free"} <= set(st["nodes"][0])
    assert {"id", "model", "node", "state", "endpoint"} <= set(st["workers"][0])
    assert {"id", "worker", "from", "to", "phase", "result"} <= set(st["relocations"][0])
    proc = subprocess.run([sys.executable, "-m", "relocator", "relocate", "nope", "--json", *d],
                          capture_output=True, text=True, cwd=repo, timeout=120)
    assert proc.returncode == 2 and "unknown worker" in proc.stderr and "Traceback" not in proc.stderr
