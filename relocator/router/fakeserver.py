"""A minimal, fast, deterministic OpenAI-compatible SSE server that frames its output exactly
as vLLM 0.32 does (`return_token_ids`, usage chunks, `data: [DONE]`). Used by the router's
HTTP tests and as the benchmark backend.

Its "model" is greedy and deterministic: token ids are bytes (a byte-level tokenizer, see
`fake_tokenizer`), the prompt's ids are its UTF-8 bytes (chat: a tiny template around the
messages), and the next token is a function of the ids before it: mostly ASCII letters, now and
then a multi-byte character spread over 2-4 tokens, as real byte-level BPE models emit CJK text
and emoji. Its text is made the way vLLM makes it (`OutputText`: incremental detokenizer, stop
strings held back and cut). So a continuation from prompt+sent ids yields exactly the ids an
uninterrupted run would, and its own text shows what vLLM's does at a splice. Knobs (`cut_after`,
`stall_after`, `token_delay_s`, `fail_status`, `error_after`)
let tests break a stream the way a dying or frozen worker does.

    python -m relocator.router.fakeserver --port 9000 --model fake
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from adapters.vllm.framing import completion_body
from adapters.vllm.outtext import OutputText, TextParams

EOS = 2
#: characters the fake model spreads over several tokens (2, 3 and 4 UTF-8 bytes)
_MULTI_BYTE = ("é".encode(), "中".encode(), "😀".encode())


def next_token(ids: list[int]) -> int:
    for ch in _MULTI_BYTE:  # finish a multi-byte character first
        for k in range(len(ch) - 1, 0, -1):
            if ids[-k:] == list(ch[:k]):
                return ch[k]
    a = ids[-1] if ids else 1
    b = ids[-2] if len(ids) > 1 else 3
    v = (a * 31 + b * 17 + 7) % 250
    if v % 9 == 0:
        return _MULTI_BYTE[v % 3][0]
    return 97 + v % 26  # never EOS


_TOKENIZER: Any = None


def fake_tokenizer() -> Any:
    """A byte-level tokenizer (`tokenizers`): id i is byte i, decoded as vLLM decodes."""
    global _TOKENIZER
    if _TOKENIZER is None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _byte_of(c))
        tok = Tokenizer(models.BPE(vocab={c: _byte_of(c) for c in alphabet}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        _TOKENIZER = tok
    return _TOKENIZER


def _byte_of(c: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's bytes_to_unicode)."""
    o = ord(c)
    if 33 <= o <= 126 or 161 <= o <= 172 or 174 <= o <= 255:
        return o
    low = [b for b in range(256) if not (33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255)]
    return low[o - 256]


