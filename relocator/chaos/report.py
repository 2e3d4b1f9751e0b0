"""What a chaos run found: leaks after the steps, each step's outcome, the report's figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relocator import waits
from relocator.chaos import leaks as L
from relocator.chaos.faults import FAULTS, StepKind, check_outcome, check_scheduling_outcome
from relocator.chaos.hosts import LocalView


def _leak_settle(view: LocalView, before: dict, expected: dict, netns_names: set[str],
                 timeout: float = 20.0) -> dict[str, list[str]]:
    last: dict[str, list[str]] = {}

    def clean() -> bool:
        last.clear()
        last.update(L.diff_leaks(before, view.collect(netns_names=netns_names), expected))
        return not L.total(last)

    waits.settle(clean, timeout, every=1.0)
    return last


def _our_netns(cells: set[str], moves: list[dict]) -> set[str]:
    """The namespaces this run's cells can have: rl-<cell> of every cell it saw (launches,
    replacements) and rl-<worker>-<relocation> of every relocation target."""
    names = {f"rl-{c}" for c in cells}
    names |= {f"rl-{m['worker']}-{m['relocation']}" for m in moves if m.get("relocation")}
    names |= {f"rl-{r['worker']}-{r['relocation']}" for m in moves for r in m.get("moves", [])
              if isinstance(r, dict) and r.get("relocation")}
    return names


def _expected(st: dict, moves: list[dict]) -> dict[str, set[str]]:
    """What must exist now: each worker's cell and netns, its reservation and its newest image
    (kept for a warm restart)."""
    cells = {f"{w['node']}/{w['cell']}" for w in st["workers"]}
    pgs = {w["reservation"] for w in st["workers"] if w.get("reservation")}
    images = {f"{Path(w['last_image']).parent.parent.name}/{Path(w['last_image']).name}"
              for w in st["workers"] if w.get("last_image")}
    return {"cells": cells, "netns": {"rl-" + w["cell"] for w in st["workers"]}, "placement_groups": pgs,
            "images": images}


def _p50_phases(moves: list[dict]) -> dict[str, float]:
    acc: dict[str, list[float]] = {}
    for m in moves:
        if m.get("fault") or m.get("result") != "done":
            continue
        for k, v in m.get("phases", {}).items():
            acc.setdefault(k, []).append(v)
    return {k: round(sorted(v)[len(v) // 2], 3) for k, v in acc.items()}


def _attribute_failures(rep: Any, moves: list[dict]) -> tuple[dict[str, int], list[dict]]:
    """Failed requests, each attributed to the fault whose window (injection .. move end + 2 s)
    holds its end: ({fault or "none": count}, [failure])."""
    windows = [(m.get("fault") or m.get("trigger"), m.get("injected_at") or m["started_at"], m["ended_at"] + 2.0)
               for m in moves if (m.get("fault") or m.get("trigger")) and m.get("started_at")]
    by_fault: dict[str, int] = {}
    failed = []
    for r in rep.results:
        if r.ok:
            continue
        end = rep.started_at + r.start + (r.total or 0)
        f = next((f for f, a, b in windows if a - 0.5 <= end <= b), None)
        by_fault[f or "none"] = by_fault.get(f or "none", 0) + 1
        failed.append({"index": r.index, "error": r.error, "fault": f})
    return by_fault, failed


def _outcome(m: dict, by_fault: dict[str, int], cfg: Any) -> dict:
    """One step's checked outcome (check_outcome / check_scheduling_outcome)."""
    f = FAULTS[m["fault"]] if m.get("fault") else None
    failed = by_fault.get(m.get("fault") or m.get("trigger") or "", 0) if f or m.get("trigger") else 0
    if m.get("kind") not in (None, StepKind.MOVE):
        o = check_scheduling_outcome({**m, "failed_requests": failed}, f)
        extra = {k: m[k] for k in ("trigger", "controller", "observed", "warm", "start", "detail")
                 if k in m}  # a trigger step's, a warm image step's
        return {**o.to_dict(), "step": m["step"], "kind": m["kind"], "serve_again_s": m.get("serve_again_s"),
                "injected": m.get("injected"), "source_serving_s": m.get("source_serving_s"), **extra}
    o = check_outcome(f, m, injected=m.get("injected", True), serving=m["serving"],
                      worker_node_alive=m.get("worker_node_alive", True),
                      serve_again_s=m.get("serve_again_s"), failed_requests=failed, leaked=None,
                      serve_target_s=(f.serve_target_s if f and f.serve_target_s else cfg.serve_target_s))
    return {**o.to_dict(), "step": m["step"], "serve_again_s": m.get("serve_again_s"),
            "source_serving_s": m.get("source_serving_s"), "injected": m.get("injected"), "detail": m.get("detail")}


def outcomes(moves: list[dict], by_fault: dict[str, int], cfg: Any) -> tuple[list[dict], list[dict]]:
    """(every step's outcome, the scheduling steps' ones)."""
    out: list[dict] = []
    scheduling: list[dict] = []
    for m in moves:
        if m.get("result") == "skipped":
            out.append({"fault": m["fault"], "result": "skipped", "ok": False, "problems": [m["error"]],
                        **({"trigger": m["trigger"]} if m.get("trigger") else {})})
            if m.get("kind") not in (None, StepKind.MOVE):
                scheduling.append({**out[-1], "kind": m["kind"], "step": m["step"]})
            continue
        out.append(_outcome(m, by_fault, cfg))
        if m.get("kind") not in (None, StepKind.MOVE):
            scheduling.append(out[-1])
    return out, scheduling


