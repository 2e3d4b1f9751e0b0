"""Where relocator keeps its state on a node. Overridable for tests and multiple nodes."""

from __future__ import annotations

import os
from pathlib import Path


def state_dir() -> Path:
    """Per-machine runtime state (cells, network blocks). Survives agent restarts."""
    return Path(os.environ.get("RELOCATOR_STATE_DIR", "/run/relocator"))


def images_dir() -> Path:
    return Path(os.environ.get("RELOCATOR_IMAGES_DIR", "/var/lib/relocator/images"))


def net_dir() -> Path:
    """Machine-wide registry of network blocks: shared by every emulated node on one host."""
    return Path(os.environ.get("RELOCATOR_NET_DIR", "/run/relocator/net"))


def tail(path: Path, lines: int = 40) -> str:
    """The last `lines` lines of a log file, or why it cannot be read."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(log unavailable: {exc})"
