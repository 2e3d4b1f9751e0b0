"""The registry of transfer modes: one strategy per `TransferMode` (relocator.controller.transfers
.base), and `auto` resolved here. Every module of this package is imported below and its
strategy registers itself by its `mode`: a new mode is its strategy module here, its agent side
(relocator.agent.modes) and its name in `TransferMode` (docs/architecture.md, "Adding a transfer
mode")."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from relocator.controller.errors import RelocationError
from relocator.controller.model import WorkerRecord
from relocator.controller.transfers.base import REGISTRY, Context, TransferStrategy
from relocator.vocab import TransferMode

for _m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    importlib.import_module(f"{__name__}.{_m.name}")  # each registers its strategy

from relocator.controller.transfers.postcopy import postcopy_problems  # noqa: E402 - registered above

#: every mode but `auto`; `auto` tries those with an `auto_rank`, lowest first (the first possible wins)
STRATEGIES: dict[TransferMode, TransferStrategy] = dict(REGISTRY)
AUTO_ORDER: tuple[TransferStrategy, ...] = tuple(sorted(
    (s for s in STRATEGIES.values() if s.auto_rank is not None), key=lambda s: s.auto_rank or 0))

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
    AUTO_ORDER that is possible (handoff where the target starts warm, shared when both see the
    image store, postcopy when both nodes' kernels and CRIU allow it, else stream); an explicit
    mode that cannot run is refused (PlanError) before anything moves."""
    requested = TransferMode(requested)
    if requested is not TransferMode.AUTO:
        chosen = strategy(requested)
        chosen.check(backend, worker, dst)
        return chosen, ""
    why: list[str] = []
    for candidate in AUTO_ORDER:
        ok, reason = candidate.available(backend, worker, dst)
        why.append(reason)
        if ok:
            why += [f"{s.mode.value} only on request: {s.auto_why}" for s in STRATEGIES.values()
                    if s.auto_rank is None and s.auto_why]
            return candidate, "; ".join(w for w in why if w)
    raise RelocationError("no transfer mode can move the worker")  # pragma: no cover - stream always can


__all__ = ["AUTO_ORDER", "Context", "MODE_CALLS", "STRATEGIES", "TransferStrategy", "choose", "postcopy_problems", "strategy"]
