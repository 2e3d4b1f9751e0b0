"""The registry of transfer modes: one strategy per `TransferMode` (relocator.controller.transfers
.base), and `auto` resolved here. A new mode is its strategy module, its agent side
(relocator.agent.modes) and one line in STRATEGIES (docs/architecture.md, "Adding a transfer mode")."""

from __future__ import annotations

from typing import Any

from relocator.controller.errors import RelocationError
from relocator.controller.model import WorkerRecord
from relocator.controller.transfers.base import Context, TransferStrategy
from relocator.controller.transfers.postcopy import PostcopyTransfer, postcopy_problems
from relocator.controller.transfers.shared import SharedTransfer
from relocator.controller.transfers.stream import StreamTransfer
from relocator.vocab import TransferMode

#: every mode but `auto`, in the order `auto` tries them (the first possible one wins)
STRATEGIES: dict[TransferMode, TransferStrategy] = {s.mode: s for s in (
    SharedTransfer(),
    PostcopyTransfer(),
    StreamTransfer(),
)}

#: the agent calls of every mode, for the Ray backend (RayBackend inherits them)
MODE_CALLS: tuple[type, ...] = tuple(s.calls for s in STRATEGIES.values() if s.calls is not None)


def strategy(mode: TransferMode | str) -> TransferStrategy:
    """The strategy of a resolved mode (`auto` is resolved by `choose` first)."""
    found = STRATEGIES.get(TransferMode(mode))
    if found is None:
        raise RelocationError(f"transfer mode {mode} has no implementation (auto is resolved at PLAN)")
    return found


def choose(backend: Any, worker: WorkerRecord, dst: str, requested: TransferMode | str) -> tuple[TransferStrategy, str]:
    """The strategy for a move of `worker` to `dst` and why: `auto` takes the first mode of
    STRATEGIES that is possible (shared when both see the image store, postcopy when both nodes'
    kernels and CRIU allow it, else stream); an explicit mode that cannot run is refused
    (PlanError) before anything moves."""
    requested = TransferMode(requested)
    if requested is not TransferMode.AUTO:
        chosen = strategy(requested)
        chosen.check(backend, worker, dst)
        return chosen, ""
    why: list[str] = []
    for candidate in STRATEGIES.values():
        ok, reason = candidate.available(backend, worker, dst)
        why.append(reason)
        if ok:
            return candidate, "; ".join(w for w in why if w)
    raise RelocationError("no transfer mode can move the worker")  # pragma: no cover - stream always can


__all__ = ["Context", "MODE_CALLS", "STRATEGIES", "TransferStrategy", "choose", "postcopy_problems", "strategy"]
