"""Engine adapters: everything engine-specific (vLLM, SGLang) lives here, one package each."""

from adapters.base import Engine, EngineAdapter, EngineFingerprint, LaunchSpec, get_adapter, register

__all__ = ["Engine", "EngineAdapter", "EngineFingerprint", "LaunchSpec", "get_adapter", "register"]
