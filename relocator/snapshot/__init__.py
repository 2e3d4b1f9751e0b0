"""Whole-instance snapshots of a cell: `dump(cell) -> Image`, `restore(image, target) -> Cell`."""

from relocator.snapshot.fingerprint import Fingerprint, Mismatch
from relocator.snapshot.manifest import ImageError, Manifest
from relocator.snapshot.snapshot import (
    Image,
    IncompatibleImage,
    RestoreTarget,
    SnapshotError,
    VerifyMode,
    compatibility_report,
    dump,
    inspect_image,
    restore,
    resume_source,
)

__all__ = [
    "Fingerprint", "Image", "ImageError", "IncompatibleImage", "Manifest", "Mismatch",
    "RestoreTarget", "SnapshotError", "VerifyMode", "compatibility_report", "dump", "inspect_image", "restore", "resume_source",
]
