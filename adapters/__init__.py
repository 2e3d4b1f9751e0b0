"""Engine adapters: everything engine-specific (vLLM, SGLang) lives here, one package each,
named in one registry (`adapters.base.ENGINES`)."""

from adapters.base import (DEFAULT_ENGINE, ENGINES, Engine, EngineAdapter, EngineFingerprint,
                           LaunchSpec, engine_names, get_adapter, get_codec)

__all__ = ["DEFAULT_ENGINE", "ENGINES", "Engine", "EngineAdapter", "EngineFingerprint",
           "LaunchSpec", "engine_names", "get_adapter", "get_codec"]
