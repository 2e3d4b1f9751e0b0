"""vLLM's OpenAI server, as the router continues its streams.

`"return_token_ids": true` makes every stream chunk carry `token_ids` (delta) and the first one
`prompt_token_ids` (inside the choice for completions, at the top level for chat); without it
vLLM still emits both keys as `null`, so replacing the arrays by `null` gives exactly the bytes
a client would have got directly. A chat request is continued as a completions request on the
prompt ids (the chat template was already applied); its logprobs are asked as completions
logprobs and rebuilt in the chat shape (`adapters.codec.chat_logprobs`). The text of a
continued stream is made from ids with vLLM's own text making, replayed (`outtext.OutputText`)."""

from __future__ import annotations

import re
from typing import Any

from adapters.codec import ContinuationCodec, Kind, completions_continuation

class Codec(ContinuationCodec):
    """vLLM >= 0.10.2 (`return_token_ids`)."""

    name = "vllm"
    _EMPTY_CHAT_DELTA = re.compile(
        rb'data: \{[^\n]*"delta":\{\},"logprobs":null,"finish_reason":null,'
        rb'"token_ids":null\}\][^\n]*\}\n\n')

    def unsupported_reason(self, kind: Kind, body: dict) -> str | None:
        # best_of is not a field of vLLM 0.32's completions or chat request (it is ignored,
        # with a warning): a request with it is generated, and continued, as one without
        if (body.get("n") or 1) != 1:
            return "n > 1"
        if body.get("use_beam_search"):
            return "beam search"
        if kind == "completions":
            p = body.get("prompt")
            if isinstance(p, list) and p and not isinstance(p[0], int):
                return "several prompts in one request"
            if body.get("suffix"):
                return "suffix"
            if body.get("echo"):
                # vLLM leaves the echoed prompt text out when token ids are asked for
                # (completion/serving.py: `if request.return_token_ids: prompt_text = ""`),
                # so tracking would change what the client reads: sent as it is
                return "echo"
        else:
            for k in ("tools", "response_format", "structured_outputs", "guided_json",
                      "guided_regex", "guided_choice", "guided_grammar"):
                if body.get(k):
                    return f"chat with {k}"
            if body.get("echo"):
                return "chat with echo"
        for k in ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                  "guided_grammar", "response_format"):
            if body.get(k):
                return f"structured output ({k})"
        return None

    def strip(self, events: bytes) -> bytes:
        s = self._IDS.sub(rb'"\1":null', events)
        if b'"delta":{},' in s:
            # chunks vLLM sends only because token ids were asked for (withheld text)
            s = self._EMPTY_CHAT_DELTA.sub(b"", s)
        return s

    def continuation_request(self, kind: Kind, body: dict, prompt_ids: list[int],
                             sent_ids: list[int], *, text_by_router: bool = False
                             ) -> tuple[str, dict]:
        req = completions_continuation(kind, body, prompt_ids, sent_ids, text_by_router,
                                       drop=("echo", "prompt_logprobs", "suffix"))
        if kind == "chat" and body.get("logprobs") and text_by_router:
            # completions' top_logprobs are keyed by text: tokens with the same text would
            # fold; by id they do not, and the router names them (`logprob_token_texts`)
            req["return_tokens_as_token_ids"] = True
        return "/v1/completions", req

    def logprob_token_texts(self, tokenizer: Any, ids: list[int], context: list[int]) -> list[str]:
        from adapters.vllm.logprobtext import token_texts

        return token_texts(tokenizer, ids, context)

    def detokenize_request(self, model: str, ids: list[int]) -> tuple[str, dict] | None:
        return "/detokenize", {"model": model, "tokens": list(ids)}

    def parse_detokenize(self, obj: dict) -> str:
        return obj["prompt"]

    def output_text(self, tokenizer: Any, prompt_ids: list[int], body: dict) -> Any | None:
        if body.get("detokenize", True) is False:
            return None
        from adapters.vllm.outtext import OutputText, TextParams

        return OutputText(tokenizer, prompt_ids, TextParams.from_body(body))
