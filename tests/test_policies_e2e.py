"""Policies end to end (issue 33) on the session's local Ray cluster (3 nodes x 4 fake GPUs),
one reference-engine worker (ready in ~1.5 s), real CRIU and the real router, under streaming
load: the agent's NVML (the file-driven stand-in: no GPU here) reports a pending row remap on
the worker's GPU, the gpu-health policy moves it live and the GPU becomes ready for a reset
(held: nothing new placed on it); then a 60 s notice for its new node moves it off before the
deadline. 0 client errors, 0 lost, duplicated or mismatched tokens."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path

import pytest

from relocator.cluster.streams import Load, reference
from tests.helpers import clean, continued_streams, wait_for, workers

pytestmark = pytest.mark.integration
MODEL = "tiny-llama"
ENGINE = "reference"
MAX_TOKENS = 200  # streams long enough that the moves cut some (continued, not finished)
LABEL = {"test": "policies-e2e"}
POLICIES = {"policies": [
    {"name": "t-bad-gpu", "trigger": {"kind": "gpu-health"}, "filter": {"labels": LABEL},
     "action": {"kind": "move"}, "limits": {"max_moves_per_hour": 2}},
    {"name": "t-notice", "trigger": {"kind": "node-notice"}, "filter": {"labels": LABEL},
     "action": {"kind": "move", "parallel": 2}, "limits": {"cooldown_s": 3600}},
]}


def _events(ctl, cursor, kinds):
    return list(ctl.events(since=cursor, kinds=kinds, idle_timeout=0))


def test_bad_gpu_then_node_notice_move_the_worker_live(relocator_cluster) -> None:
    ctl = relocator_cluster
    for w in ctl.status()["workers"]:  # a clean start: the router's replicas are this test's only
        ctl.stop_worker(w["id"])
    base = Path(ctl.status()["events"]["log"]).parent
    cursor = ctl._call("events_cursor", timeout=60)
    out = ctl.apply_policies(POLICIES)
    assert [p["name"] for p in out["policies"]] == ["t-bad-gpu", "t-notice"] and out["errors"] == []
    w = ctl.launch(MODEL, 1, engine=ENGINE, labels=LABEL)
    a, gpu = w["node"], w["gpu_ids"][0]
    fake = base / "nodes" / a / "fake-nvml.json"
    b = None
    try:
        ref = asyncio.run(reference(ctl.router_url, MODEL, MAX_TOKENS, 2, 2))
        before = continued_streams(ctl.router_url)
        load = Load(ctl.router_url, MODEL, ref, MAX_TOKENS, 2).start()
        time.sleep(1.0)
        # an application Xid on another GPU of the node changes nothing; a pending row remap on
        # the worker's GPU drains it
        fake.write_text(json.dumps({"count": 4, "gpus": [{"index": (gpu + 1) % 4, "xids": [43]},
                                                         {"index": gpu, "remapped_rows_pending": True}]}))
        wait_for(lambda: workers(ctl)[w["id"]]["node"] != a and workers(ctl)[w["id"]]["state"] == "running",
                 30, "the gpu-health policy's live move")
        b = workers(ctl)[w["id"]]["node"]
        wait_for(lambda: [(g["node"], g["gpu"], g["state"]) for g in ctl.status()["gpu_health"]]
                 == [(a, gpu, "ready_for_reset")], 20, "the drained GPU ready for a reset")
        assert ctl.status()["gpu_health"][0]["held"] is True  # nothing new placed on it
        # a 60 s notice for the worker's new node: moved off before the deadline
        deadline = time.time() + 60
        ctl.notice(b, deadline, "test")
        wait_for(lambda: workers(ctl)[w["id"]]["node"] not in (b,) and workers(ctl)[w["id"]]["state"] == "running",
                 30, "the node-notice policy's move")
        assert time.time() < deadline
        load.stop()
        # every stream exact; whether one was in flight at a freeze (and so continued) is timing
        # on this engine (it failed once in a full run): reported, not required
        print(f"streams continued across the policies' moves: {continued_streams(ctl.router_url) - before}")
        clean(load.report())
        wait_for(lambda: [e for e in _events(ctl, cursor, ["policy_outcome"]) if e["policy"] == "t-notice"],
                 10, "the notice policy's outcome")
        outcomes = [e for e in _events(ctl, cursor, ["policy_outcome"]) if e["policy"] == "t-notice"]
        assert outcomes[0]["ok"] and outcomes[0]["met_deadline"] is True, outcomes
        planned = [e for e in _events(ctl, cursor, ["policy_planned"]) if e["policy"] == "t-notice"]
        assert [s["op"] for s in planned[0]["steps"]] == ["cordon", "move"], planned
        kinds = [(e["from"], e["to"]) for e in _events(ctl, cursor, ["gpu_health"]) if e["node"] == a]
        assert kinds[:2] == [("healthy", "draining"), ("draining", "ready_for_reset")], kinds
        with urllib.request.urlopen(ctl.status()["metrics"]["controller"], timeout=10) as resp:
            text = resp.read().decode()
        assert 'relocator_policy_actions_total{action="move",policy="t-bad-gpu",result="ok"} 1.0' in text, text
        assert f'relocator_gpu_health{{gpu="{gpu}",node="{a}",state="ready_for_reset"}} 1.0' in text
    finally:
        fake.unlink(missing_ok=True)
        if b is not None:
            ctl.notice(b, None)
            ctl.uncordon(b)
        ctl.apply_policies(None)
        try:
            ctl.stop_worker(w["id"])
        except Exception:  # noqa: BLE001
            pass
    # the reset GPU reads healthy again: released
    wait_for(lambda: ctl.status()["gpu_health"] == [], 20, "the GPU healthy again and its hold released")
