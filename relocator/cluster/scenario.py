"""One relocation under streaming load, measured: shared by `relocator demo`, `relocator bench
relocation` and the integration tests."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from relocator.cluster.streams import Load, Reference, reference
from relocator.waits import until


def relocate_under_load(ctl: Any, worker: str, to: str | None, model: str, *, concurrency: int = 8,
                        max_tokens: int = 256, warmup_s: float = 2.0, transfer: str | None = None,
                        faults: dict | None = None, ref: Reference | None = None,
                        on_phase: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Stream `concurrency` greedy clients through the router, relocate `worker` while they
    stream, let every stream finish, and check each one against a reference run."""
    url = ctl.router_url
    t = time.monotonic()
    if ref is None:
        ref = asyncio.run(reference(url, model, max_tokens, concurrency, concurrency))
    ref_s = time.monotonic() - t
    load = Load(url, model, ref, max_tokens, concurrency).start()
    time.sleep(warmup_s)
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
