"""The router's continuation of the reference engine's streams: vLLM's codec, unchanged. The
server frames its streams as vLLM 0.32 does (`return_token_ids`, `prompt_token_ids`) and makes
its text with vLLM's `OutputText`, so the router's replayed text is the engine's by
construction."""

from __future__ import annotations

from adapters.vllm.codec import Codec as VLLMCodec


class Codec(VLLMCodec):
    name = "reference"
