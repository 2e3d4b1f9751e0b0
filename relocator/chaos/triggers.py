"""Chaos faults for the triggers that start moves (issue 33, docs/policies.md): each fires one
policy trigger (a GPU going bad through the agent's NVML stand-in, a node notice, a flapping
health signal, N GPUs held by count) and says what the controller must do about it. Pure:
the catalogue, the policies a step runs with, the controller's events told as lines, and the
check of a step's record (`relocator chaos --triggers`; triggersteps.py drives the cluster)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from relocator.choices import Choice, parse_names


class Expect(Choice):
    """What the controller must do about a trigger fault."""

    MOVED = "moved"  # the worker moved live off the GPU, which is then ready for reset and held
    REPLACED = "replaced"  # the worker replaced (its GPU failed), the GPU failed and held
    NOTHING = "nothing"  # no policy acts, the worker stays where it is, the GPU reads healthy
    BOUNDED = "bounded"  # at most the policy's budget of moves
    OFF_NODE = "off-node"  # the worker off the node (moved or suspended) before the deadline
    HELD = "held"  # N GPUs held by count (N fewer free), all released once cleared


@dataclass(frozen=True)
class TriggerFault:
    name: str
    trigger: str  # the policy trigger kind it fires
    expect: Expect
    how: str
    mark: str | None = None  # the GPU fault written (relocator.agent.fakenvml.MARKS)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


TRIGGER_FAULTS: dict[str, TriggerFault] = {f.name: f for f in (
    TriggerFault("gpu-remap", "gpu-health", Expect.MOVED,
                 "the worker's GPU reports a pending row remap: it drains, the worker moves live, "
                 "the GPU is then ready for reset and held", mark="remap"),
    TriggerFault("gpu-xid79", "gpu-health", Expect.REPLACED,
                 "Xid 79 (fallen off the bus) on the worker's GPU: it failed, the worker is replaced "
                 "(warm image, streams continued), the GPU held", mark="xid79"),
    TriggerFault("gpu-app-xid", "gpu-health", Expect.NOTHING,
                 "Xids 13, 31 and 43 (the application's) on the worker's GPU: nothing happens", mark="app"),
    TriggerFault("gpu-flap", "gpu-health", Expect.BOUNDED,
                 "the worker's GPU reports a pending remap and healthy by turns, every second: at "
                 "most the policy's budget of moves", mark="remap"),
    TriggerFault("node-notice", "node-notice", Expect.OFF_NODE,
                 "a 60 s notice for the worker's node: the worker off it (moved, or suspended where "
                 "nothing fits) before the deadline"),
    TriggerFault("gpu-hold-count", "gpu-health", Expect.HELD,
                 "2 idle GPUs of a node with no worker of the run report a pending remap: both held "
                 "by count (2 fewer free GPUs), both released once cleared", mark="remap"),
)}

FLAP_BUDGET = 2  # the flapping step's policy: moves an hour
HOLD_COUNT = 2
NOTICE_S = 60.0
QUIET_S = 8.0  # how long "nothing happens" is watched: four reconcile rounds
#: what the controller does that a step's record tells (its events)
EVENT_KINDS = ("gpu_health", "policy_planned", "policy_outcome", "relocation_finished", "replacement_finished",
               "worker_suspended", "worker_resumed")
BUDGETED = ("move", "replace", "suspend", "consolidate")


def parse_triggers(spec: str | Sequence[str] | None) -> list[str]:
    """"all", "none", "" or a comma list of names from TRIGGER_FAULTS."""
    return parse_names(spec, list(TRIGGER_FAULTS), "trigger fault")


def policies(step: int, fault: TriggerFault) -> dict:
    """The policies a trigger step runs with (in place of the cluster's for the step): named
    after the step, so each starts with a whole budget and no cooldown from an earlier step."""
    if fault.trigger == "node-notice":
        return {"policies": [{"name": f"chaos-notice-{step}", "trigger": {"kind": "node-notice"},
                              "action": {"kind": "move", "parallel": 4},
                              "limits": {"cooldown_s": 3600, "max_moves_per_hour": 32}}]}
    budget = FLAP_BUDGET if fault.expect is Expect.BOUNDED else 6
    return {"policies": [{"name": f"chaos-gpu-{step}", "trigger": {"kind": "gpu-health"}, "action": {"kind": "move"},
                          "limits": {"cooldown_s": 0, "max_moves_per_hour": budget}}]}


def restore_doc(listing: dict) -> dict:
    """The policies that ran before a step (as `relocator policies` lists them), to apply again."""
    return {"policies": [p["set"] for p in listing.get("policies") or [] if p.get("set")]}


def _steps(ev: dict) -> str:
    return ", ".join(f"{s['op']} {s.get('worker') or s.get('node') or ''}" + (f"→{s['to']}" if s.get("to") else "")
                     for s in ev.get("steps") or []) or "nothing"


def told(events: Sequence[dict], t0: float) -> list[str]:
    """The controller's events as short lines, each with its time after `t0` (the injection)."""
    out = []
    for e in events:
        at = f"+{float(e.get('ts', t0)) - t0:.1f}s"
        k = e.get("kind")
        if k == "gpu_health":
            line = f"GPU {e.get('gpu')} on {e.get('node')}: {e.get('from')} → {e.get('to')} ({e.get('why') or '-'})"
        elif k == "policy_planned":
            short = f", short by {e['short_by_s']} s" if e.get("short_by_s") else ""
            line = f"{e.get('policy')} planned {_steps(e)} ({(e.get('firing') or {}).get('reason', '')}{short})"
        elif k == "policy_outcome":
            met = "" if e.get("met_deadline") is None else f", deadline {'met' if e['met_deadline'] else 'MISSED'}"
            res = ", ".join(f"{r.get('op', '?')} {r.get('worker') or r.get('node') or ''}: {r.get('result')}"
                            for r in e.get("results") or [])
            line = f"{e.get('policy')} {'ok' if e.get('ok') else 'FAILED'} in {e.get('seconds')} s ({res}{met})"
        elif k == "relocation_finished":
            line = f"relocation {e.get('relocation')} of {e.get('worker')}: {e.get('result')}"
        elif k == "replacement_finished":
            line = (f"{e.get('worker')} replaced on {e.get('to_node')} ({e.get('how')}, "
                    f"{'ok' if e.get('ok', True) else 'failed: ' + str(e.get('error'))})")
        elif k in ("worker_suspended", "worker_resumed"):
            line = f"{e.get('worker')} {k.split('_')[1]} on {e.get('node')}"
        else:
            continue
        out.append(f"{at} {line}")
    return out


def budgeted_moves(events: Sequence[dict], policy: str) -> int:
    """Moves (and replacements, suspends, consolidations) a policy started, from its plans."""
    return sum(1 for e in events if e.get("kind") == "policy_planned" and e.get("policy") == policy
               for s in e.get("steps") or [] if s.get("op") in BUDGETED)


def check(rec: dict, fault: TriggerFault) -> list[str]:
    """What is wrong with a trigger step's record (`rec["observed"]`: what the step saw)."""
    o = rec.get("observed") or {}
    problems: list[str] = []
    if not rec.get("injected"):
        return [f"not injected: {rec.get('error') or 'no target'}"]
    if fault.expect is Expect.MOVED:
        if not o.get("moved"):
            problems.append(f"the worker was not moved off GPU {o.get('gpu')} on {o.get('node')}")
        if o.get("gpu_state") != "ready_for_reset" or not o.get("held"):
            problems.append(f"the drained GPU is {o.get('gpu_state')} (held: {o.get('held')}), not ready_for_reset and held")
    elif fault.expect is Expect.REPLACED:
        if not o.get("replaced"):
            problems.append("the worker was not replaced")
        if o.get("gpu_state") != "failed" or not o.get("held"):
            problems.append(f"the failed GPU is {o.get('gpu_state')} (held: {o.get('held')}), not failed and held")
    elif fault.expect is Expect.NOTHING:
        if o.get("acted"):
            problems.append(f"a policy acted on the application's Xids: {o['acted']}")
        if o.get("moved"):
            problems.append("the worker moved")
        if o.get("gpu_state") not in (None, "healthy"):
            problems.append(f"the GPU became {o.get('gpu_state')}")
    elif fault.expect is Expect.BOUNDED:
        if int(o.get("moves") or 0) > int(o.get("budget") or 0):
            problems.append(f"{o.get('moves')} moves > the budget of {o.get('budget')} ({o.get('flips')} flips)")
    elif fault.expect is Expect.OFF_NODE:
        if not o.get("off_node"):
            problems.append(f"the worker is still on {o.get('node')}")
        if o.get("met_deadline") is not True:
            problems.append(f"deadline not met (policy outcome: {o.get('met_deadline')})")
    elif fault.expect is Expect.HELD:
        if int(o.get("held") or 0) != int(o.get("count") or 0):
            problems.append(f"{o.get('held')} GPU(s) held of {o.get('count')} marked")
        if o.get("free_held") != (o.get("free_before") or 0) - int(o.get("count") or 0):
            problems.append(f"free GPUs {o.get('free_before')} → {o.get('free_held')} while held, "
                            f"not {int(o.get('free_before') or 0) - int(o.get('count') or 0)}")
    if fault.expect is not Expect.NOTHING and not o.get("released", True):
        problems.append(f"not released after the clear: {o.get('left')}")
    return problems
