"""vLLM's text of a stream, made again from token ids (for the router's continued streams).

When a stream moves, the engine that continues it sees a new request whose prompt is the
original prompt plus the ids already sent. Its own text for the continuation is not what the
original stream would have sent: its incremental detokenizer starts from another state (a
splice inside a multi-byte character re-emits or drops text), and its stop-string buffer starts
empty (text held back for a possible stop string is lost). So the router does not forward the
engine's text: `OutputText` replays vLLM v1's output processing (`FastIncrementalDetokenizer`
over tokenizers' `DecodeStream`, stop strings, min_tokens, the held-back stop buffer) for the
*original* request, seeded with its prompt and every id already sent, and turns each new id
into exactly the text the uninterrupted stream would have carried.

Ported from vllm/v1/engine/detokenizer.py (vLLM 0.32: BaseIncrementalDetokenizer,
FastIncrementalDetokenizer, check_stop_strings); the same library calls on the same ids give the
same text. No I/O here."""

from __future__ import annotations

import sys
from bisect import bisect_left
from dataclasses import dataclass
from typing import Any

#: tokenizers' error when DecodeStream's state breaks on non-monotonic output (vLLM resets)
INVALID_PREFIX_ERR_MSG = "Invalid prefix encountered"


@dataclass(frozen=True)
class TextParams:
    """The sampling parameters that shape the text of a stream (from the client's request)."""

    stop: tuple[str, ...] = ()
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    @classmethod
    def from_body(cls, body: dict) -> "TextParams":
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        return cls(stop=tuple(s for s in (stop or []) if isinstance(s, str) and s),
                   min_tokens=int(body.get("min_tokens") or 0),
                   include_stop_str_in_output=bool(body.get("include_stop_str_in_output")),
                   skip_special_tokens=body.get("skip_special_tokens", True) is not False,
                   spaces_between_special_tokens=body.get("spaces_between_special_tokens",
                                                          True) is not False)


def check_stop_strings(output_text: str, new_char_count: int, stop: tuple[str, ...],
                       include_in_output: bool) -> tuple[str, int] | None:
    """(stop string, truncate to or -1) if a stop string completes in the new text."""
    if not new_char_count or not stop:
        return None
    best_stop_str: str | None = None
    best_stop_index = 0
    best_end = sys.maxsize
    for stop_str in stop:
        stop_index = output_text.find(stop_str, 1 - new_char_count - len(stop_str))
        if stop_index == -1:
            continue
        end = stop_index + len(stop_str)
        if end < best_end:  # the one that completes earliest, as one token at a time would
            best_stop_str, best_stop_index, best_end = stop_str, stop_index, end
    if best_stop_str is None:
        return None
    if include_in_output:
        return (best_stop_str, -1) if best_end >= len(output_text) else (best_stop_str, best_end)
    return best_stop_str, best_stop_index


