"""The reference engine's OpenAI-compatible server: the tiny Llama on torch (CPU or CUDA).

Run as `python -m adapters.reference.server --model DIR --served-model-name NAME --host H
--port P [--device cpu|cuda] [--max-model-len N]`. One process, aiohttp on the stdlib asyncio
loop (no uvloop, no io_uring: CRIU dumps it as it is), no transformers import (starts in
seconds).

A synchronous core (`Core`: tokenizer, model, sampling, vLLM's text making) inside a thin I/O
shell (`Server`). One scheduler task steps every active request by one token per round, prompt
tokens included (see model.py: prefill is the decode step, so a continued request computes
exactly what the uninterrupted one did). The wire format is vLLM 0.32's, `return_token_ids`
included, so vLLM's codec continues its streams, and its text is made by
`adapters.vllm.outtext.OutputText` (vLLM's own text making and stop strings), so the router's
replayed text matches by construction."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from aiohttp import web
from tokenizers import Tokenizer

from adapters.reference import __version__
from adapters.reference.device import DeviceExtras
from adapters.reference.model import KVCache, Llama
from adapters.reference.prefixcache import DEFAULT_TOKENS, PrefixCache
from adapters.vllm.framing import completion_body, usage_of
from adapters.vllm.outtext import OutputText, TextParams

log = logging.getLogger("reference")

#: the tiny model's template (relocator/tinymodel.py), used when the model folder has none
_FALLBACK_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class RequestError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _dumps(o: Any) -> str:
    return json.dumps(o, separators=(",", ":"), ensure_ascii=False)


@dataclass
class Step:
    """What one output token produced: its id, the text to send now, and how it finished."""

    token: int
    text: str
    finish_reason: str | None = None
    stop_reason: Any = None


@dataclass
class Seq:
    """One request being generated."""

    prompt: list[int]
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    stop_token_ids: frozenset[int]
    temperature: float
    top_p: float
    generator: torch.Generator | None
    text: OutputText | None
    cache: KVCache
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    out: list[int] = field(default_factory=list)
    pos: int = 0
    cached: int = 0  # prompt positions taken from the prefix cache, not computed
    finished: bool = False
    cancelled: bool = False

    def next_input(self) -> int:
        return self.prompt[self.pos] if self.pos < len(self.prompt) else self.out[
            self.pos - len(self.prompt)]


class Core:
    """Tokenizer, model, sampling and text: synchronous, no I/O."""

    def __init__(self, model_dir: Path, device: str, max_model_len: int,
                 prefix_cache_tokens: int = DEFAULT_TOKENS) -> None:
        self.model_dir = Path(model_dir)
        self.model = Llama(self.model_dir, device)
        #: finished requests' KV by token ids (prefixcache.py); None: off
        self.prefix = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens else None
        self.tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        self.max_model_len = min(max_model_len, self.model.cfg.max_position_embeddings)
        self.eos = self.model.cfg.eos_token_id
        self.template = self._load_template()
        self.special = {"bos_token": "<s>", "eos_token": "</s>"}
        cfg_file = self.model_dir / "tokenizer_config.json"
        if cfg_file.exists():
            tc = json.loads(cfg_file.read_text())
            for k in ("bos_token", "eos_token"):
                if isinstance(tc.get(k), str):
                    self.special[k] = tc[k]

    def _load_template(self) -> str:
        f = self.model_dir / "chat_template.jinja"
        if f.exists():
            return f.read_text()
        cfg_file = self.model_dir / "tokenizer_config.json"
        if cfg_file.exists():
            t = json.loads(cfg_file.read_text()).get("chat_template")
            if isinstance(t, str):
                return t
        return _FALLBACK_TEMPLATE

    # ---- prompts -------------------------------------------------------------------------
    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        msgs = []
        for m in messages:
            c = m.get("content")
            if isinstance(c, list):
                c = "".join(p.get("text", "") for p in c if isinstance(p, dict))
            msgs.append({**m, "content": c or ""})
        try:
            import jinja2

            text = jinja2.Environment().from_string(self.template).render(
                messages=msgs, add_generation_prompt=add_generation_prompt, **self.special)
        except ImportError:
            text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in msgs)
            if add_generation_prompt:
                text += "<|assistant|>"
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def completion_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True).ids
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            vocab = self.model.cfg.vocab_size
            if any(t < 0 or t >= vocab for t in prompt):
                raise RequestError(400, "token id out of vocabulary")
            return list(prompt)
        raise RequestError(400, "prompt must be a string or a list of token ids (one prompt)")

    # ---- requests ------------------------------------------------------------------------
    def new_seq(self, prompt: list[int], body: dict) -> Seq:
        if not prompt:
            raise RequestError(400, "empty prompt")
        room = self.max_model_len - len(prompt)
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
        if room <= 0 or (mt is not None and int(mt) > room):
            raise RequestError(400, f"This model's maximum context length is "
                               f"{self.max_model_len} tokens. However, you requested "
                               f"{len(prompt) + int(mt or 0)} tokens.")
        max_tokens = room if mt is None else int(mt)
        if max_tokens < 1:
            raise RequestError(400, "max_tokens must be at least 1")
        temperature = body.get("temperature")
        temperature = 1.0 if temperature is None else float(temperature)
        top_p = body.get("top_p")
        top_p = 1.0 if top_p is None else float(top_p)
        gen = None
        if temperature > 0:
            gen = torch.Generator(device=self.model.device)
            seed = body.get("seed")
            if seed is not None:
                gen.manual_seed(int(seed))
            else:
                gen.seed()
        text = None
        if body.get("detokenize", True) is not False:
            text = OutputText(self.tokenizer, prompt, TextParams.from_body(body))
        seq = Seq(prompt=list(prompt), max_tokens=max_tokens,
                  min_tokens=int(body.get("min_tokens") or 0),
                  ignore_eos=bool(body.get("ignore_eos")),
                  stop_token_ids=frozenset(int(t) for t in body.get("stop_token_ids") or ()),
                  temperature=temperature, top_p=top_p, generator=gen, text=text,
                  cache=self.model.new_cache(len(prompt) + max_tokens))
        self._reuse(seq)
        return seq

    def _reuse(self, seq: Seq) -> None:
        """Start `seq` past the prompt positions the prefix cache holds. The last prompt
        position is always computed (its logits give the first output token), as vLLM does."""
        if self.prefix is None:
            return
        n, e = self.prefix.match(seq.prompt)
        n = min(n, len(seq.prompt) - 1)
        if e is None or n <= 0:
            return
        seq.cache.k[:, :n] = e.k[:, :n]
        seq.cache.v[:, :n] = e.v[:, :n]
        seq.pos = seq.cached = n

    def retire(self, seq: Seq) -> None:
        """A request leaves (finished or cancelled): the positions it computed go into the
        prefix cache (every position before `pos` is written and final)."""
        if self.prefix is None or seq.pos <= 0:
            return
        ids = (seq.prompt + seq.out)[:seq.pos]
        self.prefix.put(ids, seq.cache.k, seq.cache.v)

    def _sample(self, seq: Seq, logits: torch.Tensor) -> int:
        if len(seq.out) < seq.min_tokens:
            logits = logits.clone()
            if self.eos is not None:
                logits[self.eos] = float("-inf")
            for t in seq.stop_token_ids:
                logits[t] = float("-inf")
        if seq.temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / seq.temperature, dim=-1)
        if seq.top_p < 1.0:
            sp, idx = torch.sort(probs, descending=True)
            keep = torch.cumsum(sp, 0) - sp < seq.top_p
            keep[0] = True
            probs = torch.zeros_like(probs).scatter(0, idx[keep], sp[keep])
        return int(torch.multinomial(probs, 1, generator=seq.generator))

    def step(self, seq: Seq) -> Step | None:
        """Run one position of `seq`; the output token it produced, if any (vLLM's stop
        checks: length first, then min_tokens, EOS, stop token ids; then stop strings)."""
        tok = seq.next_input()
        logits = self.model.step(tok, seq.pos, seq.cache)
        seq.pos += 1
        if seq.pos < len(seq.prompt) + len(seq.out):
            return None  # still reading the prompt
        t = self._sample(seq, logits)
        seq.out.append(t)
        finish, stop_reason = None, None
        n = len(seq.out)
        if n >= seq.max_tokens or len(seq.prompt) + n >= self.max_model_len:
            finish = "length"
        elif n >= seq.min_tokens:
            if not seq.ignore_eos and t == self.eos:
                finish = "stop"
            elif t in seq.stop_token_ids:
                finish, stop_reason = "stop", t
        text = ""
        if seq.text is not None:
            stop_str = seq.text.update([t], finish == "stop")
            if stop_str is not None:
                finish, stop_reason = "stop", stop_str
            text = seq.text.next_text(finish is not None)
        seq.finished = finish is not None
        return Step(t, text, finish, stop_reason)


class Server:
    """The HTTP shell: requests in, one scheduler task stepping every active request."""

    def __init__(self, core: Core, served_model_name: str, extras: DeviceExtras | None = None) -> None:
        self.core = core
        self.extras = extras
        self.model = served_model_name
        self.active: list[Seq] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        # prefix_cache_*: prompt tokens looked up and found (as vLLM's prefix_cache_queries/_hits)
        self.counters = {"prompt_tokens_total": 0, "generation_tokens_total": 0,
                         "request_success_total": 0, "request_aborted_total": 0,
                         "prefix_cache_queries_total": 0, "prefix_cache_hits_total": 0}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_get("/version", self.version)
        app.router.add_post("/device/{action}", self.device)  # scripts/gpu-check.sh (device.py)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _stop(self, app: web.Application) -> None:
        if self._task:
            self._task.cancel()

    async def _run(self) -> None:
        """The scheduler: every round steps each active request once (prompt or output)."""
        while True:
            if not self.active:
                self._wake.clear()
                await self._wake.wait()
            for seq in list(self.active):
                if seq.cancelled:
                    self.active.remove(seq)
                    self.core.retire(seq)
                    continue
                try:
                    st = self.core.step(seq)
                except Exception as e:  # one request's failure never stops the loop
                    log.exception("step failed")
                    seq.finished = True
                    seq.queue.put_nowait(e)
                    self.active.remove(seq)  # not retired: its cache may be half written
                    continue
                if st is not None:
                    self.counters["generation_tokens_total"] += 1
                    seq.queue.put_nowait(st)
                if seq.finished:
                    self.active.remove(seq)
                    self.core.retire(seq)
            await asyncio.sleep(0)

    def _submit(self, seq: Seq) -> None:
        self.counters["prompt_tokens_total"] += len(seq.prompt)
        self.counters["prefix_cache_queries_total"] += len(seq.prompt)
        self.counters["prefix_cache_hits_total"] += seq.cached
        self.active.append(seq)
        self._wake.set()

    async def _steps(self, seq: Seq):
        self._submit(seq)
        try:
            while True:
                st = await seq.queue.get()
                if isinstance(st, Exception):
                    raise st
                yield st
                if st.finish_reason is not None:
                    self.counters["request_success_total"] += 1
                    return
        finally:
            if not seq.finished:
                seq.cancelled = True
                self.counters["request_aborted_total"] += 1

    # ---- small endpoints -----------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def device(self, request: web.Request) -> web.Response:
        """POST /device/release|reserve|check: the KV pool and the CUDA graph (device.py)."""
        action, x = request.match_info["action"], self.extras
        if x is None or action not in ("release", "reserve", "check"):
            return self._err(404, f"no device action {action!r} (extras off)" if x else "no device extras")
        if action == "check":
            return web.json_response(x.check())
        if action == "release" and self.core.prefix is not None:
            self.core.prefix.clear()  # asleep, as vLLM's sleep: no KV of requests in a warm image
        return web.json_response({"bytes": x.release() if action == "release" else x.reserve()})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": __version__, "engine": "reference"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": 0, "owned_by": "reference",
            "root": str(self.core.model_dir), "max_model_len": self.core.max_model_len}]})

    async def metrics(self, request: web.Request) -> web.Response:
        lines = []
        gauges = {"num_requests_running": len(self.active), "num_requests_waiting": 0}
        for name, v in gauges.items():
            lines += [f"# TYPE reference:{name} gauge",
                      f'reference:{name}{{model_name="{self.model}"}} {v}']
        for name, v in self.counters.items():
            lines += [f"# TYPE reference:{name} counter",
                      f'reference:{name}{{model_name="{self.model}"}} {v}']
        return web.Response(text="\n".join(lines) + "\n",
                            content_type="text/plain", charset="utf-8")

    async def detokenize(self, request: web.Request) -> web.Response:
        b = await request.json()
        return web.json_response({"prompt": self.core.tokenizer.decode(
            list(b.get("tokens") or []), skip_special_tokens=False)})

    async def tokenize(self, request: web.Request) -> web.Response:
        b = await request.json()
        try:
            ids = (self.core.chat_prompt(b["messages"]) if "messages" in b
                   else self.core.completion_prompt(b.get("prompt", "")))
        except RequestError as e:
            return self._err(e.status, str(e))
        return web.json_response({"count": len(ids), "max_model_len": self.core.max_model_len,
                                  "tokens": ids})

    def _err(self, status: int, msg: str) -> web.Response:
        kind = "NotFoundError" if status == 404 else "BadRequestError"
        return web.json_response({"error": {"message": msg, "type": kind, "param": None,
                                            "code": status}}, status=status)

    # ---- generation ----------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def _serve(self, request: web.Request, kind: str) -> web.StreamResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return self._err(400, "invalid JSON")
        if body.get("model") not in (None, self.model):
            return self._err(404, f"The model `{body.get('model')}` does not exist.")
        try:
            if (body.get("n") or 1) != 1:
                raise RequestError(400, "n > 1 is not supported by the reference engine")
            if kind == "chat":
                prompt = self.core.chat_prompt(body.get("messages") or [],
                                               body.get("add_generation_prompt", True))
            else:
                prompt = self.core.completion_prompt(body.get("prompt"))
            seq = self.core.new_seq(prompt, body)
        except RequestError as e:
            return self._err(e.status, str(e))
        except (ValueError, TypeError, KeyError) as e:
            return self._err(400, str(e))
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        want_ids = body.get("return_token_ids") is True
        if body.get("stream"):
            return await self._stream(request, kind, body, seq, rid, created, want_ids)
        out, text, finish, stop_reason = [], "", None, None
        async for st in self._steps(seq):
            out.append(st.token)
            text += st.text
            finish, stop_reason = st.finish_reason, st.stop_reason
        obj = completion_body(kind, rid, created, self.model, prompt, out, text, finish,
                              stop_reason, want_ids, cached_tokens=seq.cached)
        return web.Response(text=_dumps(obj), content_type="application/json")

    async def _stream(self, request: web.Request, kind: str, body: dict, seq: Seq, rid: str,
                      created: int, want_ids: bool) -> web.StreamResponse:
        """vLLM 0.32's framing (relocator/router/fakeserver.py imitates the same)."""
        head = {"id": rid, "object": "chat.completion.chunk" if kind == "chat" else
                "text_completion", "created": created, "model": self.model}
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)

        async def send(obj: dict) -> None:
            await resp.write(f"data: {_dumps(obj)}\n\n".encode())

        if kind == "chat":
            await send(dict(head, choices=[{"index": 0, "delta": {"role": "assistant",
                                                                   "content": ""},
                                            "logprobs": None, "finish_reason": None}],
                            prompt_token_ids=seq.prompt if want_ids else None))
        first = True
        async for st in self._steps(seq):
            last = st.finish_reason is not None
            if kind == "chat":
                if not st.text and not last and not want_ids:
                    continue  # as vLLM: no chat chunk for a step without text
                c: dict[str, Any] = {"index": 0, "delta": {"content": st.text} if st.text
                                     else {}, "logprobs": None, "finish_reason": st.finish_reason}
                if last:
                    c["stop_reason"] = st.stop_reason
                c["token_ids"] = [st.token] if want_ids else None
            else:
                c = {"index": 0, "text": st.text, "logprobs": None,
                     "finish_reason": st.finish_reason,
                     "stop_reason": st.stop_reason if last else None,
                     "prompt_token_ids": seq.prompt if (want_ids and first) else None,
                     "token_ids": [st.token] if want_ids else None}
            first = False
            await send(dict(head, choices=[c]))
        if (body.get("stream_options") or {}).get("include_usage"):
            n = len(seq.out)
            await send(dict(head, choices=[], usage=usage_of(seq.prompt, seq.out, seq.cached)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="relocator's reference engine (tiny Llama, torch)")
    ap.add_argument("--model", required=True, help="model folder (HF format, safetensors)")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-pool-mb", type=int, default=0, help="a KV pool of N MiB, every byte written")
    ap.add_argument("--cuda-graph", action="store_true", help="capture one CUDA graph at start")
    ap.add_argument("--prefix-cache-tokens", type=int, default=DEFAULT_TOKENS,
                    help="the prefix cache's bound in tokens (finished requests' KV, reused by a "
                         "prompt that starts with the same ids); 0: off")
    ap.add_argument("--memory-fraction", type=float, default=None,
                    help="a GPU share's memory: on cuda, the most of the device this process may take "
                         "(torch.cuda.set_per_process_memory_fraction); on cpu only reported")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    if a.memory_fraction is not None:
        if not 0 < a.memory_fraction <= 1:
            raise SystemExit(f"--memory-fraction must be in (0, 1], not {a.memory_fraction}")
        if a.device == "cuda":
            torch.cuda.set_per_process_memory_fraction(a.memory_fraction)
        log.info("memory share %.4f of the %s", a.memory_fraction, a.device)
    t0 = time.monotonic()
    if a.prefix_cache_tokens < 0:
        raise SystemExit(f"--prefix-cache-tokens must be 0 or more, not {a.prefix_cache_tokens}")
    core = Core(Path(a.model), a.device, a.max_model_len, a.prefix_cache_tokens)
    log.info("reference engine %s: %s on %s loaded in %.2fs (torch %s)", __version__, a.model,
             a.device, time.monotonic() - t0, torch.__version__)
    extras = None
    if a.kv_pool_mb or a.cuda_graph:
        extras = DeviceExtras(core.model.device, core.model.lm_head, a.kv_pool_mb, a.cuda_graph)
    server = Server(core, a.served_model_name or str(a.model), extras)
    web.run_app(server.app(), host=a.host, port=a.port, access_log=None,
                handler_cancellation=True, backlog=2048,
                print=lambda s: log.info("serving on %s:%s", a.host, a.port))


if __name__ == "__main__":
    main()
