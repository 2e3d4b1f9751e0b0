"""Each GPU's health state as the controller keeps it (store kind `gpu_health`): healthy,
draining (no new placement; its worker is moved), ready_for_reset (drained: nothing runs on it)
or failed (its worker is replaced). A GPU that is not healthy and runs nothing is held by a
one-GPU reservation, so nothing new is placed on it; it is released when the GPU reads healthy
again (after its reset). Transitions are events (`gpu_health`)."""

from __future__ import annotations

from typing import Any, Callable

from relocator.policies.base import Context
from relocator.policies.triggers import GpuHealthTrigger, GpuState

READY_FOR_RESET = "ready_for_reset"
STATES = (GpuState.HEALTHY, GpuState.DRAINING, READY_FOR_RESET, GpuState.FAILED)
KIND = "gpu_health"


class GpuBook:
    def __init__(self, store: Any, emit: Callable[..., Any], hold: Callable[[str, int], None],
                 release: Callable[[str, int], None]) -> None:
        self.store, self.emit, self.hold, self.release = store, emit, hold, release

    def states(self) -> list[dict[str, Any]]:
        return sorted(self.store.all(KIND), key=lambda d: (d["node"], d["gpu"]))

    def update(self, ctx: Context, rules: GpuHealthTrigger) -> None:
        used = {(w.get("node"), g) for w in ctx.workers for g in (w.get("gpu_ids") or [])}
        known = {(d["node"], d["gpu"]) for d in self.store.all(KIND)}
        for node, report in sorted(ctx.health.items()):
            if report.get("error"):  # the agent did not answer: nothing learnt
                continue
            seen = set()
            room = float(ctx.nodes.get(node, {}).get("gpus_free") or 0) >= 1  # else a hold would wait
            for gpu in report.get("gpus") or []:
                idx = int(gpu["index"])
                seen.add(idx)
                state, why = rules.classify(gpu)
                if state == GpuState.DRAINING and (node, idx) not in used:
                    state, why = READY_FOR_RESET, why or "drained"
                self._set(node, idx, state, why, ctx.now, busy=(node, idx) in used or not room)
            for n, idx in sorted(known):  # no longer reported as unhealthy (the NVML stand-in removed)
                if n == node and idx not in seen:
                    self._set(node, idx, GpuState.HEALTHY, "", ctx.now, busy=(node, idx) in used)

    def _set(self, node: str, gpu: int, state: str, why: str, now: float, busy: bool) -> None:
        key = f"{node}/{gpu}"
        old = self.store.get(KIND, key) or {"state": GpuState.HEALTHY, "held": False}
        held = bool(old.get("held"))
        if state != GpuState.HEALTHY and not busy and not held:
            held = self._try(self.hold, node, gpu)
        elif state == GpuState.HEALTHY and held:
            held = not self._try(self.release, node, gpu)
        if state == old["state"] and held == old.get("held"):
            return
        if state == GpuState.HEALTHY and not held:
            self.store.delete(KIND, key)
        else:
            since = old.get("since", now) if state == old["state"] else now
            self.store.put(KIND, key, {"node": node, "gpu": gpu, "state": state, "why": why, "since": since,
                                       "held": held})
        if state != old["state"]:
            self.emit("gpu_health", node=node, gpu=gpu, **{"from": old["state"], "to": state}, why=why)

    def release_all(self) -> None:
        """Every withheld GPU's reservation freed (the controller's shutdown); states kept."""
        for d in self.states():
            if d.get("held") and self._try(self.release, d["node"], d["gpu"]):
                self.store.put(KIND, f"{d['node']}/{d['gpu']}", {**d, "held": False})

    @staticmethod
    def _try(fn: Callable[[str, int], None], node: str, gpu: int) -> bool:
        try:
            fn(node, gpu)
            return True
        except Exception:  # noqa: BLE001 - no free GPU to hold yet: tried again next round
            return False
