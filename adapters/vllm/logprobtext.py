"""vLLM's text of a logprobs token, made again from its id (for the router's continued chats).

A chat stream is continued as a completions request, whose `top_logprobs` is a dict keyed by
each token's text: two top tokens with the same text (two halves of UTF-8 characters both
decode to "") fold into one entry, so the rebuilt chat logprobs would lose one. The router
asks the continuation with `return_tokens_as_token_ids` (keys "token_id:N", never folded) and
makes each token's text here as vLLM v1 does (`convert_ids_list_to_tokens`, then
`LogprobsProcessor._verify_tokens`, which completes a token ending in U+FFFD from up to four
sampled tokens before it: the original stream's, which the continued engine never saw).

Ported from vllm/tokenizers/detokenizer_utils.py and vllm/v1/engine/logprobs.py (vLLM 0.32);
the same library calls on the same ids give the same text. No I/O here."""

from __future__ import annotations

import json
from typing import Any

REPLACEMENT = "\ufffd"
#: vLLM looks back this many sampled tokens (enough for any UTF-8 sequence)
MAX_CONTEXT = 4

_markers: dict[int, str | None] = {}


def _decode(tokenizer: Any, ids: list[int]) -> str:
    # transformers' decode of a fast tokenizer: the backend's, special tokens kept
    return tokenizer.decode(list(ids), skip_special_tokens=False) or ""


def space_marker(tokenizer: Any) -> str | None:
    """The Metaspace replacement character whose leading instance decode() strips, if the
    tokenizer's pre-tokenizer has one (vLLM `get_leading_space_marker`)."""
    key = id(tokenizer)
    if key not in _markers:
        result = None
        try:
            pre = json.loads(tokenizer.to_str()).get("pre_tokenizer") or {}
        except Exception:
            pre = {}
        subs = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        for sub in subs:
            if isinstance(sub, dict) and sub.get("type") == "Metaspace":
                result = sub.get("replacement", "\u2581")
                break
        _markers[key] = result
    return _markers[key]


def _restore_leading_spaces(raw: str, text: str, marker: str) -> str:
    n = len(raw) - len(raw.lstrip(marker)) if raw else 0
    missing = n - (len(text) - len(text.lstrip(" ")))
    return " " * missing + text if n and missing > 0 else text


def _single(tokenizer: Any, token_id: int) -> str:
    text = _decode(tokenizer, [token_id])
    marker = space_marker(tokenizer)
    if marker is None:
        return text
    return _restore_leading_spaces(tokenizer.id_to_token(token_id) or "", text, marker)


def _corrected(tokenizer: Any, token_id: int, context: list[int]) -> str:
    """vLLM `_correct_decoded_token`: the text a token ending in U+FFFD completes, given the
    sampled tokens before it; "" while the character is still incomplete."""
    for k in range(1, min(len(context), MAX_CONTEXT) + 1):
        ctx = context[-k:]
        full = _decode(tokenizer, ctx + [token_id])
        if full.endswith(REPLACEMENT):
            continue
        clean_end = len(ctx)
        for j in range(len(ctx) - 1, -1, -1):
            if _decode(tokenizer, [ctx[j]]).endswith(REPLACEMENT):
                clean_end = j
            else:
                break
        prefix = _decode(tokenizer, ctx[:clean_end]) if clean_end > 0 else ""
        if full.startswith(prefix):
            return full[len(prefix):]
        common = 0
        for a, b in zip(prefix, full):
            if a != b:
                break
            common += 1
        return full[common:]
    return ""


def token_texts(tokenizer: Any, ids: list[int], context: list[int]) -> list[str]:
    """The texts vLLM gives the alternatives `ids` of one position (sampled, then top ones),
    `context`: the request's sampled tokens before that position, oldest first."""
    ctx = list(context[-MAX_CONTEXT:])
    out = []
    for tid in ids:
        text = _single(tokenizer, tid)
        out.append(_corrected(tokenizer, tid, ctx) if text.endswith(REPLACEMENT) else text)
    return out
