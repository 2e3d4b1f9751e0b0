"""The key of a warm image: what makes two ready, idle workers interchangeable.

A warm image is a worker captured ready and before it served, so any worker of the same kind
can start from it. Its kind is the engine and its version, the model and its weights' hash,
the device profile it holds (GPU count and models) and the parts of the host fingerprint the
restore gate compares, plus the launch record minus what is per instance (where it listens).
The key is the sha256 of that, canonical JSON: equal kinds give equal keys on every node, and
an image filed under a key can be checked against it (`key_of_manifest`).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from adapters.base import EngineFingerprint
from relocator.cell.devices import DeviceProfile
from relocator.snapshot import criu
from relocator.snapshot.fingerprint import Fingerprint
from relocator.snapshot.manifest import Manifest

#: launch fields that differ between instances of one kind: a restored copy listens where its
#: image did, in a network namespace of its own, so they do not make another kind
PER_INSTANCE = ("host", "port")
_KEY = re.compile(r"^[a-z0-9][a-z0-9._-]{0,80}-[0-9a-f]{32}$")


class WarmKind(EngineFingerprint):
    """What a warm image's key is computed from (kept beside the image, readable): the engine's
    fingerprint and the device and host facts the restore gate compares."""

    gpu_count: int
    gpu_models: list[str]
    host_arch: str
    host_cpu_model: str
    host_gpu_driver: str | None
    host_cuda: str | None
    criu_series: str  # major.minor: the gate accepts a newer patch release
    launch_sha256: str


def launch_digest(launch: dict[str, Any]) -> str:
    kept = {k: v for k, v in launch.items() if k not in PER_INSTANCE and k != "devices"}
    # fake GPUs (Ray's counts on a CPU host) reach a worker only as this variable: which ones
    # a worker holds is its reservation's, not its kind (real GPUs are in `devices`)
    env = {k: v for k, v in (kept.get("env") or {}).items() if k != "CUDA_VISIBLE_DEVICES"}
    if "env" in kept:
        kept["env"] = env
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def kind_of(fingerprint: Fingerprint, launch: dict[str, Any], devices: dict[str, Any] | None) -> WarmKind:
    """The kind of a worker launched from `launch`, holding `devices`, fingerprinted here."""
    engine, host = fingerprint.engine, fingerprint.host
    profile = DeviceProfile.from_dict(devices)
    return WarmKind(
        **engine.model_dump(),
        gpu_count=len(profile.gpus), gpu_models=[g.model for g in profile.gpus],
        host_arch=host.arch, host_cpu_model=host.cpu_model, host_gpu_driver=host.gpu.driver_version,
        host_cuda=host.gpu.cuda_version,
        criu_series=".".join(str(x) for x in criu.version_tuple(host.criu_version)[:2]),
        launch_sha256=launch_digest(launch),
    )


def key_of(kind: WarmKind) -> str:
    """`<engine>-<engine version>-<32 hex>`: readable in listings, the hex makes it unique."""
    body = json.dumps(kind.model_dump(), sort_keys=True, separators=(",", ":")).encode()
    prefix = re.sub(r"[^a-z0-9._-]+", "_", f"{kind.engine}-{kind.engine_version}".lower())[:60]
    return f"{prefix}-{hashlib.sha256(body).hexdigest()[:32]}"


def key_of_manifest(manifest: Manifest) -> str:
    """The key the image described by `manifest` belongs under."""
    return key_of(kind_of(manifest.fingerprint, manifest.cell.launch, manifest.cell.devices))


def is_key(text: str) -> bool:
    """A well-formed key (also a safe directory name: no slash, no dot-dot)."""
    return bool(_KEY.match(text)) and ".." not in text
