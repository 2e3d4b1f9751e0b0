"""`free_port`: the one way the tree picks a TCP port (low level: imports nothing of ours)."""

from __future__ import annotations

import socket


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on `address` now (whoever asked binds it a moment later)."""
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
        s.bind((address, 0))
        return s.getsockname()[1]
