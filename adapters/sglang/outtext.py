"""SGLang's text of a stream, made again from token ids (for the router's continued streams).

Ported from SGLang 0.5.23: the scheduler starts each request's incremental detokenization 5
prompt ids back (`schedule_batch.Req.init_incremental_detokenize`), and the detokenizer
(`detokenizer_manager._decode_batch_token_id_output`, `DecodeStatus`) decodes the window
`ids[surr:]` against `ids[surr:read]` per step: clean new text is committed and the window
moves on; text ending in an incomplete character ("\\ufffd") is not committed and only its
printable prefix (`find_printable_text`) is sent; on finish the whole decoded text (matched
stop token trimmed) is sent after what was already sent. One engine step per token, as SGLang
streams without speculative decoding. Stop *strings* are not mirrored (the codec does not
continue such requests). No I/O here."""

from __future__ import annotations

from typing import Any

#: SGLang's INIT_INCREMENTAL_DETOKENIZATION_OFFSET
CONTEXT_IDS = 5


def _is_cjk(cp: int) -> bool:
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


def find_printable_text(text: str) -> str:
    """The longest printable prefix with only entire words (sglang.utils.find_printable_text)."""
    if text.endswith("\n"):
        return text
    if text and _is_cjk(ord(text[-1])):
        return text
    if len(text) > 1 and _is_cjk(ord(text[-2])):
        return text[:-1]
    return text[: text.rfind(" ") + 1]


class OutputText:
    """SGLang's output text of one request (no stop strings), fed with token ids."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], body: dict) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = body.get("skip_special_tokens", True) is not False
        self.no_stop_trim = bool(body.get("no_stop_trim"))
        read = len(prompt_ids)
        surr = max(read - CONTEXT_IDS, 0)
        self.ids = list(prompt_ids[surr:])  # the detokenizer's window source
        self.surr, self.read = 0, read - surr
        self.decoded: list[str] = []  # committed text
        self.decoded_len = 0
        self.sent_offset = 0
        self.token_ids: list[int] = []  # output ids
        self._pending: list[int] = []  # ids not yet turned into text
        self._stop_token = False
        self.mid_char = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Add ids (the last one a stop token if `stop_terminated`)."""
        self.token_ids.extend(new_token_ids)
        self._pending.extend(new_token_ids)
        self._stop_token = stop_terminated
        return None

    def next_text(self, finished: bool) -> str:
        out = []
        pending, self._pending = self._pending, []
        for i, t in enumerate(pending):
            self.ids.append(t)
            out.append(self._step(finished and i == len(pending) - 1))
        if finished and not pending:
            out.append(self._step(True))
        return "".join(out)

    def _step(self, finished: bool) -> str:
        read_ids = self.ids[self.surr:]
        if finished and self._stop_token and not self.no_stop_trim and read_ids:
            read_ids = read_ids[:-1]  # trim_matched_stop: the matched stop token
        surr_text = self._decode(self.ids[self.surr:self.read])
        new_text = self._decode(read_ids)[len(surr_text):]
        if not finished:
            pending = self.sent_offset - self.decoded_len
            if new_text and not new_text.endswith("\ufffd"):
                self.decoded.append(new_text)
                self.decoded_len += len(new_text)
                self.surr, self.read = self.read, len(self.ids)
                self.sent_offset = self.decoded_len
                self.mid_char = False
                return new_text[pending:] if pending else new_text
            printable = find_printable_text(new_text)
            self.sent_offset = self.decoded_len + len(printable)
            self.mid_char = bool(new_text)
            return printable[pending:] if pending else printable
        output = "".join(self.decoded) + new_text
        text = output[self.sent_offset:]
        self.sent_offset = len(output)
        return text

    def held_back(self) -> str:
        return "char" if self.mid_char else "clean"

    def replay(self, sent_ids: list[int]) -> str:
        """Feed the ids the client already has, one engine step each."""
        self.update(sent_ids, False)
        return self.next_text(False)
