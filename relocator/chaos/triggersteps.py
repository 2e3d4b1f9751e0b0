"""One trigger step of a chaos run (relocator.chaos.triggers): the step's policies applied, the
trigger fired through the controller's own operations (fake GPUs marked bad, a node notice),
what the controller did watched and told from its events, then everything put back (GPUs
cleared and their holds released, the notice withdrawn, the node uncordoned, a suspended
worker resumed, the cluster's policies applied again)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from relocator import waits
from relocator.chaos import triggers as T
from relocator.chaos.config import ChaosConfig
from relocator.chaos.faults import Step
from relocator.chaos.steps import _check, _serving, _settle, _status, _waiting

Say = Callable[[str], None]
GPU_WAIT_S = 30.0  # a GPU's state following its worker's move, or a hold its release: a few rounds
OUTCOME_GRACE_S = 30.0  # a notice's policy outcome: its moves' end, after the deadline at the latest


def _worker(ctl: Any, wid: str) -> dict:
    return next((w for w in _status(ctl)["workers"] if w["id"] == wid), {})


def _gpu(ctl: Any, node: str, gpu: int) -> tuple[str, bool]:
    """(state, held) of one GPU as the controller keeps it."""
    d = next((g for g in _status(ctl).get("gpu_health") or [] if g["node"] == node and g["gpu"] == gpu), None)
    return (d["state"], bool(d.get("held"))) if d else ("healthy", False)


def _wait(pred: Callable[[], Any], timeout: float, what: str, every: float = 0.25) -> Any:
    _waiting(what)

    def poll() -> Any:
        _check()
        return pred()

    return waits.settle(poll, timeout, every=every)


def _mark(ctl: Any, rec: dict, node: str, kind: str, gpus: list[int] | None = None, count: int = 0) -> list[int]:
    out = ctl.mark_gpus(node, kind, gpus, count)["gpus"]
    rec.setdefault("marked", []).append([node, out])
    if not rec["injected"]:
        rec.update(injected=True, injected_at=time.time())
    return out


def _events(ctl: Any, cursor: int) -> list[dict]:
    return list(ctl.events(since=cursor, kinds=list(T.EVENT_KINDS), idle_timeout=0))


def _moved(ctl: Any, step: Step, w: dict, fault: T.TriggerFault, cfg: ChaosConfig, rec: dict, cursor: int) -> dict:
    node, gpu = w["node"], w["gpu_ids"][0]
    _mark(ctl, rec, node, fault.mark or "remap", [gpu])
    t0 = rec["injected_at"]
    after = _wait(lambda: (x := _worker(ctl, w["id"])) and x.get("node") != node and x.get("state") == "running" and x,
                  cfg.move_timeout_s, f"the gpu-health policy to move {w['id']} off GPU {gpu} on {node}")
    moved_s = round(time.time() - t0, 2) if after else None
    state = _wait(lambda: (s := _gpu(ctl, node, gpu)) == ("ready_for_reset", True) and s, GPU_WAIT_S,
                  f"GPU {gpu} on {node} ready for reset and held") or _gpu(ctl, node, gpu)
    return {"node": node, "gpu": gpu, "moved": bool(after), "moved_s": moved_s, "to": (after or {}).get("node"),
            "gpu_state": state[0], "held": state[1]}


def _replaced(ctl: Any, step: Step, w: dict, fault: T.TriggerFault, cfg: ChaosConfig, rec: dict, cursor: int) -> dict:
    node, gpu = w["node"], w["gpu_ids"][0]
    _mark(ctl, rec, node, fault.mark or "xid79", [gpu])
    t0 = rec["injected_at"]
    after = _wait(lambda: (x := _worker(ctl, w["id"])) and x.get("cell") != w["cell"] and x.get("state") == "running"
                  and x, cfg.move_timeout_s, f"{w['id']} replaced after Xid 79 on GPU {gpu} of {node}")
    served_s = round(time.time() - t0, 2) if after else None
    state = _wait(lambda: (s := _gpu(ctl, node, gpu)) == ("failed", True) and s, GPU_WAIT_S,
                  f"GPU {gpu} on {node} failed and held") or _gpu(ctl, node, gpu)
    how = next((e.get("how") for e in _events(ctl, cursor) if e["kind"] == "replacement_finished"
                and e.get("worker") == w["id"]), None)
    if after:
        rec["cells"].append(after["cell"])
    return {"node": node, "gpu": gpu, "replaced": bool(after), "served_again_s": served_s, "how": how,
            "to": (after or {}).get("node"), "gpu_state": state[0], "held": state[1]}


def _nothing(ctl: Any, step: Step, w: dict, fault: T.TriggerFault, cfg: ChaosConfig, rec: dict, cursor: int) -> dict:
    node, gpu = w["node"], w["gpu_ids"][0]
    _mark(ctl, rec, node, fault.mark or "app", [gpu])
    _wait(lambda: False, T.QUIET_S, f"{T.QUIET_S:g} s of nothing after the application's Xids on GPU {gpu} of {node}",
          every=0.5)
    acted = [ln for ln in T.told([e for e in _events(ctl, cursor) if e["kind"] == "policy_planned"], rec["injected_at"])]
    after = _worker(ctl, w["id"])
    return {"node": node, "gpu": gpu, "acted": acted, "moved": after.get("cell") != w["cell"],
            "gpu_state": _gpu(ctl, node, gpu)[0]}


def _bounded(ctl: Any, step: Step, w: dict, fault: T.TriggerFault, cfg: ChaosConfig, rec: dict, cursor: int) -> dict:
    """The worker's GPU (wherever it is now) bad and healthy by turns, every second."""
    flips, last = 0, None
    _waiting(f"a health signal flapping for {cfg.flap_s:g} s")
    for _ in range(max(1, int(cfg.flap_s))):  # one flip a second
        _check()
        x = _worker(ctl, w["id"])
        if last is None and x.get("gpu_ids"):
            last = (x["node"], _mark(ctl, rec, x["node"], fault.mark or "remap", [x["gpu_ids"][0]]))
        elif last is not None:
            ctl.clear_gpus(last[0], last[1])
            last = None
        flips += 1
        time.sleep(1.0)
    if last is not None:
        ctl.clear_gpus(last[0], last[1])
    _wait(lambda: _worker(ctl, w["id"]).get("state") == "running"
          and not any(r["worker"] == w["id"] and r["result"] == "running" for r in _status(ctl)["relocations"]),
          cfg.move_timeout_s, f"{w['id']}'s moves to end")
    moves = T.budgeted_moves(_events(ctl, cursor), f"chaos-gpu-{step.index}")
    return {"flips": flips, "moves": moves, "budget": T.FLAP_BUDGET, "node": w["node"]}