def write_fake_tokenizer(directory: str | Path) -> Path:
    """Save the fake model's tokenizer as `directory`/tokenizer.json (for the router)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    fake_tokenizer().save(str(d / "tokenizer.json"))
    return d


def generate(prompt: list[int], body: dict, max_tokens: int) -> tuple[list[int], list[str], str,
                                                                       Any]:
    """(ids, text of each step, finish_reason, stop_reason), one token per step."""
    text = OutputText(fake_tokenizer(), prompt, TextParams.from_body(body))
    ids = list(prompt)
    pieces: list[str] = []
    finish, stop_reason = "length", None
    for i in range(max_tokens):
        ids.append(next_token(ids))
        stop = text.update([ids[-1]], False)
        last = stop is not None or i == max_tokens - 1
        pieces.append(text.next_text(last))
        if stop is not None:
            finish, stop_reason = "stop", stop
            break
    return text.token_ids, pieces, finish, stop_reason


def _dumps(o: Any) -> str:
    return json.dumps(o, separators=(",", ":"), ensure_ascii=False)


@dataclass
class Knobs:
    cut_after: int | None = None  # close the connection after N events (once)
    stall_after: int | None = None  # stop sending after N events, keep the connection (once)
    token_delay_s: float = 0.0
    fail_status: int | None = None  # answer this status (once)
    #: after N events, send an in-stream error event with `error_code` and [DONE] (once), as
    #: vLLM does when its EngineCore dies mid-stream (code 500) or a request fails (4xx)
    error_after: int | None = None
    error_code: int = 500
    tokens: int = 16  # default max_tokens


@dataclass
class FakeEngine:
    model: str = "fake"
    knobs: Knobs = field(default_factory=Knobs)
    requests: list[dict] = field(default_factory=list)
    aborted: int = 0
    active: int = 0
    _stalls: list[asyncio.Event] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_post("/detokenize", self.detokenize)
        return app

    def unstall(self) -> None:
        for e in self._stalls:
            e.set()

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "fake"}]})

    async def detokenize(self, request: web.Request) -> web.Response:
        b = await request.json()
        return web.json_response({"prompt": fake_tokenizer().decode(b["tokens"])})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    def _err(self, status: int, msg: str) -> web.Response:
        return web.json_response({"error": {"message": msg, "type": "BadRequestError",
                                            "param": None, "code": status}}, status=status)

    @staticmethod
    def _error_event(code: int) -> str:
        """vLLM's in-stream error (ErrorResponse), then the end marker."""
        msg = ("EngineCore encountered an issue. See stack trace (above) for the root cause."
               if code >= 500 else "injected request error")
        err = {"message": msg, "type": "InternalServerError" if code >= 500 else
               "BadRequestError", "param": None, "code": code}
        return f"data: {_dumps({'error': err})}\n\ndata: [DONE]\n\n"

    def _inputs(self, kind: str, body: dict) -> tuple[list[int], int]:
        if kind == "chat":
            text = "".join(f"<{m.get('role')}>{m.get('content')}" for m in body["messages"])
            prompt = list((text + "<assistant>").encode())
        else:
            p = body.get("prompt")
            prompt = list(p) if isinstance(p, list) else list(str(p).encode())
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
                raise ValueError("prompt ids must be integers")
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or self.knobs.tokens
        if not isinstance(max_tokens, int) or not 0 < max_tokens <= 1 << 16:
            raise ValueError(f"max_tokens {max_tokens!r}")
        return prompt, max_tokens

    async def _serve(self, request: web.Request, kind: str) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        k = self.knobs
        if k.fail_status:
            st, k.fail_status = k.fail_status, None
            return self._err(st, "injected failure")
        if body.get("model") != self.model:
            return self._err(404, f"The model `{body.get('model')}` does not exist.")
        try:  # as a validating engine: bad input is a 400, never a 500 or an endless run
            prompt, max_tokens = self._inputs(kind, body)
            out, pieces, finish, stop_reason = generate(prompt, body, max_tokens)
        except (TypeError, ValueError, AttributeError, KeyError, OverflowError) as e:
            return self._err(400, f"invalid request: {e}")
        text = "".join(pieces)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:16]
        created = int(time.time())
        want_ids = body.get("return_token_ids") is True
        if not body.get("stream"):
            obj = completion_body(kind, rid, created, self.model, prompt, out, text, finish,
                                  stop_reason, want_ids)
            if k.token_delay_s:
                await asyncio.sleep(k.token_delay_s * len(out))
            return web.Response(text=_dumps(obj), content_type="application/json")
        events = self._events(kind, rid, created, prompt, out, pieces, finish, stop_reason,
                              want_ids, body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        cut, k.cut_after = k.cut_after, None
        stall, k.stall_after = k.stall_after, None
        fail_at, k.error_after = k.error_after, None
        self.active += 1
        try:
            for i, ev in enumerate(events):
                if cut is not None and i == cut:
                    request.transport.close()  # type: ignore[union-attr]
                    return resp
                if fail_at is not None and i == fail_at:
                    await resp.write(self._error_event(k.error_code).encode())
                    break
                if stall is not None and i == stall:
                    e = asyncio.Event()
                    self._stalls.append(e)
                    await e.wait()
                    return resp
                await resp.write(ev.encode())
                if k.token_delay_s:
                    await asyncio.sleep(k.token_delay_s)
            await resp.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            self.aborted += 1
            raise
        finally:
            self.active -= 1
        return resp

    def _events(self, kind: str, rid: str, created: int, prompt: list[int], out: list[int],
                pieces: list[str], finish: str, stop_reason: Any, want_ids: bool,
                body: dict) -> list[str]:
        head = {"id": rid, "object": "chat.completion.chunk" if kind == "chat" else
                "text_completion", "created": created, "model": self.model}
        evs = []
        so = body.get("stream_options") or {}
        include_usage = bool(so.get("include_usage"))
        per_chunk = include_usage and bool(so.get("continuous_usage_stats"))

        def usage(n: int) -> dict:
            return {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + n,
                    "completion_tokens": n}

        if kind == "chat":
            first = dict(head, choices=[{"index": 0, "delta": {"role": "assistant",
                                                                "content": ""},
                                         "logprobs": None, "finish_reason": None}],
                         prompt_token_ids=prompt if want_ids else None)
            if per_chunk:
                first["usage"] = usage(0)
            evs.append(first)
        for i, t in enumerate(out):
            last = i == len(out) - 1
            piece = pieces[i] if i < len(pieces) else ""
            fr = finish if last else None
            if kind == "chat" and not piece and not last and not want_ids:
                continue  # as vLLM: no chat chunk for a step without text
            if kind == "chat":
                c: dict[str, Any] = {"index": 0, "delta": {"content": piece} if piece else {},
                                     "logprobs": None, "finish_reason": fr}
                if last:
                    c["stop_reason"] = stop_reason
                c["token_ids"] = [t] if want_ids else None
                evs.append(dict(head, choices=[c]))
                if per_chunk:  # as vLLM's continuous_usage_stats: the whole request so far
                    evs[-1]["usage"] = usage(i + 1)
            else:
                c = {"index": 0, "text": piece, "logprobs": None, "finish_reason": fr,
                     "stop_reason": stop_reason if last else None,
                     "prompt_token_ids": prompt if (want_ids and i == 0) else None,
                     "token_ids": [t] if want_ids else None}
                evs.append(dict(head, choices=[c]))
                if per_chunk:
                    evs[-1]["usage"] = usage(i + 1)
        lines = [f"data: {_dumps(e)}\n\n" for e in evs]
        if include_usage:
            u = dict(head, choices=[], usage=usage(len(out)))
            lines.append(f"data: {_dumps(u)}\n\n")
        lines.append("data: [DONE]\n\n")
        return lines


async def start_fake(model: str = "fake", host: str = "127.0.0.1", port: int = 0,
                     knobs: Knobs | None = None) -> tuple[FakeEngine, web.AppRunner, str]:
    eng = FakeEngine(model=model, knobs=knobs or Knobs())
    runner = web.AppRunner(eng.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=2048)
    await site.start()
    return eng, runner, f"http://{host}:{runner.addresses[0][1]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9000)
    ap.add_argument("--model", default="fake")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--token-delay", type=float, default=0.0, help="seconds between streamed tokens")
    a = ap.parse_args()
    eng = FakeEngine(model=a.model, knobs=Knobs(tokens=a.tokens, token_delay_s=a.token_delay))
    web.run_app(eng.app(), host=a.host, port=a.port, access_log=None, print=None,
                handler_cancellation=True, backlog=2048)


if __name__ == "__main__":
    main()
