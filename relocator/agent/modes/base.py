"""What every mode's agent ops share: where this node's transfers listen, and the agent's
state they use (NodeAgent's per-cell lock, its page servers and lazy dumps in progress)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any


def transfer_address() -> str:
    """Where this node's page servers listen and its peers connect: RELOCATOR_TRANSFER_ADDRESS,
    else Ray's address of this node (127.0.0.1 on the local cluster, a host's own address on
    emulated or real hosts), else loopback. Every transfer (and PLAN's transfer_info) asks it:
    the bench's plaintext switch is refused here on any other network (CredentialsError)."""
    from relocator.credentials import check_bench_plaintext

    addr = _address()
    check_bench_plaintext(addr)
    return addr


def _address() -> str:
    addr = os.environ.get("RELOCATOR_TRANSFER_ADDRESS")
    if addr:
        return addr
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001
        pass
    return "127.0.0.1"


#: every mode's ops class, registered by its definition (ModeBase.__init_subclass__)
OPS: list[type] = []


class ModeBase:
    """The parts of NodeAgent the mode ops use (NodeAgent inherits every mode's ops). A
    subclass defined in a module of this package is one mode's ops: it registers itself (OPS)."""

    images_dir: Path
    _receivers: dict[str, Any]  # stream: page servers by target image directory
    _lazy_dumps: dict[str, Any]  # postcopy: lazy dumps (their CRIU process) by cell

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if cls.__module__.startswith("relocator.agent.modes."):
            OPS.append(cls)

    def _lock(self, cell_id: str) -> threading.Lock:  # NodeAgent's per-cell lock
        raise NotImplementedError


__all__ = ["ModeBase", "OPS", "transfer_address"]
