"""SGLang's OpenAI server, as the router continues its streams.

`/v1/completions` with `"return_token_ids": true` streams each chunk's new `token_ids` and, in
the first chunk, `prompt_token_ids`; without it the keys are absent (vLLM writes `null`), so
`strip` deletes them. A continuation is a completions request whose prompt is the ids (prompt +
sent): token-exact, the prefix served from the radix cache (docs/sglang.md). Not continued:
chat (SGLang's chat stream refuses `return_token_ids`, so the ids sent are unknown) and requests
with stop strings (SGLang matches them in its scheduler on a decoded tail that a continuation
would not see); a break of such a stream ends it with an explicit error event."""

from __future__ import annotations

import re
from typing import Any

from adapters.codec import ContinuationCodec, Delta, Kind


class Codec(ContinuationCodec):
    name = "sglang"
    _IDS = re.compile(rb'"(prompt_token_ids|token_ids)":\[([0-9,\s]*)\]')
    _STRIP = re.compile(rb',"(?:prompt_token_ids|token_ids)":\[[0-9,\s]*\]')

    def unsupported_reason(self, kind: Kind, body: dict) -> str | None:
        if kind == "chat":
            return "chat on SGLang (its chat stream carries no token ids)"
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

    def client_wants_token_ids(self, body: dict) -> bool:
        return body.get("return_token_ids") is True

    def ask_for_token_ids(self, raw: bytes) -> bytes:
        end = raw.rstrip().rfind(b"}")
        return raw[:end] + b',"return_token_ids":true}'

    def scan(self, events: bytes) -> tuple[bytes | None, list[bytes]]:
        prompt = None
        out: list[bytes] = []
        for m in self._IDS.finditer(events):
            if m.group(1) == b"token_ids":
                out.append(m.group(2))
            else:
                prompt = m.group(2)
        return prompt, out

    def strip(self, events: bytes) -> bytes:
        return self._STRIP.sub(b"", events)

    def continuation_request(self, kind: Kind, body: dict, prompt_ids: list[int],
                             sent_ids: list[int], *, text_by_router: bool = False
                             ) -> tuple[str, dict]:
        req = dict(body)
        for k in ("echo", "suffix", "messages"):
            req.pop(k, None)
        if text_by_router:
            req.pop("stop", None)
        req["prompt"] = list(prompt_ids) + list(sent_ids)
        req["stream"] = True
        req["return_token_ids"] = True
        n = len(sent_ids)
        if req.get("max_tokens") is not None:
            req["max_tokens"] = max(1, int(req["max_tokens"]) - n)
        if req.get("min_tokens"):
            req["min_tokens"] = max(0, int(req["min_tokens"]) - n)
        return "/v1/completions", req

    def parse_chunk(self, obj: dict) -> Delta:
        if "error" in obj and "choices" not in obj:
            return Delta(error=obj)
        choices = obj.get("choices") or []
        usage = obj.get("usage")
        if not choices:
            return Delta(usage=usage, usage_only=True)
        c = choices[0]
        return Delta(text=c.get("text") or "", token_ids=list(c.get("token_ids") or ()),
                     finish_reason=c.get("finish_reason"), stop_reason=c.get("matched_stop"),
                     logprobs=c.get("logprobs"), usage=usage)

    def output_text(self, tokenizer: Any, prompt_ids: list[int], body: dict) -> Any | None:
        from adapters.sglang.outtext import OutputText

        return OutputText(tokenizer, prompt_ids, body)
