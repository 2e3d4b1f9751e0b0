"""The engine-neutral side of stream continuation: what the router needs from an engine.

A continuation needs three things the OpenAI API does not give: the prompt's token ids, the
ids of the output tokens already sent, and a way to generate from a prompt given as ids. Each
engine's codec (adapters/NAME/codec.py) implements `ContinuationCodec` for its wire format;
the router gets it by name (`adapters.base.get_codec`), per replica, so one router serves
several engines. Hot-path methods (`ask_for_token_ids`, `scan`, `strip`) work on raw bytes;
everything else runs only when a stream is continued. No I/O here, no aiohttp."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

Kind = Literal["completions", "chat"]

#: request fields carried from a chat request into its completions-style continuation
CHAT_SAMPLING_KEYS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "logit_bias", "bad_words", "allowed_token_ids", "stream_options", "user", "priority",
    "min_tokens", "length_penalty", "return_tokens_as_token_ids",
)

#: vLLM clamps each logit_bias value to this range (SamplingParams.from_optional)
LOGIT_BIAS_LIMIT = 100.0


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
    (adapters/NAME/codec.py, class `Codec`); this base continues nothing. Its token-id
    methods are the OpenAI servers' `return_token_ids` framing (vLLM's, which SGLang follows):
    used only once `unsupported_reason` allows a stream."""

    name = "base"
    #: where the events carry ids: `"prompt_token_ids":[...]` and `"token_ids":[...]`
    _IDS = re.compile(rb'"(prompt_token_ids|token_ids)":\[([0-9,\s]*)\]')

    def unsupported_reason(self, kind: Kind, body: dict) -> str | None:
        """Why a stream of this request could not be continued (None: it can)."""
        return "engine does not support continuation"

    def client_wants_token_ids(self, body: dict) -> bool:
        """The client asked for the ids itself (they are not stripped from its stream)."""
        return body.get("return_token_ids") is True

    def ask_for_token_ids(self, raw: bytes) -> bytes:
        """The raw request body changed so that the stream carries token ids."""
        end = raw.rstrip().rfind(b"}")
        return raw[:end] + b',"return_token_ids":true}'

    def scan(self, events: bytes) -> tuple[bytes | None, list[bytes]]:
        """(prompt ids, [output id segments]) found in complete SSE events, unparsed."""
        prompt = None
        out: list[bytes] = []
        for m in self._IDS.finditer(events):
            if m.group(1) == b"token_ids":
                out.append(m.group(2))
            else:
                prompt = m.group(2)
        return prompt, out

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

    def inexact_reasons(self, kind: Kind, body: dict, sent_ids: list[int]) -> list[str]:
        """Why `continuation_request` may not generate what the uninterrupted run would
        (empty: it does)."""
        return inexact_reasons(kind, body, sent_ids)

    #: the completions choice field naming the stop string or token that ended it
    stop_reason_field = "stop_reason"

    def parse_chunk(self, obj: dict) -> Delta:
        """One event of the continuation stream (an OpenAI completions chunk)."""
        if "error" in obj and "choices" not in obj:
            return Delta(error=obj)
        choices = obj.get("choices") or []
        usage = obj.get("usage")
        if not choices:
            return Delta(usage=usage, usage_only=True)
        c = choices[0]
        return Delta(text=c.get("text") or "", token_ids=list(c.get("token_ids") or ()),
                     finish_reason=c.get("finish_reason"),
                     stop_reason=c.get(self.stop_reason_field), logprobs=c.get("logprobs"),
                     usage=usage)

    def detokenize_request(self, model: str, ids: list[int]) -> tuple[str, dict] | None:
        """(path, body) asking the engine for the text of `ids`, or None if unsupported."""
        return None

    def parse_detokenize(self, obj: dict) -> str:
        raise NotImplementedError

    def logprob_token_texts(self, tokenizer: Any, ids: list[int], context: list[int]) -> list[str]:
        """The engine's texts of a logprobs position's alternatives `ids`, after the sampled
        `context` (for a continuation asked with its logprobs keyed by token id)."""
        return [tokenizer.decode([tid], skip_special_tokens=False) or "" for tid in ids]

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

    # A handoff's warm-up (relocator/agent/modes/handoff.py): prefill-only requests on the
    # target copy, so its prefix cache holds each stream's KV before the continuation comes.
    def prefill_request(self, model: str, ids: list[int]) -> tuple[str, dict]:
        """(path, body) of a non-streamed request that only prefills `ids` (one greedy token
        out); the OpenAI completions form with a token-id prompt (vLLM, the reference engine)."""
        return "/v1/completions", {"model": model, "prompt": list(ids), "max_tokens": 1, "temperature": 0,
                                   "stream": False}

    def prefill_cached_tokens(self, obj: Any) -> int:
        """The prompt tokens the engine found in its prefix cache, from the answer to
        `prefill_request` (`usage.prompt_tokens_details.cached_tokens`, vLLM's with
        --enable-prompt-tokens-details); 0 when unsaid."""
        try:
            details = (obj.get("usage") or {}).get("prompt_tokens_details") or {}
            return int(details.get("cached_tokens") or 0)
        except (AttributeError, TypeError, ValueError):
            return 0


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
    # truncation applies to the original prompt only: done here (a no-op on the ids vLLM
    # reports, already truncated), not by the engine, which would cut into the sent tokens
    req.pop("truncate_prompt_tokens", None)
    req.pop("truncation_side", None)
    prompt_ids = truncated(body, prompt_ids)
    bias = penalty_bias(body, sent_ids)
    if bias is not None:
        req["logit_bias"] = bias
    if kind == "chat" and body.get("logprobs"):
        # chat logprobs are rebuilt from the completions ones (`chat_logprobs`)
        req["logprobs"] = int(body.get("top_logprobs") or 0)
    req["prompt"] = list(prompt_ids) + list(sent_ids)
    req["stream"] = True
    req["return_token_ids"] = True
    n = len(sent_ids)
    if req.get("max_tokens") is not None:
        req["max_tokens"] = max(1, int(req["max_tokens"]) - n)
    if req.get("min_tokens"):
        req["min_tokens"] = max(0, int(req["min_tokens"]) - n)
    return req


