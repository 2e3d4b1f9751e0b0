"""Post-copy: the worker runs on the target before its memory has arrived.

Source: `criu dump --lazy-pages` writes every image but the worker's anonymous memory, then
keeps the tree frozen and serves that memory from a page server (`LazySource`). Target:
`criu restore --lazy-pages` starts the tree at once with that memory registered with
userfaultfd; the `criu lazy-pages` daemon fills it from the source, a faulting page first and
everything else in the background (`Keeper`).

The daemon does not talk to the source directly but through the **keeper**, a small process of
its own (it outlives the agent that started it) that relays the page-server protocol, counts
what arrives, and owns the one dangerous moment of post-copy: when the source stops answering,
the daemon would give up and the kernel would hand the worker zero-filled pages instead of its
memory. The keeper kills the target's tree first (SIGKILL to its PID-namespace init) and only
then lets the daemon go, so a worker whose memory cannot arrive never runs on without it. The
same holds for a stall: requests outstanding and nothing from the source for `stall_s` (a
network cut). The controller then rolls back (source alive) or replaces the worker (source
lost), see docs/snapshots.md "Post-copy".

The keeper records its progress in `<cell dir>/postcopy.json` (state: starting, ready,
running, done, failed; pages bytes; why it failed), which the agent reads.

The parts, by role: `base` (the wire format, state files and the stdlib-only helpers the keeper
and the pump share), `proxy` (the page-server proxy's protocol state), `keeper` (the process;
`python -m relocator.agent.postcopy` runs it), `target` (what the target agent starts and stops)
and `source` (the source agent's lazy dump). The names below are loaded on first use: the keeper
runs under `python -S` and must not load the agent's side (psutil, tenacity).
"""

from __future__ import annotations

import importlib
from typing import Any

_PARTS = {
    "base": ("STATE_FILE", "PAGE_SIZE", "PSI", "PS_IOV_GET", "PS_IOV_CLOSE", "PS_IOV_FORCE_CLOSE", "PS_CMD_MASK",
             "FRAME", "PRIORITY", "PostCopyFailed", "write_state", "read_state", "alive", "is_ours",
             "raise_priority", "lazy_ranges", "connect", "recv_some", "pending"),
    "proxy": ("Proxy",),
    "keeper": ("Keeper", "main"),
    "target": ("TargetSession", "prefill_mb", "stop_keeper"),
    "source": ("LazySource", "knock", "is_dump"),
}
_WHERE = {name: part for part, names in _PARTS.items() for name in names}
# the names the tree and its tests knew before the split (private then)
_OLD = {"_Proxy": "Proxy", "_alive": "alive", "_is_ours": "is_ours", "_raise_priority": "raise_priority",
        "_lazy_ranges": "lazy_ranges", "_connect": "connect", "_recv_some": "recv_some", "_pending": "pending",
        "_knock": "knock", "_is_dump": "is_dump"}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    real = _OLD.get(name, name)
    if real not in _WHERE:
        raise AttributeError(f"module 'relocator.agent.postcopy' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[real]}"), real)
    globals()[name] = value
    return value
