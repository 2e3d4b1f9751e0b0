"""The engine-neutral side of stream continuation: what the router needs from an engine.

A continuation needs three things the OpenAI API does not give: the prompt's token ids, the
ids of the output tokens already sent, and a way to generate from a prompt given as ids. Each
engine's codec (adapters/NAME/codec.py) implements `ContinuationCodec` for its wire format;
the router gets it by name (`adapters.base.get_codec`), per replica, so one router serves
several engines. Hot-path methods (`ask_for_token_ids`, `scan`, `strip`) work on raw bytes;
everything else runs only when a stream is continued. No I/O here, no aiohttp."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["completions", "chat"]

#: request fields carried from a chat request into its completions-style continuation
CHAT_SAMPLING_KEYS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "logit_bias", "bad_words", "allowed_token_ids", "stream_options", "user", "priority",
    "min_tokens", "truncate_prompt_tokens", "length_penalty",
)


@dataclass
class Delta:
    """One chunk of a continuation, engine-neutral."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: Any = None
    logprobs: Any = None
    usage: dict | None = None
    usage_only: bool = False
    error: dict | None = None


class ContinuationCodec:
    """What the router needs from one engine to continue a stream. Subclass per engine
    (adapters/NAME/codec.py, class `Codec`); this base continues nothing."""

    name = "base"

    def unsupported_reason(self, kind: Kind, body: dict) -> str | None:
        """Why a stream of this request could not be continued (None: it can)."""
        return "engine does not support continuation"

    def client_wants_token_ids(self, body: dict) -> bool:
        return False

    def ask_for_token_ids(self, raw: bytes) -> bytes:
        """The raw request body changed so that the stream carries token ids."""
        raise NotImplementedError

    def scan(self, events: bytes) -> tuple[bytes | None, list[bytes]]:
        """(prompt ids, [output id segments]) found in complete SSE events, unparsed."""
        raise NotImplementedError

    def strip(self, events: bytes) -> bytes:
        """The events as the client would have got them without asking for token ids."""
        raise NotImplementedError

    def continuation_request(self, kind: Kind, body: dict, prompt_ids: list[int],
                             sent_ids: list[int], *, text_by_router: bool = False
                             ) -> tuple[str, dict]:
        """(path, JSON body) of a streaming request that generates what follows `sent_ids`.
        `text_by_router`: the router makes the text and applies stop strings itself, so the
        engine gets none (its text of a continuation is not the original's)."""
        raise NotImplementedError

    def parse_chunk(self, obj: dict) -> Delta:
        """One event of the continuation stream."""
        raise NotImplementedError

    def detokenize_request(self, model: str, ids: list[int]) -> tuple[str, dict] | None:
        """(path, body) asking the engine for the text of `ids`, or None if unsupported."""
        return None

    def parse_detokenize(self, obj: dict) -> str:
        raise NotImplementedError

    def output_text(self, tokenizer: Any, prompt_ids: list[int], body: dict) -> Any | None:
        """The engine's text making for the request `body`, to be fed the stream's ids
        (an object with `replay(ids)`, `update(ids, stop_terminated)`, `next_text(finished)`,
        `held_back()`, `token_ids`); None: the router forwards the engine's own text."""
        return None

    # An engine whose stream of some kind carries no token ids (SGLang's chat) can still be
    # continued if the router sends that stream as a continuation from its first token: the
    # prompt's ids come from the engine's own rendering (`prompt_ids_request`), the request
    # goes out as `continuation_request(kind, body, prompt_ids, [])` and the router frames
    # every chunk in the client's kind, as it does after a splice.
    def translates(self, kind: Kind, body: dict) -> bool:
        """True: stream this request as a continuation from the start."""
        return False

    def prompt_ids_request(self, kind: Kind, body: dict) -> tuple[str, dict] | None:
        """(path, body) asking the engine for the prompt ids it would generate from."""
        return None

    def parse_prompt_ids(self, obj: dict) -> list[int]:
        raise NotImplementedError


def completions_continuation(kind: Kind, body: dict, prompt_ids: list[int], sent_ids: list[int],
                             text_by_router: bool, drop: tuple[str, ...] = ()) -> dict:
    """The OpenAI completions request (prompt given as ids, streamed, with token ids) that
    generates what follows `sent_ids`: a completions body keeps its fields (minus `drop`), a
    chat body gives its sampling fields (the chat template is already in `prompt_ids`);
    max_tokens and min_tokens count what was already sent."""
    if kind == "completions":
        req = {k: v for k, v in body.items() if k not in drop}
    else:
        req = {"model": body["model"]}
        for k in CHAT_SAMPLING_KEYS:
            if k in body:
                req[k] = body[k]
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
        if mt is not None:
            req["max_tokens"] = mt
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
    return req


def parse_ids(segments: list[bytes]) -> list[int]:
    out: list[int] = []
    for seg in segments:
        if seg:
            out.extend(int(x) for x in seg.split(b","))
    return out


def dumps(obj: Any) -> bytes:
    """JSON the way vLLM (pydantic) writes it: compact, UTF-8."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
