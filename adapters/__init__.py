"""Engine adapters: everything engine-specific (vLLM, SGLang) lives here, one package each."""

from adapters.base import EngineAdapter, EngineFingerprint, LaunchSpec, get_adapter, register

__all__ = ["EngineAdapter", "EngineFingerprint", "LaunchSpec", "get_adapter", "register"]
