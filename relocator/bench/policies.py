"""`relocator bench policies`: the issue-33 target scenarios once, on a local cluster (3 nodes x
4 fake GPUs), under streaming load, with the gpu-health and node-notice policies:

1. a pending row remap on the GPU of a worker under 8 streams: seconds from the event to the
   worker serving from its new node (target: 10 s), client errors;
2. an Xid 79 on that worker's GPU: seconds from the event to its replacement serving (target:
   5 s, from its warm image), tokens lost / duplicated / mismatched, texts differing;
3. a 60 s notice for a node with 4 workers: all moved or suspended before the deadline, client
   errors, seconds used;
4. a health signal flapping every second for `flap_s` on a worker's GPU: moves started (target:
   at most the policy's budget).

The GPU facts come from the agent's NVML stand-in (`fake-nvml.json`): there is no GPU here.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from relocator.cluster.streams import Load, reference
from relocator.waits import until

MODEL = "tiny-llama"
MAX_TOKENS = 64
LABEL = {"bench": "policies"}
BUDGET = 3


def _policies() -> dict:
    f = {"labels": LABEL}
    return {"policies": [
        {"name": "bench-gpu", "trigger": {"kind": "gpu-health"}, "filter": f, "action": {"kind": "move"},
         "limits": {"cooldown_s": 0, "max_moves_per_hour": BUDGET}},
        {"name": "bench-notice", "trigger": {"kind": "node-notice"}, "filter": f,
         "action": {"kind": "move", "parallel": 4}, "limits": {"cooldown_s": 3600, "max_moves_per_hour": 32}}]}


def _worker(ctl: Any, wid: str) -> dict:
    return {w["id"]: w for w in ctl.status()["workers"]}[wid]


def _fake(base: Path, node: str, gpus: list[dict]) -> Path:
    p = base / "nodes" / node / "fake-nvml.json"
    p.write_text(json.dumps({"count": 4, "gpus": gpus}))
    return p


def _brief(rep: dict) -> dict:
    keys = ("requests", "client_errors", "tokens_lost", "tokens_duplicated", "tokens_mismatched", "text_mismatched")
    return {k: rep.get(k) for k in keys}


def remap_then_xid79(ctl: Any, base: Path, log: Callable[[str], None]) -> dict:
    w = ctl.launch(MODEL, 1, engine="reference", labels=LABEL)
    ref = asyncio.run(reference(ctl.router_url, MODEL, MAX_TOKENS, 8, 8))
    load = Load(ctl.router_url, MODEL, ref, MAX_TOKENS, 8).start()
    time.sleep(2.0)
    a, gpu = w["node"], w["gpu_ids"][0]
    t0 = time.time()
    fake = _fake(base, a, [{"index": gpu, "remapped_rows_pending": True}])
    until(lambda: _worker(ctl, w["id"])["node"] != a and _worker(ctl, w["id"])["state"] == "running", 120,
          every=0.1, what="the row-remap move")
    moved_s = time.time() - t0
    log(f"row remap: moved {a} -> {_worker(ctl, w['id'])['node']} in {moved_s:.2f} s")
    fake.unlink()
    time.sleep(2.0)
    b, gpu_b = _worker(ctl, w["id"])["node"], _worker(ctl, w["id"])["gpu_ids"][0]
    cursor = ctl._call("events_cursor", timeout=60)
    t1 = time.time()
    fake = _fake(base, b, [{"index": gpu_b, "xids": [79]}])
    until(lambda: [e for e in ctl.events(since=cursor, kinds=["replacement_finished"], idle_timeout=0)
                   if e.get("worker") == w["id"]], 120, every=0.1, what="the replacement")
    (ev,) = [e for e in ctl.events(since=cursor, kinds=["replacement_finished"], idle_timeout=0)
             if e.get("worker") == w["id"]][:1]
    replaced_s = ev["ts"] - t1
    log(f"Xid 79: replaced ({ev.get('how')}) on {ev.get('to_node')} in {replaced_s:.2f} s")
    time.sleep(3.0)
    load.stop()
    fake.unlink()
    return {"row_remap_moved_s": round(moved_s, 2), "xid79_served_again_s": round(replaced_s, 2),
            "xid79_how": ev.get("how"), "load": _brief(load.report()), "worker": w["id"]}


def notice_four(ctl: Any, log: Callable[[str], None]) -> dict:
    free = {n["id"]: n["gpus_free"] for n in ctl.status()["nodes"] if n["alive"]}
    node = max(free, key=lambda n: free[n])
    ws = [ctl.launch(MODEL, 1, node=node, engine="reference", labels=LABEL, priority=i)["id"] for i in range(4)]
    ref = asyncio.run(reference(ctl.router_url, MODEL, MAX_TOKENS, 8, 8))
    load = Load(ctl.router_url, MODEL, ref, MAX_TOKENS, 8).start()
    time.sleep(2.0)
    cursor = ctl._call("events_cursor", timeout=60)
    t0 = time.time()
    deadline = t0 + 60
    ctl.notice(node, deadline, "bench")
    until(lambda: all(_worker(ctl, x)["node"] != node or _worker(ctl, x)["state"] == "suspended" for x in ws),
          90, every=0.2, what="the notice's moves")
    used = time.time() - t0
    load.stop()
    outs = [e for e in ctl.events(since=cursor, kinds=["policy_outcome"], idle_timeout=0)]
    ctl.notice(node, None)
    ctl.uncordon(node)
    states = {x: _worker(ctl, x)["state"] for x in ws}
    log(f"notice: 4 workers off {node} in {used:.2f} s of 60 ({states})")
    return {"node": node, "seconds_used": round(used, 2), "before_deadline": time.time() <= deadline or used <= 60,
            "moved": sum(1 for s in states.values() if s == "running"),
            "suspended": sum(1 for s in states.values() if s == "suspended"),
            "met_deadline": outs[0].get("met_deadline") if outs else None, "load": _brief(load.report()),
            "workers": ws}


def flapping(ctl: Any, base: Path, wid: str, flap_s: float, log: Callable[[str], None]) -> dict:
    """The worker's GPU reads pending-remap and healthy by turns, every second, for `flap_s`."""
    def moves() -> int:
        return sum(r["n"] for r in ctl.policies()["counts"] if r["policy"] == "bench-gpu" and r["action"] == "move")

    n0 = moves()
    files: set[Path] = set()
    for i in range(int(flap_s)):
        w = _worker(ctl, wid)
        files.add(_fake(base, w["node"], [{"index": (w["gpu_ids"] or [0])[0], "remapped_rows_pending": i % 2 == 0}]))
        time.sleep(1.0)
    for p in files:
        p.unlink(missing_ok=True)
    n = moves() - n0
    log(f"flapping {flap_s:.0f} s: {n} move(s), budget {BUDGET} an hour")
    return {"flap_s": flap_s, "flips": int(flap_s), "moves": n, "budget_per_hour": BUDGET}


def run(cluster_dir: str, flap_s: float = 60.0, log: Callable[[str], None] = print) -> dict:
    import relocator

    base = Path(cluster_dir)
    shutil.rmtree(base, ignore_errors=True)
    t0 = time.monotonic()
    ctl = relocator.start(nodes=3, gpus_per_node=4, base_dir=str(base))
    try:
        ctl.apply_policies(_policies())
        one = remap_then_xid79(ctl, base, log)
        ctl.stop_worker(one.pop("worker"))
        four = notice_four(ctl, log)
        flap = flapping(ctl, base, four["workers"][-1], flap_s, log)
        return {"remap_and_xid79": one, "notice": four, "flapping": flap, "seconds": round(time.monotonic() - t0, 1)}
    finally:
        ctl.down()
        shutil.rmtree(base, ignore_errors=True)
