"""Where a move's listening agent expects its peer to connect from: the other node's transfer
address (its agent's `transfer_info`). The TLS front then closes, before TLS and without a
pending slot, every connection from any other address (relocator.agent.front), so a flood from
elsewhere cannot push the real peer out. Cached a while per node: DUMP is in the blackout."""

from __future__ import annotations

import time
from typing import Any

#: how long a node's address is taken as known (a host that changed address is asked again then)
TTL_S = 300.0

_cache: dict[str, tuple[float, str]] = {}


def peer_address(backend: Any, node: str) -> str:
    """`node`'s transfer address, or "" when its agent does not say (the front then admits any
    address, as before: the per-move certificate still decides)."""
    hit = _cache.get(node)
    now = time.monotonic()
    if hit is not None and now - hit[0] < TTL_S:
        return hit[1]
    ask = getattr(backend, "transfer_info", None)
    if ask is None:
        return ""
    try:
        address = str((ask(node) or {}).get("address") or "")
    except Exception:  # noqa: BLE001 - no pinning is the old behaviour, not a failed move
        return ""
    if address:
        _cache[node] = (now, address)
    return address


def forget(node: str) -> None:
    """A move with `node` failed: ask its address again next time (it may have changed)."""
    _cache.pop(node, None)


def address_kw(backend: Any, node: str) -> dict[str, str]:
    """{"peer_address": ...} for an agent call, {} when unknown (callers that predate it)."""
    address = peer_address(backend, node)
    return {"peer_address": address} if address else {}
