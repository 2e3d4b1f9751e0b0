"""The interface an engine adapter implements, and a registry of adapters by name.

The rest of relocator talks to engines only through this interface: how to launch one so that
CRIU can dump it, how to tell it is healthy, what its metrics mean, how to continue a request
from token ids, and the engine part of a snapshot's fingerprint.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel

from relocator.choices import registry_choice


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


class EngineAdapter(abc.ABC):
    name: str

    @abc.abstractmethod
    def command(self, spec: LaunchSpec) -> tuple[list[str], dict[str, str]]:
        """argv and extra environment that start the engine's OpenAI server, CRIU-friendly."""

    @abc.abstractmethod
    def fingerprint(self, spec: LaunchSpec) -> EngineFingerprint:
        """The engine part of a snapshot fingerprint for a worker launched from `spec`."""

    @abc.abstractmethod
    async def is_ready(self, base_url: str, timeout: float = 2.0) -> bool:
        """True once the server answers health checks and lists its model."""

    @abc.abstractmethod
    def parse_metrics(self, text: str) -> dict[str, float]:
        """Engine metrics from a Prometheus text page, as name -> value (summed over labels)."""

    @abc.abstractmethod
    def continuation_request(
        self, body: dict[str, Any], prompt_ids: list[int], sent_ids: list[int]
    ) -> dict[str, Any]:
        """A completions request body that continues `body` after `sent_ids` were produced."""


_REGISTRY: dict[str, Callable[[], EngineAdapter]] = {}


def register(name: str) -> Callable[[Callable[[], EngineAdapter]], Callable[[], EngineAdapter]]:
    def deco(factory: Callable[[], EngineAdapter]) -> Callable[[], EngineAdapter]:
        _REGISTRY[name] = factory
        return factory

    return deco


def get_adapter(name: str) -> EngineAdapter:
    if name not in _REGISTRY:
        import importlib

        try:
            importlib.import_module(f"adapters.{name}")
        except ModuleNotFoundError:
            pass
    if name not in _REGISTRY:
        raise KeyError(f"unknown engine {name!r}; known: {', '.join(sorted(_REGISTRY)) or 'none'}")
    return _REGISTRY[name]()


def engine_names() -> list[str]:
    """The engines with an adapter package next to this module (each registers when imported)."""
    import pkgutil

    return sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)]) if m.ispkg)


#: the engines a worker can run, as a typed choice (`relocator cell launch --engine`)
Engine = registry_choice("Engine", engine_names(), __name__)