def _off_node(ctl: Any, step: Step, w: dict, fault: T.TriggerFault, cfg: ChaosConfig, rec: dict, cursor: int) -> dict:
    node = w["node"]
    at = time.time() + T.NOTICE_S
    ctl.notice(node, at, "chaos")
    rec.update(notice=node, injected=True, injected_at=time.time())
    after = _wait(lambda: (x := _worker(ctl, w["id"])) and (x.get("state") == "suspended" or
                                                          (x.get("node") != node and x.get("state") == "running")) and x,
                  T.NOTICE_S + OUTCOME_GRACE_S, f"{w['id']} off {node} before its notice's deadline")
    off_s = round(time.time() - rec["injected_at"], 2) if after else None
    policy = f"chaos-notice-{step.index}"
    out = _wait(lambda: next((e for e in _events(ctl, cursor) if e["kind"] == "policy_outcome"
                              and e.get("policy") == policy), None), max(1.0, at - time.time() + OUTCOME_GRACE_S),
                f"{policy}'s outcome")
    if after and after.get("state") == "suspended":
        rec["suspended"] = w["id"]
    return {"node": node, "off_node": bool(after), "how": (after or {}).get("state"), "off_s": off_s,
            "to": (after or {}).get("node"), "met_deadline": (out or {}).get("met_deadline")}


def _held(ctl: Any, step: Step, w: dict, fault: T.TriggerFault, cfg: ChaosConfig, rec: dict, cursor: int) -> dict:
    nodes = [n for n in _status(ctl)["nodes"] if n.get("alive", True) and n["gpus_free"] >= T.HOLD_COUNT]
    if not nodes:
        rec["error"] = f"no live node with {T.HOLD_COUNT} free GPUs"
        return {"count": T.HOLD_COUNT}
    n = max(nodes, key=lambda n: (n["id"] != w["node"], n["gpus_free"], n["id"]))
    node, before = n["id"], int(n["gpus_free"])
    gpus = _mark(ctl, rec, node, fault.mark or "remap", count=T.HOLD_COUNT)

    def held() -> Any:
        st = _status(ctl)
        h = [g for g in st.get("gpu_health") or [] if g["node"] == node and g["gpu"] in gpus and g.get("held")]
        free = next(int(x["gpus_free"]) for x in st["nodes"] if x["id"] == node)
        return (len(h), free) if len(h) == len(gpus) and free == before - len(gpus) else None

    got = _wait(held, GPU_WAIT_S, f"{len(gpus)} GPUs of {node} held by count")
    if not got:
        st = _status(ctl)
        got = (sum(1 for g in st.get("gpu_health") or [] if g["node"] == node and g.get("held")),
               next(int(x["gpus_free"]) for x in st["nodes"] if x["id"] == node))
    return {"node": node, "gpus": gpus, "count": T.HOLD_COUNT, "held": got[0], "free_before": before,
            "free_held": got[1]}


