"""Per-request stream state: SSE framing, token-id bookkeeping, and the splice.

Normal path (`feed` before any break): complete SSE events pass through as bytes; one
regex pass records token ids (and strips them if only the router asked for them).
After a break (`begin_continuation`): each event of the continuation is parsed and
re-emitted in the client's original shape (same id, object, created, model; chat chunks
stay chat chunks), usage counts are rewritten to cover the whole request. The text of every
continued chunk is made here from its token ids (the original engine's text making for the
original request, replayed: its codec's `output_text`), not taken from the engine that
continues, so the client's text is the text of an uninterrupted run whatever the splice cut (a
multi-byte character, a held-back stop string prefix). Each leg may be served by another
engine (a mixed fleet): the first leg's codec frames the stream and makes the text, each
continuation leg's codec parses that leg."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from adapters.codec import (ContinuationCodec, Delta, Kind, TokenTexts, chat_logprobs, dumps, parse_ids,
                            token_id_of)

from . import sse
from .engine_errors import is_engine_failure, split_failure
from .sse import DONE

_DECODER = json.JSONDecoder()


def lax_bool(v: Any) -> bool:
    """A flag as vLLM's pydantic reads it (lax mode: "false", 0 and "off" are False)."""
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "t", "yes", "y", "on")
    return bool(v) if isinstance(v, (bool, int, float)) else False


