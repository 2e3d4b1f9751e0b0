"""Whole-instance snapshots of a cell: `dump(cell) -> Image`, `restore(image, target) -> Cell`.

The names below are loaded on first use, so that `relocator.snapshot.criu` (the post-copy
keeper, a process of its own on the blackout's path) does not pay for the engines' imports."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Fingerprint": "fingerprint", "Mismatch": "fingerprint",
    "ImageError": "manifest", "Manifest": "manifest",
    **{name: "snapshot" for name in (
        "Image", "IncompatibleImage", "RestoreTarget", "SnapshotError", "VerifyMode", "compatibility_report",
        "dump", "dump_lazy", "inspect_image", "restore", "resume_source", "source_frozen")},
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(f"relocator.snapshot.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'relocator.snapshot' has no attribute {name!r}")