class OutputText:
    """vLLM's output text of one request, fed with token ids."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], params: TextParams) -> None:
        from tokenizers.decoders import DecodeStream

        self._DecodeStream = DecodeStream
        self.tokenizer = tokenizer
        self.params = params
        self.stop = params.stop
        self.min_tokens = params.min_tokens
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.stop_buffer_length = (max(len(s) for s in self.stop) - 1
                                   if self.stop and not self.include_stop_str_in_output else 0)
        self._last_output_text_offset = 0
        self.output_text = ""
        self.token_ids: list[int] = []
        self.skip_special_tokens = params.skip_special_tokens
        self.stream = DecodeStream(ids=list(prompt_ids),
                                   skip_special_tokens=self.skip_special_tokens)
        self.spaces_between_special_tokens = (params.skip_special_tokens
                                              or params.spaces_between_special_tokens)
        self.added_token_ids: dict[int, str] = {}
        self.last_special = False
        #: the last id's text is still held by the decoder (an incomplete character so far)
        self.mid_char = False
        if not self.spaces_between_special_tokens:
            self.added_token_ids = {tid: tok.content for tid, tok in
                                    tokenizer.get_added_tokens_decoder().items()}
            if not self.added_token_ids:
                self.spaces_between_special_tokens = True

    # ---- vLLM's FastIncrementalDetokenizer ------------------------------------------------
    def _protected_step(self, next_token_id: int) -> str | None:
        try:
            return self.stream.step(self.tokenizer, next_token_id)
        except (OverflowError, TypeError):
            return None
        except Exception as e:
            if not str(e).startswith(INVALID_PREFIX_ERR_MSG):
                raise
            self.stream = self._DecodeStream(skip_special_tokens=self.skip_special_tokens)
            return self.stream.step(self.tokenizer, next_token_id)

    def decode_next(self, next_token_id: int) -> str:
        token = self._protected_step(next_token_id)
        self.mid_char = token is None
        if not self.spaces_between_special_tokens:
            special_token = self.added_token_ids.get(next_token_id)
            is_special = special_token is not None
            if is_special and self.last_special:
                token = special_token
            self.last_special = is_special
        return token or ""

    # ---- vLLM's BaseIncrementalDetokenizer ------------------------------------------------
    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Add the ids of one engine step; the stop string matched, if any. After a match
        `token_ids` holds only the ids up to the one that completed it."""
        if not new_token_ids:
            return None
        if stop_terminated and not self.include_stop_str_in_output:
            skipped_stop_token_id: int | None = new_token_ids[-1]
            new_token_ids = new_token_ids[:-1]
        else:
            skipped_stop_token_id = None
        num_prev_tokens = len(self.token_ids)
        first_new_token_index = len(self.token_ids)
        token_offsets = [len(self.output_text)] if self.stop else None
        for new_token_id in new_token_ids:
            self.token_ids.append(new_token_id)
            self.output_text += self.decode_next(new_token_id)
            if token_offsets is not None:
                token_offsets.append(len(self.output_text))
        if skipped_stop_token_id is not None:
            self.token_ids.append(skipped_stop_token_id)
            if token_offsets is not None:
                token_offsets.append(len(self.output_text))
        stop_string = None
        if token_offsets is not None and len(self.token_ids) > self.min_tokens:
            stop_check_offset = token_offsets[max(self.min_tokens - num_prev_tokens, 0)]
            stop = check_stop_strings(self.output_text,
                                      len(self.output_text) - stop_check_offset, self.stop,
                                      self.include_stop_str_in_output)
            if stop is not None:
                stop_string, truncate_to = stop
                stop_end = len(self.output_text) if truncate_to == -1 else truncate_to
                if not self.include_stop_str_in_output:
                    stop_end += len(stop_string)
                num_kept = bisect_left(token_offsets, stop_end, lo=1)
                del self.token_ids[first_new_token_index + num_kept:]
                if truncate_to != -1:
                    self.output_text = self.output_text[:truncate_to]
        return stop_string

    def next_text(self, finished: bool) -> str:
        """The text to send now (vLLM's get_next_output_text with delta=True)."""
        buffer_length = 0 if finished else self.stop_buffer_length
        length = len(self.output_text) - buffer_length
        last_offset = self._last_output_text_offset
        if last_offset < length:
            self._last_output_text_offset = length
            return self.output_text[last_offset:length]
        return ""

    def held_back(self) -> str:
        """Where a splice now falls: "char" (inside a character the decoder still holds),
        "stop_buffer" (text held back for a possible stop string), or "clean"."""
        if self.mid_char:
            return "char"
        if len(self.output_text) > self._last_output_text_offset:
            return "stop_buffer"
        return "clean"

    def replay(self, sent_ids: list[int]) -> str:
        """Feed the ids the client already has, one engine step each; returns the text the
        original stream sent for them (what is held back stays held back)."""
        for t in sent_ids:
            self.update([t], False)
        return self.next_text(False)