RUNS: dict[T.Expect, Callable[..., dict]] = {
    T.Expect.MOVED: _moved, T.Expect.REPLACED: _replaced, T.Expect.NOTHING: _nothing,
    T.Expect.BOUNDED: _bounded, T.Expect.OFF_NODE: _off_node, T.Expect.HELD: _held,
}


def _put_back(ctl: Any, rec: dict, obs: dict) -> None:
    """GPUs cleared (and their holds seen released), notice withdrawn, node uncordoned, a
    suspended worker resumed."""
    for node, gpus in rec.get("marked", []):
        ctl.clear_gpus(node, gpus)
    cleared = {(node, g) for node, gpus in rec.get("marked", []) for g in gpus}
    if cleared:
        left = _wait(lambda: not [g for g in _status(ctl).get("gpu_health") or [] if (g["node"], g["gpu"]) in cleared],
                     GPU_WAIT_S, "the cleared GPUs to read healthy and their holds to go")
        obs["released"] = bool(left)
        obs["left"] = [f"{g['node']}/{g['gpu']} {g['state']}" for g in _status(ctl).get("gpu_health") or []
                       if (g["node"], g["gpu"]) in cleared]
        if "free_before" in obs:
            obs["free_after"] = next(int(x["gpus_free"]) for x in _status(ctl)["nodes"] if x["id"] == obs["node"])
    if rec.get("notice"):
        ctl.notice(rec["notice"], None)
        ctl.uncordon(rec["notice"])
    if rec.get("suspended"):
        r = ctl.resume(rec["suspended"])
        if r.get("cell_id"):
            rec["cells"].append(r["cell_id"])


def trigger_step(ctl: Any, base: Path, step: Step, worker: dict, cfg: ChaosConfig, say: Say) -> dict[str, Any]:
    """Fire the step's trigger fault (step.trigger) at `worker` and record what followed."""
    fault = T.TRIGGER_FAULTS[step.trigger or ""]
    rec: dict[str, Any] = {"step": step.index, "kind": "trigger", "trigger": fault.name, "fault": None,
                           "worker": worker["id"], "from": worker["node"], "started_at": time.time(),
                           "injected": False, "cells": [worker["cell"]], "expect": fault.expect.value}
    obs: dict[str, Any] = {}
    if worker.get("state") != "running" or not worker.get("gpu_ids"):
        rec.update(result="skipped", error=f"worker {worker['id']} is {worker.get('state')}", observed=obs)
        return rec
    prev = ctl.policies()
    cursor = int(_status(ctl)["events"]["last"])
    ctl.apply_policies(T.policies(step.index, fault))
    try:
        obs = RUNS[fault.expect](ctl, step, worker, fault, cfg, rec, cursor)
        rec["result"] = "done"
    except Exception as exc:  # noqa: BLE001 - checked: the step's problems say it
        rec.update(result="failed", error=f"{type(exc).__name__}: {exc}")
    finally:
        try:
            _put_back(ctl, rec, obs)
        finally:
            ctl.apply_policies(T.restore_doc(prev))
    events = _events(ctl, cursor)
    rec["controller"] = T.told(events, rec.get("injected_at") or rec["started_at"])
    rec["moves"] = [{"relocation": e["relocation"], "worker": e["worker"], "result": e.get("result")}
                    for e in events if e["kind"] == "relocation_finished" and e.get("relocation")]
    after = _worker(ctl, worker["id"])
    rec["to"] = after.get("node")
    if after.get("cell"):
        rec["cells"].append(after["cell"])
    rec["observed"] = obs
    rec["not_serving"] = _serving(ctl, [worker["id"]])
    rec["serving"] = not rec["not_serving"]
    rec["ended_at"] = time.time()
    rec["settle_s"] = _settle(ctl)
    say(f"  step {step.index}: trigger {fault.name} on {worker['id']}@{worker['node']}: {rec['result']}; "
        + ("; ".join(rec["controller"]) or "the controller did nothing") + ("" if rec["serving"] else " NOT SERVING"))
    return rec
