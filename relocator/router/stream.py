"""Per-request stream state: SSE framing, token-id bookkeeping, and the splice.

Normal path (`feed` before any break): complete SSE events pass through as bytes; one
regex pass records token ids (and strips them if only the router asked for them).
After a break (`begin_continuation`): each event of the continuation is parsed and
re-emitted in the client's original shape (same id, object, created, model; chat chunks
stay chat chunks), usage counts are rewritten to cover the whole request, and stop strings
that straddle the splice are enforced by the router."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from .engine import ContinuationEngine, Delta, Kind, dumps, parse_ids

DONE = b"data: [DONE]\n\n"


class StreamState:
    def __init__(self, engine: ContinuationEngine, kind: Kind, body: dict, *, track: bool,
                 strip: bool, unsupported: str | None = None) -> None:
        self.engine = engine
        self.kind = kind
        self.body = body
        self.track = track
        self.strip = strip
        self.unsupported = unsupported
        self.buf = b""
        self.first_event: bytes | None = None
        self.prompt_raw: bytes | None = None
        self.out_raw: list[bytes] = []
        self.sent_any = False
        self.finished = False  # a finish_reason was forwarded
        self.done = False  # [DONE] forwarded
        self.legs = 0
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        self.stops: list[str] = [s for s in (stop or []) if s] if not body.get(
            "include_stop_str_in_output") else []
        self.track_text = track and bool(self.stops)
        self.sent_text: list[str] = []
        so = body.get("stream_options") or {}
        self.include_usage = bool(so.get("include_usage"))
        self.continuous_usage = bool(so.get("continuous_usage_stats"))
        # continuation state
        self.cont = False
        self.cut = False  # router ended the stream at a stop string spanning the splice
        self.tmpl: dict[str, Any] = {}
        self.prompt_len = 0
        self.emitted_ids = 0
        self.span_open = False
        self.span_tail = ""
        self.span_boundary = 0
        self.pending_text = ""
        self.pending_ids: list[int] = []
        self.wants_ids = engine.client_wants_token_ids(body)
        self.usage_sent = False
        self.context_echo = ""

    # ------------------------------------------------------------------ normal path
    def feed(self, data: bytes) -> bytes:
        if self.buf:
            data = self.buf + data
            self.buf = b""
        end = data.rfind(b"\n\n")
        if end < 0:
            self.buf = data
            return b""
        end += 2
        if end != len(data):
            self.buf = data[end:]
            data = data[:end]
        if self.cont:
            return self._feed_cont(data)
        if self.first_event is None:
            self.first_event = data
        if self.track:
            prompt, outs = self.engine.scan(data)
            if prompt is not None:
                self.prompt_raw = prompt
            if outs:
                self.out_raw.extend(outs)
            if self.track_text:
                self._record_text(data)
            if self.strip:
                data = self.engine.strip(data)
        if b'"finish_reason":"' in data:
            self.finished = True
        if data.endswith(DONE):
            self.done = True
        if data:
            self.sent_any = True
        return data

    def _record_text(self, data: bytes) -> None:
        for ev in data.split(b"\n\n"):
            if not ev.startswith(b"data: {"):
                continue
            try:
                obj = json.loads(ev[6:])
            except ValueError:
                continue
            for c in obj.get("choices") or ():
                t = c.get("text") if self.kind == "completions" else (c.get("delta") or {}).get(
                    "content")
                if t:
                    self.sent_text.append(t)

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
    def begin_continuation(self, withheld: str = "", context: str = "") -> None:
        """`context`: the text of the continuation's whole prompt (original prompt + ids sent).
        vLLM primes its incremental detokenizer with those ids; when they end inside an
        incomplete UTF-8 sequence its first delta re-emits that whole text before the new one:
        it is cut off again (see _on_delta)."""
        self._ensure_tmpl()
        echo = context.rstrip("\ufffd")
        self.context_echo = echo if len(echo) >= 4 else ""
        self.cont = True
        self.legs += 1
        self.buf = b""
        if self.legs == 1:
            self.prompt_len = len(self.prompt_ids or ())
            self.emitted_ids = len(self.sent_ids)
        if self.stops and (withheld or True):
            longest = max(len(s) for s in self.stops)
            sent = "".join(self.sent_text)
            self.span_tail = sent[-(longest - 1):] if longest > 1 else ""
            self.pending_text = withheld
            self.pending_ids = []
            self.span_boundary = len(self.span_tail) + len(withheld)
            self.span_open = longest > 1 or bool(withheld)

    def _ensure_tmpl(self) -> None:
        if self.tmpl:
            return
        obj: dict = {}
        if self.first_event:
            for ev in self.first_event.split(b"\n\n"):
                if ev.startswith(b"data: {"):
                    try:
                        obj = json.loads(ev[6:])
                        break
                    except ValueError:
                        pass
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
        for ev in data.split(b"\n\n"):
            if not ev:
                continue
            if not ev.startswith(b"data:"):
                continue
            payload = ev[5:].strip()
            if payload == b"[DONE]":
                if self.span_open:
                    out.append(self._flush_pending(None, None, None))
                if self.include_usage and not self.usage_sent:
                    out.append(self._usage_event(None))
                out.append(DONE)
                self.done = True
                break
            try:
                obj = json.loads(payload)
            except ValueError:
                continue
            d = self.engine.parse_chunk(obj)
            if d.error is not None:
                out.append(b"data: " + dumps(d.error) + b"\n\n")
                continue
            if d.usage_only:
                if self.include_usage:
                    if self.span_open:
                        out.append(self._flush_pending(None, None, None))
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
        if self.context_echo and d.text:  # only the first delta with text can carry the echo
            if d.text.startswith(self.context_echo):
                d = dataclasses.replace(d, text=d.text[len(self.context_echo):])
            self.context_echo = ""
        if self.track_text and d.text:
            self.sent_text.append(d.text)
        if not self.span_open:
            self.note_sent_ids(d.token_ids)
            if d.finish_reason:
                self.finished = True
            return self._chunk(d.text, d.token_ids, d.finish_reason, d.stop_reason, d.logprobs,
                               d.usage)
        self.pending_text += d.text
        self.pending_ids.extend(d.token_ids)
        hay = self.span_tail + self.pending_text
        best = None
        for s in self.stops:
            i = hay.find(s)
            if 0 <= i < self.span_boundary and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:  # a stop string straddles the splice: end here
            cut_at = max(0, best[0] - len(self.span_tail))
            self.pending_text = self.pending_text[:cut_at]
            self.cut = True
            return self._flush_pending("stop", best[1], None)
        longest = max(len(s) for s in self.stops) if self.stops else 1
        if d.finish_reason or len(self.pending_text) >= self.span_boundary - len(
                self.span_tail) + longest - 1:
            return self._flush_pending(d.finish_reason, d.stop_reason, d.usage)
        return b""

    def _flush_pending(self, finish: str | None, stop_reason: Any, usage: dict | None) -> bytes:
        self.span_open = False
        text, ids = self.pending_text, self.pending_ids
        self.pending_text, self.pending_ids = "", []
        self.note_sent_ids(ids)
        if finish:
            self.finished = True
        if not text and not ids and not finish:
            return b""
        return self._chunk(text, ids, finish, stop_reason, None, usage)

    def _usage(self, upstream: dict | None) -> dict:
        comp = self.emitted_ids
        return {"prompt_tokens": self.prompt_len, "total_tokens": self.prompt_len + comp,
                "completion_tokens": comp}

    def _usage_event(self, upstream: dict | None) -> bytes:
        self.usage_sent = True
        obj = dict(self.tmpl)
        obj["choices"] = []
        obj["usage"] = self._usage(upstream)
        return b"data: " + dumps(obj) + b"\n\n"

    def _chunk(self, text: str, ids: list[int], finish: str | None, stop_reason: Any,
               logprobs: Any, usage: dict | None) -> bytes:
        obj = dict(self.tmpl)
        tid = ids if self.wants_ids else None
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text} if text else {},
                                      "logprobs": None, "finish_reason": finish}
            if finish:
                choice["stop_reason"] = stop_reason
            choice["token_ids"] = tid
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
                      "stop_reason": stop_reason, "prompt_token_ids": None, "token_ids": tid}
        obj["choices"] = [choice]
        if usage is not None and self.continuous_usage:
            obj["usage"] = self._usage(usage)
        return b"data: " + dumps(obj) + b"\n\n"
