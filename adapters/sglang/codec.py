"""SGLang's OpenAI server, as the router continues its streams.

`/v1/completions` with `"return_token_ids": true` streams each chunk's new `token_ids` and, in
the first chunk, `prompt_token_ids`; without it the keys are absent (vLLM writes `null`), so
`strip` deletes them. A continuation is a completions request whose prompt is the ids (prompt +
sent): token-exact, the prefix served from the radix cache (docs/sglang.md).

Chat: SGLang's chat stream refuses `return_token_ids` (its `sglext` output ids come only at the
end), so the ids sent would be unknown at a break. A chat stream is therefore sent as a
continuation from its first token (`translates`): the prompt ids are SGLang's own rendering of
the messages (`/v1/tokenize` with `messages` runs the chat endpoint's message processing and
template), the request is a completions request on those ids, and the router frames every
chunk as a chat chunk with text made by SGLang's algorithm (`outtext`); `return_token_ids`,
which SGLang's chat stream refuses, is then served by the router (ids in each chunk, as vLLM
does). Not continued (sent
natively; a break ends the stream with an explicit error event): requests with stop strings
(SGLang matches them in its scheduler on a decoded tail that a continuation would not see),
chat with tools, structured output or logprobs."""

from __future__ import annotations

import re
from typing import Any

from adapters.codec import ContinuationCodec, Kind, completions_continuation


class Codec(ContinuationCodec):
    name = "sglang"
    stop_reason_field = "matched_stop"
    _STRIP = re.compile(rb',"(?:prompt_token_ids|token_ids)":\[[0-9,\s]*\]')

    def unsupported_reason(self, kind: Kind, body: dict) -> str | None:
        if kind == "chat":
            for k in ("tools", "tool_choice", "functions", "function_call", "logprobs", "top_logprobs",
                      "return_prompt_token_ids", "continue_final_message"):
                if body.get(k):
                    return f"{k} in a chat request on SGLang"
        if (body.get("n") or 1) != 1 or (body.get("best_of") or 1) != 1:
            return "n > 1 / best_of > 1"
        p = body.get("prompt")
        if isinstance(p, list) and p and not isinstance(p[0], int):
            return "several prompts in one request"
        if body.get("stop") or body.get("stop_regex"):
            return "stop strings on SGLang"
        if body.get("echo") or body.get("suffix") or body.get("logprobs") is not None:
            return "echo, suffix or logprobs on SGLang"
        for k in ("response_format", "json_schema", "regex", "ebnf"):
            if body.get(k):
                return f"structured output ({k})"
        return None

    def strip(self, events: bytes) -> bytes:
        return self._STRIP.sub(b"", events)

    def continuation_request(self, kind: Kind, body: dict, prompt_ids: list[int],
                             sent_ids: list[int], *, text_by_router: bool = False
                             ) -> tuple[str, dict]:
        return "/v1/completions", completions_continuation(kind, body, prompt_ids, sent_ids, text_by_router,
                                                           drop=("echo", "suffix"))

    def translates(self, kind: Kind, body: dict) -> bool:
        return kind == "chat" and self.unsupported_reason(kind, body) is None

    def prompt_ids_request(self, kind: Kind, body: dict) -> tuple[str, dict] | None:
        if kind != "chat":
            return None
        req = {"model": body.get("model"), "messages": body.get("messages")}
        for k in ("chat_template_kwargs", "reasoning_effort"):  # what the chat template sees
            if body.get(k) is not None:
                req[k] = body[k]
        return "/v1/tokenize", req

    def parse_prompt_ids(self, obj: dict) -> list[int]:
        ids = obj.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise ValueError(f"/v1/tokenize answered without token ids: {str(obj)[:200]}")
        return ids

    def prefill_request(self, model: str, ids: list[int]) -> tuple[str, dict]:
        # the native route: input_ids as they are, and meta_info.cached_tokens (the radix
        # cache's hit) in every answer, --enable-cache-report or not (docs/sglang.md (b))
        return "/generate", {"input_ids": list(ids), "stream": False,
                             "sampling_params": {"max_new_tokens": 1, "temperature": 0}}

    def prefill_cached_tokens(self, obj: Any) -> int:
        try:
            return int((obj.get("meta_info") or {}).get("cached_tokens") or 0)
        except (AttributeError, TypeError, ValueError):
            return 0

    def output_text(self, tokenizer: Any, prompt_ids: list[int], body: dict) -> Any | None:
        from adapters.sglang.outtext import OutputText

        return OutputText(tokenizer, prompt_ids, body)
