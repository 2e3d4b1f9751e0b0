"""One relocation under streaming load, measured: shared by `relocator demo`, `relocator bench
relocation` and the integration tests."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from relocator.cluster.streams import Load, Reference, prompts_for, reference, request_s
from relocator.waits import until


def relocate_under_load(ctl: Any, worker: str, to: str | None, model: str, *, concurrency: int = 8,
                        max_tokens: int = 256, warmup_s: float = 2.0, transfer: str | None = None,
                        faults: dict | None = None, ref: Reference | None = None,
                        on_phase: Callable[[dict], None] | None = None, stagger: bool = False,
                        prompt_tokens: int | None = None,
                        count_tokens: Callable[[str], int] | None = None) -> dict[str, Any]:
    """Stream `concurrency` greedy clients through the router, relocate `worker` while they
    stream, let every stream finish, and check each one against a reference run. `stagger`:
    the clients' first requests spread over one request's length (streams.start_offsets), so
    streams are in flight at every instant of the move; the move starts once all have begun.
    `prompt_tokens`: each client's own prompt of about that many tokens (streams.long_prompt;
    `count_tokens`, the model's tokenizer, makes it at most that many), not PROMPTS; a given
    `ref` must have run the same prompts."""
    url = ctl.router_url
    prompts = prompts_for(concurrency, prompt_tokens, count_tokens)
    t = time.monotonic()
    if ref is None:
        if prompt_tokens is not None:
            # a long prompt's first, uncached prefill can give another greedy output than every
            # later, prefix-cached one (a near-tie in the tiny model's logits: 1 of 8 prompts of
            # 4000 tokens, with no move); one run first, so the reference is what it serves after
            asyncio.run(reference(url, model, max_tokens, concurrency, concurrency, prompts))
        ref = asyncio.run(reference(url, model, max_tokens, concurrency, concurrency, prompts))
    ref_s = time.monotonic() - t
    spread = request_s(ref) if stagger else 0.0
    load = Load(url, model, ref, max_tokens, concurrency, stagger_s=spread, prompts=prompts).start()
    time.sleep(warmup_s + spread)
    t0 = time.monotonic()
    summary = ctl.relocate(worker, to=to, transfer=transfer, faults=faults, wait=False)
    rid = summary["id"]
    seen: set[str] = set()

    def ended() -> bool:  # the relocation is over; each phase reported once as it ends
        rel = ctl.get_relocation(rid)
        for p in rel["phases"]:
            if p["name"] not in seen and p.get("ended") is not None and on_phase:
                on_phase(p)
            if p.get("ended") is not None:
                seen.add(p["name"])
        return rel["result"] != "running"

    until(ended, None, 0.1, what=f"relocation {rid}")
    t1 = time.monotonic()
    time.sleep(1.0)  # a little traffic after the move too
    load.stop()
    summary = ctl.wait_relocation(rid)
    report = load.report(window=(t0, t1))
    # wall clock minus monotonic: places the load's times (monotonic) among the phases' (wall)
    return {"relocation": summary, "load": report, "relocation_wall_s": round(t1 - t0, 3),
            "clock_offset_s": time.time() - time.monotonic(),
            "reference_s": round(ref_s, 3), "reference": ref}


def lose_host_under_load(ctl: Any, info: dict, worker: str, model: str, ref: Reference, *, concurrency: int = 4,
                         max_tokens: int = 128, warmup_s: float = 2.0, timeout_s: float = 240.0) -> dict[str, Any]:
    """Emulated hosts (`info`: cluster.json): the host of `worker` dies under streaming load
    (every process of its namespace and its cells SIGKILLed). What clients saw (the longest gap
    in any stream from the kill to the replacement serving, tokens checked against `ref`), when
    the controller noticed, and how the replacement started (warm image: copied or not; cold)."""
    from relocator.cluster import emulate

    cluster = emulate.EmulatedCluster.from_dict(info["emulated"])
    node = _worker_row(ctl, worker)["node"]
    host = next(h for h in cluster.hosts if h.name == node)
    events = ctl.events(kinds=["node_lost", "replacement_finished", "worker_started"], idle_timeout=timeout_s)
    load = Load(ctl.router_url, model, ref, max_tokens, concurrency).start()
    time.sleep(warmup_s)
    t_kill = time.monotonic()
    killed = emulate.kill_host(host)
    seen: dict = {}
    for ev in events:
        if ev["kind"] == "worker_started" and ev.get("worker") != worker:
            continue
        seen.setdefault(ev["kind"], (time.monotonic(), ev))
        if ev["kind"] == "replacement_finished":
            break
    t_end = time.monotonic()
    time.sleep(1.0)
    load.stop()
    rep = load.report(window=(t_kill, t_end))
    detected = seen.get("node_lost", (None,))[0]
    done = seen.get("replacement_finished", (None, {}))
    started = seen.get("worker_started", (None, {}))[1]
    after = _worker_row(ctl, worker)
    return {"host": host.name, "killed_pids": len(killed["pids"]), "killed_cells": killed["cells"],
            "detected_s": round(detected - t_kill, 3) if detected else None,
            "serving_after_detection_s": round(done[0] - detected, 3) if detected and done[0] else None,
            "replacement": done[1], "started": {k: started.get(k) for k in ("how", "key", "reason", "copied", "seconds")},
            "worker_after": {k: after[k] for k in ("node", "state", "endpoint")},
            **{k: rep[k] for k in ("tokens_lost", "tokens_duplicated", "tokens_mismatched", "text_mismatched",
                                   "client_errors", "errors", "blackout_max_s", "requests")}}


def _worker_row(ctl: Any, worker: str) -> dict:
    return next(w for w in ctl.status()["workers"] if w["id"] == worker)
