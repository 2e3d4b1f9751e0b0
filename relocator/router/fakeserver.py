"""A minimal, fast, deterministic OpenAI-compatible SSE server that frames its output exactly
as vLLM 0.32 does (`return_token_ids`, usage chunks, `data: [DONE]`). Used by the router's
HTTP tests and as the benchmark backend.

Its "model" is greedy and deterministic: the prompt's ids are its UTF-8 bytes (chat: a tiny
template around the messages), the next token is a function of the last two ids, and a token's
text is one letter. So a continuation from prompt+sent ids yields exactly what an
uninterrupted run would. Knobs (`cut_after`, `stall_after`, `token_delay_s`, `fail_status`)
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
from typing import Any

from aiohttp import web

EOS = 2


def next_token(ids: list[int]) -> int:
    a = ids[-1] if ids else 1
    b = ids[-2] if len(ids) > 1 else 3
    return (a * 31 + b * 17 + 7) % 250 + 3  # never EOS


def token_text(t: int) -> str:
    return chr(97 + t % 26)


def _dumps(o: Any) -> str:
    return json.dumps(o, separators=(",", ":"), ensure_ascii=False)


@dataclass
class Knobs:
    cut_after: int | None = None  # close the connection after N events (once)
    stall_after: int | None = None  # stop sending after N events, keep the connection (once)
    token_delay_s: float = 0.0
    fail_status: int | None = None  # answer this status (once)
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
        return web.json_response({"prompt": "".join(token_text(t) for t in b["tokens"])})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    def _err(self, status: int, msg: str) -> web.Response:
        return web.json_response({"error": {"message": msg, "type": "BadRequestError",
                                            "param": None, "code": status}}, status=status)

    async def _serve(self, request: web.Request, kind: str) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        k = self.knobs
        if k.fail_status:
            st, k.fail_status = k.fail_status, None
            return self._err(st, "injected failure")
        if body.get("model") != self.model:
            return self._err(404, f"The model `{body.get('model')}` does not exist.")
        if kind == "chat":
            text = "".join(f"<{m.get('role')}>{m.get('content')}" for m in body["messages"])
            prompt = list((text + "<assistant>").encode())
        else:
            p = body.get("prompt")
            prompt = list(p) if isinstance(p, list) else list(str(p).encode())
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or k.tokens
        stops = body.get("stop") or []
        if isinstance(stops, str):
            stops = [stops]
        ids = list(prompt)
        out: list[int] = []
        text = ""
        finish = "length"
        stop_reason = None
        for _ in range(max_tokens):
            t = next_token(ids)
            ids.append(t)
            out.append(t)
            text += token_text(t)
            hit = next((s for s in stops if s and s in text), None)
            if hit:
                text = text[:text.index(hit)]
                finish, stop_reason = "stop", hit
                break
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:16]
        created = int(time.time())
        want_ids = body.get("return_token_ids") is True
        if not body.get("stream"):
            usage = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(out),
                     "completion_tokens": len(out)}
            if kind == "chat":
                ch = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason,
                      "token_ids": out if want_ids else None}
                obj = {"id": rid, "object": "chat.completion", "created": created,
                       "model": self.model, "choices": [ch], "usage": usage,
                       "prompt_token_ids": prompt if want_ids else None}
            else:
                ch = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                      "stop_reason": stop_reason, "token_ids": out if want_ids else None,
                      "prompt_token_ids": prompt if want_ids else None}
                obj = {"id": rid, "object": "text_completion", "created": created,
                       "model": self.model, "choices": [ch], "usage": usage}
            if k.token_delay_s:
                await asyncio.sleep(k.token_delay_s * len(out))
            return web.Response(text=_dumps(obj), content_type="application/json")
        events = self._events(kind, rid, created, prompt, out, text, finish, stop_reason,
                              want_ids, body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        cut, k.cut_after = k.cut_after, None
        stall, k.stall_after = k.stall_after, None
        self.active += 1
        try:
            for i, ev in enumerate(events):
                if cut is not None and i == cut:
                    request.transport.close()  # type: ignore[union-attr]
                    return resp
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
                text: str, finish: str, stop_reason: Any, want_ids: bool, body: dict) -> list[str]:
        head = {"id": rid, "object": "chat.completion.chunk" if kind == "chat" else
                "text_completion", "created": created, "model": self.model}
        evs = []
        n = len(text)
        if kind == "chat":
            first = dict(head, choices=[{"index": 0, "delta": {"role": "assistant",
                                                                "content": ""},
                                         "logprobs": None, "finish_reason": None}],
                         prompt_token_ids=prompt if want_ids else None)
            evs.append(first)
        for i, t in enumerate(out):
            last = i == len(out) - 1
            piece = text[i] if i < n else ""
            fr = finish if last else None
            if kind == "chat":
                c: dict[str, Any] = {"index": 0, "delta": {"content": piece} if piece else {},
                                     "logprobs": None, "finish_reason": fr}
                if last:
                    c["stop_reason"] = stop_reason
                c["token_ids"] = [t] if want_ids else None
                evs.append(dict(head, choices=[c]))
            else:
                c = {"index": 0, "text": piece, "logprobs": None, "finish_reason": fr,
                     "stop_reason": stop_reason if last else None,
                     "prompt_token_ids": prompt if (want_ids and i == 0) else None,
                     "token_ids": [t] if want_ids else None}
                evs.append(dict(head, choices=[c]))
        lines = [f"data: {_dumps(e)}\n\n" for e in evs]
        if (body.get("stream_options") or {}).get("include_usage"):
            u = dict(head, choices=[], usage={"prompt_tokens": len(prompt),
                                              "total_tokens": len(prompt) + len(out),
                                              "completion_tokens": len(out)})
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
