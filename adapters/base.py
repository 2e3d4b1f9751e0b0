"""The interface an engine adapter implements, and the one registry of engines.

The rest of relocator talks to engines only through this interface: how to launch one inside
a cell so that CRIU can dump it, how to tell it is healthy, what its metrics mean, how to
continue its streams from token ids (its codec, used by the router), the engine part of a
snapshot's fingerprint, and what marks its processes (the leak check). Adding an engine: a
package adapters/NAME/ with `adapter.py` (class `Adapter`) and `codec.py` (class `Codec`),
and one line in `ENGINES`.
"""

from __future__ import annotations

import abc
import hashlib
import importlib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel

from relocator.choices import registry_choice

if TYPE_CHECKING:
    from adapters.codec import ContinuationCodec

#: THE registry: engine name -> its package. Nothing outside adapters/ names an engine.
ENGINES: dict[str, str] = {
    "vllm": "adapters.vllm",
    "sglang": "adapters.sglang",
    "reference": "adapters.reference",
}
#: the engine used where none is named (a worker, a cell, a router replica)
DEFAULT_ENGINE = "vllm"


class EngineFingerprint(BaseModel):
    """What must match between a snapshot and the place it is restored to, engine side."""

    engine: str
    engine_version: str
    model_id: str
    weight_sha256: str
    dtype: str
    max_model_len: int
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1


@dataclass
class LaunchSpec:
    """How to start one worker: the model, where it listens, and engine options."""

    model_dir: Path
    served_model_name: str
    port: int = 8000
    host: str = "0.0.0.0"
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    tensor_parallel_size: int = 1
    # On the CPU build this is the share of *host* memory reserved for the KV cache.
    memory_fraction: float = 0.1
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    #: host folder for caches shared by the workers of a machine (compiled kernels); the
    #: engine keeps them out of the cell, whose tmpfs would carry them into every image
    cache_dir: str | None = None


@dataclass(frozen=True)
class EngineCall:
    """One HTTP call of an engine's own API (path relative to its endpoint, JSON body or none)."""

    method: str
    path: str
    body: dict | None = None


class EngineAdapter(abc.ABC):
    name: str
    #: the port the engine's server listens on inside its cell (own network namespace)
    default_port: int = 8000
    #: bytes that appear in the command line of this engine's processes (the leak check)
    process_markers: tuple[bytes, ...] = ()
    #: (python module, what installs it) the engine needs on this machine (preflight)
    requirements: tuple[tuple[str, str], ...] = ()

    @abc.abstractmethod
    def command(self, spec: LaunchSpec) -> tuple[list[str], dict[str, str]]:
        """argv and extra environment that start the engine's OpenAI server inside a cell,
        CRIU-friendly (the cell gives it TMPDIR=/run, a private /dev/shm, loopback)."""

    @abc.abstractmethod
    def engine_version(self) -> str:
        """The installed engine's version ("unknown" if it cannot be read)."""

    def compute_dtype(self, spec: LaunchSpec) -> str:
        """The dtype the engine computes in for `spec` (a fingerprint field)."""
        return spec.dtype

    def fingerprint(self, spec: LaunchSpec) -> EngineFingerprint:
        """The engine part of a snapshot fingerprint for a worker launched from `spec`."""
        return EngineFingerprint(
            engine=self.name,
            engine_version=self.engine_version(),
            model_id=spec.served_model_name,
            weight_sha256=weight_hash(str(spec.model_dir)),
            dtype=self.compute_dtype(spec),
            max_model_len=spec.max_model_len,
            tensor_parallel_size=spec.tensor_parallel_size,
        )

    async def is_ready(self, base_url: str, timeout: float = 2.0) -> bool:
        """True once the server answers health checks and lists its model (every engine here
        serves the OpenAI API)."""
        from adapters import openai_server  # an HTTP client: not for the router's light imports

        return await openai_server.is_ready(base_url, timeout)

    def parse_metrics(self, text: str) -> dict[str, float]:
        """Engine metrics from a Prometheus text page, as name -> value (summed over labels):
        the families named "<engine name>:*"."""
        from adapters import openai_server

        return openai_server.parse_metrics(text, f"{self.name}:")

    def missing(self) -> str | None:
        """Why this engine cannot run on this machine (None: it can)."""
        import importlib.util

        for mod, what in self.requirements:
            if importlib.util.find_spec(mod) is None:
                return f"python module {mod} is missing (from {what})"
        return None

    def codec(self) -> "ContinuationCodec":
        """How the router continues this engine's streams."""
        return get_codec(self.name)

    def sleep_calls(self, launch: dict) -> tuple[EngineCall, EngineCall] | None:
        """(sleep, wake) for a GPU worker launched from `launch` (its LaunchSpec as data): the
        engine's own API that frees its KV pool before a warm capture's cuda-checkpoint, and
        takes it back once the image is restored (relocator/warm/sleep.py). None: it has none,
        and the image holds the pool."""
        return None


def _package(name: str) -> str:
    try:
        return ENGINES[name]
    except KeyError:
        raise KeyError(f"unknown engine {name!r}; known: {', '.join(sorted(ENGINES))}") from None


def get_adapter(name: str) -> EngineAdapter:
    return importlib.import_module(f"{_package(name)}.adapter").Adapter()


def get_codec(name: str) -> "ContinuationCodec":
    """The router's codec for engine `name` (light: no HTTP client, no engine import).
    "none": a codec that continues nothing."""
    if name == "none":
        from adapters.codec import ContinuationCodec

        return ContinuationCodec()
    return importlib.import_module(f"{_package(name)}.codec").Codec()


def engine_names() -> list[str]:
    return sorted(ENGINES)


def weights_sha256(model_dir: Path) -> str:
    """sha256 over a model's weight files (*.safetensors), in name order: the weight part of
    an engine fingerprint."""
    h = hashlib.sha256()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


@lru_cache(maxsize=16)
def weight_hash(model_dir: str) -> str:
    """`weights_sha256`, once per model folder and process (fingerprints ask it often)."""
    return weights_sha256(Path(model_dir))


#: the engines a worker can run, as a typed choice (`relocator cell launch --engine`)
Engine = registry_choice("Engine", engine_names(), __name__)