class StreamState:
    def __init__(self, kind: Kind, body: dict, raw: bytes = b"", *, continuation: bool = True,
                 codec: ContinuationCodec | None = None) -> None:
        self.kind = kind
        self.body = body
        self.raw = raw
        self.continuation = continuation
        self.engine: ContinuationCodec = ContinuationCodec()  # the first leg's (set by `use`)
        self.leg_codec: ContinuationCodec = self.engine
        self.track = False
        self.strip = False
        self.unsupported: str | None = None
        self.wants_ids = False
        self.frames = sse.Framer()  # the upstream's partial event
        self.first_event: bytes | None = None
        self.prompt_raw: bytes | None = None
        self.out_raw: list[bytes] = []
        self.sent_any = False
        self.finished = False  # a finish_reason was forwarded
        self.done = False  # [DONE] forwarded
        self.legs = 0
        so = body.get("stream_options")
        so = so if isinstance(so, dict) else {}  # the core refuses a non-object (400)
        self.include_usage = lax_bool(so.get("include_usage"))
        # as vLLM: per-chunk usage only together with include_usage
        self.continuous_usage = self.include_usage and lax_bool(so.get("continuous_usage_stats"))
        #: the last usage an engine sent (any leg): counts before a splice, extra fields
        self.last_usage: dict | None = None
        #: completions logprobs: text offsets of a continued leg are shifted by what came before
        self.track_offsets = False
        self.next_text_offset = 0
        self.leg_offset = 0
        # continuation state
        self.cont = False
        self.cut = False  # the router ended the stream at a stop string
        self.tmpl: dict[str, Any] = {}
        self.prompt_len = 0
        self.emitted_ids = 0
        #: the original request's output text, replayed; None: the engine's text is forwarded
        self.text: Any | None = None
        self.usage_sent = False
        #: where the last splice fell (the text's `held_back()`; "engine_text": no text making)
        self.splice_at = ""
        self.splices: list[str] = []
        #: why a continuation may differ from the uninterrupted run (`codec.inexact_reasons`)
        self.inexact: list[str] = []
        #: sent as a continuation from its first token (`use_translated`); its chat chunks
        #: are made here, the first one carrying the assistant role
        self.translated = False
        self.role_pending = False
        #: the engine's failure event (code >= 500) that ended this leg: not sent; the core
        #: continues the stream, or sends it after all when it cannot (router/engine_errors.py)
        self.engine_error: bytes | None = None
        if codec is not None:
            self.use(codec)

    def use(self, codec: ContinuationCodec) -> bytes:
        """Nothing has reached the client yet: the stream is (again) sent to an engine with this
        codec. Returns the request bytes to send."""
        assert not self.sent_any
        self.engine = self.leg_codec = codec
        self.unsupported = (codec.unsupported_reason(self.kind, self.body) if self.continuation
                            else "disabled")
        self.track = self.unsupported is None
        self.wants_ids = codec.client_wants_token_ids(self.body)
        self.strip = self.track and not self.wants_ids
        self.track_offsets = (self.track and self.kind == "completions"
                              and self.body.get("logprobs") is not None)
        self.restart()
        self.translated = self.role_pending = self.cont = False
        self.tmpl, self.text = {}, None
        return codec.ask_for_token_ids(self.raw) if self.strip else self.raw

    def use_translated(self, codec: ContinuationCodec, prompt_ids: list[int], tokenizer: Any | None) -> None:
        """Nothing has reached the client yet: the stream is (again) sent to an engine whose
        stream of this kind carries no token ids, as a continuation from its first token on
        `prompt_ids` (the engine's rendering of the request). Every chunk is then made here
        in the client's kind, as after a splice."""
        assert not self.sent_any
        self.engine = self.leg_codec = codec
        self.unsupported = None
        self.track, self.strip, self.track_offsets = True, False, False
        self.wants_ids = codec.client_wants_token_ids(self.body)
        self.restart()
        self.prompt_raw = ",".join(map(str, prompt_ids)).encode()
        self.text = codec.output_text(tokenizer, prompt_ids, self.body) if tokenizer is not None else None
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        self.tmpl = {"id": f"{prefix}-{uuid.uuid4().hex}",
                     "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
                     "created": int(time.time()), "model": self.body.get("model")}
        self.translated = self.cont = True
        self.role_pending = self.kind == "chat"
        self.prompt_len, self.emitted_ids, self.leg_offset = len(prompt_ids), 0, 0

    # ------------------------------------------------------------------ normal path
    def feed(self, data: bytes) -> bytes:
        data = self.frames.push(data)
        if not data or self.engine_error is not None:
            return b""
        if self.cont:
            return self._feed_cont(data)
        data, self.engine_error = split_failure(data)
        if not data:
            return b""
        if self.first_event is None:
            self.first_event = data
        if self.track:
            prompt, outs = self.engine.scan(data)
            if prompt is not None:
                self.prompt_raw = prompt
            if outs:
                self.out_raw.extend(outs)
            if self.track_offsets:
                self._record_offsets(data)
            if self.strip:
                data = self.engine.strip(data)
        if b'"usage":{' in data:
            self._note_usage(data)
        if b'"finish_reason":"' in data:
            self.finished = True
        if data.endswith(DONE):
            self.done = True
        if data:
            self.sent_any = True
        return data

    def _record_offsets(self, data: bytes) -> None:
        """Where the next token's logprobs text offset starts (vLLM: the previous offset plus
        the previous token's length)."""
        for payload in sse.payloads(data):
            obj = sse.json_object(payload) if b'"text_offset"' in payload else None
            for c in (obj or {}).get("choices") or ():
                lp = c.get("logprobs") or {}
                offs, toks = lp.get("text_offset"), lp.get("tokens")
                if offs and toks:
                    self.next_text_offset = offs[-1] + len(toks[-1])

    def _note_usage(self, data: bytes) -> None:
        """The engine's usage passing through (normal path): the final usage chunk counts as
        sent (no second one may follow); its counts are the fallback where the router saw no
        ids. An engine that sends usage unasked (vLLM --enable-force-include-usage) keeps
        sending it after a splice."""
        for ev in data.split(b"\n\n"):
            text = ev.decode(errors="replace")
            at = text.find('"usage":{')
            if at < 0:
                continue
            try:
                u, _ = _DECODER.raw_decode(text, at + len('"usage":'))
            except ValueError:
                continue
            if isinstance(u, dict):
                self.last_usage = u
                self.include_usage = True
                if b'"choices":[]' in ev:
                    self.usage_sent = True
                else:
                    self.continuous_usage = True

    def restart(self) -> None:
        """The upstream broke before anything reached the client: the request is sent again
        from the start, so nothing of the broken attempt (a partial event) may remain."""
        self.frames.clear()
        self.engine_error = None
        self.first_event = None
        self.prompt_raw = None
        self.out_raw = []
        self.next_text_offset = 0
        self.last_usage = None
        self.usage_sent = False

    # ------------------------------------------------------------------ bookkeeping
    @property
    def prompt_ids(self) -> list[int] | None:
        return parse_ids([self.prompt_raw]) if self.prompt_raw is not None else None

    @property
    def sent_ids(self) -> list[int]:
        return parse_ids(self.out_raw)

    def remaining_budget(self) -> int | None:
        mt = self.body.get("max_completion_tokens", self.body.get("max_tokens"))
        if mt is None:
            return None
        return int(mt) - len(self.sent_ids)

    def tail_after_finish(self) -> bytes:
        """The upstream broke after the last content chunk but before [DONE]: end the
        stream ourselves (with a usage chunk if the client asked for one)."""
        out = b""
        if self.include_usage and not self.usage_sent:
            self._ensure_tmpl()
            out += self._usage_event(None)
        return out + DONE

    # ------------------------------------------------------------------ continuation
    def make_text(self, tokenizer: Any | None) -> bool:
        """Before the first continuation: the original request's text making, fed what was
        sent (what the engine held back stays held back). False: no text making (no tokenizer,
        or the engine has none): the continuation's own text is forwarded."""
        if self.text is None and tokenizer is not None:
            self.text = self.engine.output_text(tokenizer, self.prompt_ids or [], self.body)
            if self.text is not None:
                self.text.replay(self.sent_ids)
        return self.text is not None

    def begin_continuation(self, codec: ContinuationCodec | None = None) -> None:
        """The next events come from a continuation request, framed by `codec` (default: the
        first leg's)."""
        self._ensure_tmpl()
        self.cont = True
        self.legs += 1
        self.frames.clear()
        self.engine_error = None
        self.leg_codec = codec or self.engine
        if self.legs == 1:
            self.prompt_len = len(self.prompt_ids or ())
            self.emitted_ids = len(self.sent_ids)
        self.leg_offset = self.next_text_offset
        self.splice_at = self.text.held_back() if self.text is not None else "engine_text"
        self.splices.append(self.splice_at)

    def _ensure_tmpl(self) -> None:
        if self.tmpl:
            return
        obj: dict = {}
        if self.first_event:
            obj = next(filter(None, map(sse.json_object, sse.payloads(self.first_event))), {})
        self.tmpl = {"id": obj.get("id", "cmpl-relocator"),
                     "object": obj.get("object", "chat.completion.chunk" if self.kind == "chat"
                                       else "text_completion"),
                     "created": obj.get("created", 0), "model": obj.get("model",
                                                                        self.body.get("model"))}

    def note_sent_ids(self, ids: list[int]) -> None:
        """Record ids emitted during a continuation (so a second break continues right)."""
        if ids:
            self.out_raw.append(",".join(map(str, ids)).encode())
            self.emitted_ids += len(ids)

    def _feed_cont(self, data: bytes) -> bytes:
        out = []
        for payload in sse.payloads(data):
            if payload == sse.DONE_PAYLOAD:
                if self.include_usage and not self.usage_sent:
                    out.append(self._usage_event(None))
                out.append(DONE)
                self.done = True
                break
            obj = sse.json_object(payload)
            if obj is None:
                continue
            d = self.leg_codec.parse_chunk(obj)
            if d.error is not None and is_engine_failure(d.error):
                self.engine_error = b"data: " + dumps(d.error) + b"\n\n"
                break
            if d.error is not None:
                out.append(b"data: " + dumps(d.error) + b"\n\n")
                continue
            if d.usage_only:
                if self.include_usage and not self.usage_sent:
                    out.append(self._usage_event(d.usage))
                continue
            out.append(self._on_delta(d))
            if self.cut:
                if self.include_usage:
                    out.append(self._usage_event(None))
                out.append(DONE)
                self.done = True
                break
        if out:
            self.sent_any = True
        return b"".join(out)

    def _on_delta(self, d: Delta) -> bytes:
        finish, reason = d.finish_reason, d.stop_reason
        if self.text is None:  # no tokenizer: the engine's own text
            ids, text = d.token_ids, d.text
        else:
            # the continuation request carries no stop strings (the router applies them), so
            # an engine "stop" is a stop token (EOS or stop_token_ids)
            before = len(self.text.token_ids)
            stop = self.text.update(d.token_ids, finish == "stop")
            ids = self.text.token_ids[before:]
            if stop is not None:
                finish, reason = "stop", stop
                self.cut = True
            text = self.text.next_text(finish is not None)
        self.note_sent_ids(ids)
        if finish:
            self.finished = True
        logprobs = self._shift_offsets(d.logprobs, len(ids))
        if self.kind == "chat":
            logprobs = self._chat_logprobs(d.logprobs, len(ids))
        if (self.kind == "chat" and not text and finish is None and not self.wants_ids
                and not logprobs):
            return b""  # vLLM sends no chat chunk for a step without text
        return self._chunk(text, ids, finish, reason, logprobs, d.usage)

    def _chat_logprobs(self, lp: Any, keep: int) -> Any:
        """A chat request's logprobs, rebuilt from the completions continuation's (asked with
        `logprobs` = the client's `top_logprobs`); None when the client asked for none."""
        if not self.body.get("logprobs"):
            return None
        return chat_logprobs(lp, int(self.body.get("top_logprobs") or 0), keep, self._token_texts(lp, keep))

    def _token_texts(self, lp: Any, keep: int) -> TokenTexts | None:
        """Texts of a continuation's logprobs asked by token id (the client asked for text):
        made as the engine makes them, after the request's tokens sent before each one."""
        toks = lp.get("tokens") if isinstance(lp, dict) else None
        if (self.text is None or self.body.get("return_tokens_as_token_ids") or not toks
                or token_id_of(str(toks[0])) is None):
            return None
        ids = self.text.token_ids
        start = len(ids) - keep  # this chunk's first token
        tokenizer, codec = self.text.tokenizer, self.leg_codec

        def texts(pos: int, keys: list[str]) -> list[str]:
            parsed = [token_id_of(k) for k in keys]
            named = codec.logprob_token_texts(tokenizer, [t for t in parsed if t is not None],
                                              ids[:start + pos])
            it = iter(named)
            return [next(it) if t is not None else k for k, t in zip(keys, parsed)]
        return texts

    def _shift_offsets(self, lp: Any, keep: int) -> Any:
        """Completions logprobs of a continued leg: offsets continue those already sent; tokens
        past a stop string the router found are dropped."""
        if not lp or self.kind != "completions" or not isinstance(lp, dict):
            return lp
        lp = dict(lp)
        toks = lp.get("tokens")
        if isinstance(toks, list) and keep < len(toks):
            for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                if isinstance(lp.get(k), list):
                    lp[k] = lp[k][:keep]
        offs, toks = lp.get("text_offset"), lp.get("tokens")
        if offs and toks:
            lp["text_offset"] = [self.leg_offset + o for o in offs]
            self.next_text_offset = lp["text_offset"][-1] + len(toks[-1])
        return lp

    def _usage_counts(self) -> tuple[int, int] | None:
        """(prompt, completion) tokens of the whole request so far, as a run that never moved
        counts them: after a splice the router's own count (original prompt, every token
        sent); before, the ids the stream carried, else the engine's last usage. None:
        unknown (no ids and no usage seen)."""
        if self.cont:
            return self.prompt_len, self.emitted_ids
        u = self.last_usage or {}
        ids = self.prompt_ids
        prompt = len(ids) if ids is not None else u.get("prompt_tokens")
        comp = len(self.sent_ids) if self.track else u.get("completion_tokens")
        if isinstance(prompt, int) and isinstance(comp, int):
            return prompt, comp
        return None

    def _usage(self, upstream: dict | None) -> dict | None:
        counts = self._usage_counts()
        if counts is None:
            return None
        p, c = counts
        usage: dict[str, Any] = {"prompt_tokens": p, "total_tokens": p + c,
                                 "completion_tokens": c}
        # the engine's other fields are kept; a continuation's cached prompt tokens are
        # counted over prompt + sent ids: at most the original prompt's are cached for it
        for k, v in (upstream if upstream is not None else self.last_usage or {}).items():
            if k in usage:
                continue
            if k == "prompt_tokens_details" and isinstance(v, dict) and \
                    isinstance(v.get("cached_tokens"), int):
                v = dict(v, cached_tokens=min(v["cached_tokens"], p))
            usage[k] = v
        return usage

    def _usage_event(self, upstream: dict | None) -> bytes:
        """The final usage chunk; nothing when the counts are unknown (no invented zeros)."""
        if upstream is not None:
            self.last_usage = upstream
        usage = self._usage(upstream)
        if usage is None:
            return b""
        self.usage_sent = True
        obj = dict(self.tmpl)
        obj["choices"] = []
        obj["usage"] = usage
        return b"data: " + dumps(obj) + b"\n\n"

    def _chunk(self, text: str, ids: list[int], finish: str | None, stop_reason: Any,
               logprobs: Any, usage: dict | None) -> bytes:
        obj = dict(self.tmpl)
        tid = ids if self.wants_ids else None
        if self.kind == "chat":
            delta: dict[str, Any] = {"content": text} if text else {}
            if self.role_pending:  # a translated stream's first chunk, as the engine's would
                delta = {"role": "assistant", "content": text}
                self.role_pending = False
            choice: dict[str, Any] = {"index": 0, "delta": delta,
                                      "logprobs": logprobs, "finish_reason": finish}
            if finish:
                choice["stop_reason"] = stop_reason
            choice["token_ids"] = tid
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
                      "stop_reason": stop_reason, "prompt_token_ids": None, "token_ids": tid}
        obj["choices"] = [choice]
        if usage is not None and self.continuous_usage:
            self.last_usage = usage
            obj["usage"] = self._usage(usage)
        return b"data: " + dumps(obj) + b"\n\n"
