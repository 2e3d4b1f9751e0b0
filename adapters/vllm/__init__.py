"""vLLM engine adapter (real vLLM; the CPU build on the reference machines)."""

from adapters.vllm.adapter import VllmAdapter

__all__ = ["VllmAdapter"]