def phase_spans(moves: list[dict]) -> list[tuple[str, float, float]]:
    """One shaded span per move: DUMP start .. SWITCH end (the worker frozen, its streams held),
    labelled when there are few; each injection marked with the fault's name."""
    spans = []
    for m in moves:
        pt = [(n, a, b) for n, a, b in m.get("phase_times", []) if n in ("DUMP", "TRANSFER", "RESTORE", "SWITCH")]
        if pt:
            label = f"{m['step']}:{'DUMP..SWITCH' if pt[-1][0] == 'SWITCH' else pt[-1][0]}" if len(moves) <= 15 else ""
            spans.append((label, pt[0][1], pt[-1][2]))
    spans += [(f"{m['step']}:{m['fault']}", m["injected_at"], m["injected_at"] + 0.05)
              for m in moves if m.get("injected_at")]
    return spans


def _without_router_restarts(rep: Any, ref: Any, failed: list[dict]) -> dict[str, Any]:
    """The token check without the requests a router restart cut (a closed-loop client without
    retries fails fast while the router is down: thousands of failed requests, each of which
    counts its whole reference as lost)."""
    from loadtests import LoadReport, check_tokens

    cut = {r["index"] for r in failed if r["fault"] in FAULTS and FAULTS[r["fault"]].requests_may_fail}
    rest = LoadReport(config=rep.config, started_at=rep.started_at, duration_s=rep.duration_s,
                      results=[r for r in rep.results if r.index not in cut])
    tc = check_tokens(rest, ref)
    return {"requests": len(rest.results), "failed_requests": len(failed) - len(cut),
            "tokens_lost": tc.tokens_lost, "tokens_duplicated": tc.tokens_duplicated,
            "tokens_mismatched": tc.tokens_mismatched, "text_mismatched": tc.text_mismatched}


def figures(cfg: Any, rep: Any, ref: Any, moves: list[dict], leaked: dict[str, list[str]]) -> dict[str, Any]:
    """The report's figures from the load's report, the reference and the steps' records."""
    from loadtests import check_tokens

    tc = check_tokens(rep, ref)
    summ = rep.summary()
    by_fault, failed = _attribute_failures(rep, moves)
    rest = _without_router_restarts(rep, ref, failed)
    rep.token_check = tc
    outs, scheduling = outcomes(moves, by_fault, cfg)
    if cfg.png:
        rep.write_png(cfg.png, phases=phase_spans(moves))
    plain = [m for m in moves if not m.get("fault") and m.get("kind") in (None, StepKind.MOVE)]
    steps = [m for m in moves if not m.get("trigger")]  # a trigger step is no relocation: its moves are
    by_policy = [r for m in moves if m.get("trigger") for r in m.get("moves") or []]
    return {
        "relocations": len([m for m in steps if m.get("result") not in ("skipped", None)]) + len(by_policy),
        "relocations_done": sum(m.get("result") == "done" for m in steps) + sum(r.get("result") == "done"
                                                                                for r in by_policy),
        "plain_moves": len(plain), "plain_moves_done": sum(m.get("result") == "done" for m in plain),
        "faults_injected": sum(bool(m.get("injected")) for m in steps),
        "triggers_injected": sum(bool(m.get("injected")) for m in moves if m.get("trigger")),
        "failed_requests": summ["failed_requests"], "failed_requests_by_fault": by_fault,
        "requests": summ["requests"], "failed_by_error": summ["errors"], "tokens": summ["tokens"],
        "tokens_checked_requests": tc.checked,
        "tokens_lost": tc.tokens_lost, "tokens_duplicated": tc.tokens_duplicated,
        "tokens_mismatched": tc.tokens_mismatched, "token_bad": tc.bad[:5],
        "texts_checked_requests": tc.texts_checked, "text_mismatched": tc.text_mismatched,
        "text_bad": tc.text_bad[:5],
        "excluding_router_restart": rest,
        "itl_ms": summ["itl_ms"], "ttft_ms": summ["ttft_ms"],
        "leaked": leaked, "faults": {o["fault"]: o for o in outs if o.get("fault")},
        "moves": moves, "failed": failed[:20],
        "scheduling_steps": scheduling,
        # trigger faults (relocator/chaos/triggers.py): each one's outcome and what the controller did
        "triggers": {o["trigger"]: o for o in scheduling if o.get("trigger")},
        # warm image faults (relocator/chaos/warmsteps.py): how the start after each went
        "warm_faults": {o["warm"]: o for o in scheduling if o.get("warm")},
        "phase_seconds_p50": _p50_phases(moves),
    }


def run_ok(report: dict[str, Any], stalled: dict | None) -> bool:
    """The run's verdict: no stall, no failed request or token error outside a router restart,
    nothing leaked, every fault's and plain scheduling step's outcome ok, every plain move done."""
    ex = report.get("excluding_router_restart", {})
    return bool(
        not stalled
        and ex.get("failed_requests") == 0
        and ex.get("tokens_lost") == ex.get("tokens_duplicated") == ex.get("tokens_mismatched") == 0
        and ex.get("text_mismatched") == 0
        and not L.total(report.get("leaked", {}))
        and all(o["ok"] for o in report.get("faults", {}).values())
        and all(o["ok"] for o in report.get("scheduling_steps", []) if not o.get("fault"))
        and report.get("plain_moves_done") == report.get("plain_moves"))