def truncated(body: dict, prompt_ids: list[int]) -> list[int]:
    """`prompt_ids` cut as the engine's `truncate_prompt_tokens` would (-1, the model's
    length, is left to the engine's reported ids)."""
    k = body.get("truncate_prompt_tokens")
    if not isinstance(k, int) or k <= 0 or len(prompt_ids) <= k:
        return list(prompt_ids)
    return list(prompt_ids[:k] if body.get("truncation_side") == "right" else prompt_ids[-k:])


def _num(body: dict, key: str, default: float = 0.0) -> float:
    v = body.get(key)
    return default if v is None else float(v)


def penalty_bias(body: dict, sent_ids: list[int]) -> dict[str, float] | None:
    """The continuation's logit_bias: the client's, plus what frequency and presence penalty
    charge the tokens already sent (the engine counts them over output tokens only, and those
    are prompt tokens now): -frequency_penalty * count(t) - presence_penalty for each sent t.
    vLLM adds logit_bias before its penalties, so the sum is the uninterrupted run's (see
    `inexact_reasons` for where it is not). None: the client's logit_bias is kept as it is."""
    fp, pp = _num(body, "frequency_penalty"), _num(body, "presence_penalty")
    if not sent_ids or (fp == 0 and pp == 0):
        return None
    bias = {str(k): _clamp(float(v)) for k, v in (body.get("logit_bias") or {}).items()}
    for t, b in _penalized(body, sent_ids).items():
        bias[str(t)] = _clamp(b)
    return bias


def _clamp(b: float) -> float:
    return max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, b))


