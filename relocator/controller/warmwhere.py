"""Whether a start of a worker's kind on a node would be warm: what `auto` picks a handoff on
(relocator.controller.transfers.handoff; docs/handoff.md, "What auto does").

"here": the node's own store holds the kind's warm image (asked now, not from the warm copies'
last round: a stale answer would start a cold second copy); "near": a node on the same host held
it at the warm copies' last round and on-demand copies are on, so the start copies it locally
first; "": neither, or it cannot be known (then a freezing mode moves the worker, as before).
Narrow collaborators: `keys(node)` the node's warm keys (an agent call), `holders` {node: keys}
as the last round saw them, `hosts` {node: host}, the warm config."""

from __future__ import annotations

from typing import Any, Callable

from relocator.warm.config import WarmConfig


def warm_start(key: str | None, node: str, keys: Callable[[str], list[str]], holders: dict[str, set[str]],
               hosts: Callable[[], dict[str, str]], cfg: WarmConfig) -> dict[str, Any]:
    """{warm: "here" | "near" | "", from (near only), why}."""
    if not key:
        return {"warm": "", "why": "its kind is not known (no start of it since the controller started)"}
    if not cfg.enabled:
        return {"warm": "", "why": "warm images are off (warm.enabled)"}
    try:
        here = key in set(keys(node))
    except Exception as exc:  # noqa: BLE001 - unknown: not warm (a freezing mode is always possible)
        return {"warm": "", "why": f"{node} did not list its warm images ({type(exc).__name__}: {exc})"}
    if here:
        return {"warm": "here", "why": f"{node} holds a warm image of its kind ({key})"}
    if not cfg.prefetch.on_demand:
        return {"warm": "", "why": f"no warm image of its kind ({key}) on {node} "
                                   "(on-demand copies are off: warm.prefetch.on_demand)"}
    host = hosts()
    near = sorted(n for n, held in holders.items()
                  if n != node and key in held and host.get(n) is not None and host.get(n) == host.get(node))
    if near:
        return {"warm": "near", "from": near[0],
                "why": f"{near[0]}, on {node}'s host, holds a warm image of its kind ({key}): copied at the start"}
    return {"warm": "", "why": f"no warm image of its kind ({key}) on {node} or its host"}


__all__ = ["warm_start"]
