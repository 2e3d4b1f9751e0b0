"""Each GPU's health state as the controller keeps it (store kind `gpu_health`): healthy,
draining (no new placement; its worker is moved), ready_for_reset (drained: nothing runs on it)
or failed (its worker is replaced). A GPU that is not healthy and runs nothing is held by a
one-GPU reservation, so nothing new is placed on it; it is released when the GPU reads healthy
again (after its reset). Transitions are events (`gpu_health`).

On fake GPUs (the agent's NVML stand-in: Ray's GPU indexes are counts, not devices) a hold is
by count: Ray picks which index it reserves (`held_as`), so a GPU once held stays held, and
counts as covered, even when Ray later gives its index to a new worker; no policy acts on a
covered GPU (`visible` drops it from the reports), so that worker is not moved off it."""

from __future__ import annotations

from typing import Any, Callable

from relocator.policies.base import Context
from relocator.policies.triggers import GpuHealthTrigger, GpuState

READY_FOR_RESET = "ready_for_reset"
STATES = (GpuState.HEALTHY, GpuState.DRAINING, READY_FOR_RESET, GpuState.FAILED)
KIND = "gpu_health"


class GpuBook:
    def __init__(self, store: Any, emit: Callable[..., Any], hold: Callable[[str, int], Any],
                 release: Callable[[str, int], Any]) -> None:
        self.store, self.emit, self.hold, self.release = store, emit, hold, release

    def states(self) -> list[dict[str, Any]]:
        return sorted(self.store.all(KIND), key=lambda d: (d["node"], d["gpu"]))

    def update(self, ctx: Context, rules: GpuHealthTrigger) -> None:
        used = {(w.get("node"), g) for w in ctx.workers for g in (w.get("gpu_ids") or [])}
        known = {(d["node"], d["gpu"]): d for d in self.store.all(KIND)}
        for node, report in sorted(ctx.health.items()):
            if report.get("error"):  # the agent did not answer: nothing learnt
                continue
            seen = set()
            fake = report.get("nvml") == "fake"
            room = [int(float(ctx.nodes.get(node, {}).get("gpus_free") or 0))]  # GPUs left to hold
            for gpu in report.get("gpus") or []:
                idx = int(gpu["index"])
                seen.add(idx)
                state, why = rules.classify(gpu)
                covered = fake and state != GpuState.HEALTHY and bool(known.get((node, idx), {}).get("held"))
                if state == GpuState.DRAINING and ((node, idx) not in used or covered):
                    state, why = READY_FOR_RESET, why or "drained"
                self._set(node, idx, state, why, ctx.now, busy=(node, idx) in used and not covered, room=room)
            for n, idx in sorted(known):  # no longer reported as unhealthy (the NVML stand-in removed)
                if n == node and idx not in seen:
                    self._set(node, idx, GpuState.HEALTHY, "", ctx.now, busy=(node, idx) in used, room=room)

    def covered(self) -> set[tuple[str, int]]:
        """Held GPUs (node, index): nothing is placed on them, so no policy acts on them (on fake
        GPUs a worker Ray put on a held GPU's index is not on that GPU: the hold is by count)."""
        return {(d["node"], d["gpu"]) for d in self.store.all(KIND) if d.get("held")}

    def visible(self, health: dict[str, dict]) -> dict[str, dict]:
        """The agents' reports without the GPUs held on fake GPUs (what the triggers read)."""
        held = self.covered()
        out = {}
        for node, report in health.items():
            if report.get("nvml") == "fake" and any(n == node for n, _ in held):
                report = {**report, "gpus": [g for g in report.get("gpus") or [] if (node, int(g["index"])) not in held]}
            out[node] = report
        return out

    def _set(self, node: str, gpu: int, state: str, why: str, now: float, busy: bool,
             room: list[int] | None = None) -> None:
        key = f"{node}/{gpu}"
        old = self.store.get(KIND, key) or {"state": GpuState.HEALTHY, "held": False}
        held, held_as = bool(old.get("held")), old.get("held_as")
        if state != GpuState.HEALTHY and not busy and not held and (room is None or room[0] >= 1):
            got = self._try(self.hold, node, gpu)
            held = got is not None
            if held:
                held_as = got if isinstance(got, list) else None
                if room is not None:
                    room[0] -= 1  # by count: N unhealthy idle GPUs take N of the node's free ones
        elif state == GpuState.HEALTHY and held:
            held = self._try(self.release, node, gpu) is None
            held_as = held_as if held else None
        if state == old["state"] and held == old.get("held"):
            return
        if state == GpuState.HEALTHY and not held:
            self.store.delete(KIND, key)
        else:
            since = old.get("since", now) if state == old["state"] else now
            self.store.put(KIND, key, {"node": node, "gpu": gpu, "state": state, "why": why, "since": since,
                                       "held": held, "held_as": held_as})
        if state != old["state"]:
            self.emit("gpu_health", node=node, gpu=gpu, **{"from": old["state"], "to": state}, why=why)

    def release_all(self) -> None:
        """Every withheld GPU's reservation freed (the controller's shutdown); states kept."""
        for d in self.states():
            if d.get("held") and self._try(self.release, d["node"], d["gpu"]) is not None:
                self.store.put(KIND, f"{d['node']}/{d['gpu']}", {**d, "held": False})

    @staticmethod
    def _try(fn: Callable[[str, int], Any], node: str, gpu: int) -> Any:
        """What `fn` returned ([] for None: a hold's GPU ids, when known), None if it failed."""
        try:
            got = fn(node, gpu)
            return [] if got is None else got
        except Exception:  # noqa: BLE001 - no free GPU to hold yet: tried again next round
            return None