def _penalized(body: dict, sent_ids: list[int]) -> dict[int, float]:
    """Each sent token's logit_bias before clamping: the client's (clamped, as the engine
    does) less what frequency and presence penalty charge it."""
    fp, pp = _num(body, "frequency_penalty"), _num(body, "presence_penalty")
    client = body.get("logit_bias") or {}
    counts: dict[int, int] = {}
    for t in sent_ids:
        counts[t] = counts.get(t, 0) + 1
    return {t: _clamp(float(client.get(str(t), 0.0))) - fp * c - pp for t, c in counts.items()}


def inexact_reasons(kind: Kind, body: dict, sent_ids: list[int]) -> list[str]:
    """Why a continuation after `sent_ids` may not give the uninterrupted run's tokens (empty:
    it does). Each reason is documented in docs/router.md ("What a continuation keeps")."""
    if not sent_ids:
        return []
    out: list[str] = []
    fp, pp = _num(body, "frequency_penalty"), _num(body, "presence_penalty")
    if pp != 0:
        out.append("presence_penalty")  # a sent token that comes again is charged twice
    if (fp != 0 or pp != 0) and _num(body, "repetition_penalty", 1.0) != 1.0:
        out.append("repetition_penalty_with_bias")  # scales the bias that stands in for them
    if fp != 0 or pp != 0:
        if any(abs(b) > LOGIT_BIAS_LIMIT for b in _penalized(body, sent_ids).values()):
            out.append("logit_bias_clamped")
    if body.get("seed") is not None and _num(body, "temperature", 1.0) > 0:
        out.append("seed")  # the seeded sampler restarts at the splice
    if body.get("bad_words"):
        out.append("bad_words")  # a multi-token bad word begun before the splice is not seen
    return out


#: how a completions logprobs token reads when asked with `return_tokens_as_token_ids`
TOKEN_ID_PREFIX = "token_id:"

#: texts of one position's token-id keys, by position in the chunk (None: keys kept as they are)
TokenTexts = Callable[[int, list[str]], list[str]]


def token_id_of(key: str) -> int | None:
    if key.startswith(TOKEN_ID_PREFIX) and key[len(TOKEN_ID_PREFIX):].isdigit():
        return int(key[len(TOKEN_ID_PREFIX):])
    return None


def chat_logprobs(lp: Any, top: int, keep: int, texts: TokenTexts | None = None) -> dict | None:
    """Chat-shaped logprobs (`{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`,
    as vLLM's chat endpoint makes them) from a completions chunk's logprobs asked with
    `logprobs=top`: vLLM's completions dict holds the same entries in the same order (the
    sampled token first, then the top ones), chat lists its first `top` (-1: all). `keep`:
    how many of the chunk's tokens are sent (the router may have cut at a stop string).
    `texts`: the chunk was asked with tokens as ids (keys that never fold); it gives their text."""
    if not isinstance(lp, dict) or not isinstance(lp.get("tokens"), list):
        return None
    content = []
    tops = lp.get("top_logprobs") or []
    lps = lp.get("token_logprobs") or []
    for i, tok in enumerate(lp["tokens"][:keep]):
        step = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        pairs = list(step.items()) if top < 0 else list(step.items())[:top]
        if texts is not None:
            named = texts(i, [tok] + [t for t, _ in pairs])
            tok, pairs = named[0], [(t, v) for t, (_, v) in zip(named[1:], pairs)]
        entry: dict[str, Any] = {"token": tok,
                                 "logprob": lps[i] if i < len(lps) and lps[i] is not None
                                 else -9999.0,
                                 "bytes": list(tok.encode("utf-8", errors="replace"))}
        entry["top_logprobs"] = [
            {"token": t, "logprob": v, "bytes": list(t.encode("utf-8", errors="replace"))}
            for t, v in pairs]
        content.append(entry)
    return {"content": content}


def parse_ids(segments: list[bytes]) -> list[int]:
    out: list[int] = []
    for seg in segments:
        if seg:
            out.extend(int(x) for x in seg.split(b","))
    return out


def dumps(obj: Any) -> bytes:
    """JSON the way vLLM (pydantic) writes it: compact, UTF-8."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
