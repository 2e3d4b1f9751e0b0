"""`relocator bench splices`: text of continued streams, router-made vs engine-made, in one run.

Two real vLLM CPU workers (the tiny model) behind `RepeatCutProxy`s that break every upstream
connection after a few KB, so every stream through the router is cut and continued every few
tokens, alternately on either worker. Greedy streams through the official `openai` client,
completions and chat, half with stop strings (text held back at every splice); each one's
concatenated text is compared with the same request made directly. Run once through a router
that makes the text from ids (the model's tokenizer registered) and once, as the baseline,
through a router that forwards the engine's text (no tokenizer)."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any, Callable

KINDS = ("char", "stop_buffer", "clean", "engine_text")
_WORDS = "weight model scheduler packing cache graph request token stream node".split()


Spec = tuple[bool, str, "tuple[str, ...] | None"]  # (chat, prompt, stop strings)


class _Bench:
    """One run's shared parts: the model, the proxies, the request mix and its references."""

    def __init__(self, model: str, proxies: list[Any], concurrency: int, max_tokens: int) -> None:
        self.model, self.proxies, self.max_tokens = model, proxies, max_tokens
        self.sem = asyncio.Semaphore(concurrency)
        self.specs: list[Spec] = []
        self.refs: dict[Spec, str] = {}

    async def text_of(self, client: Any, chat: bool, prompt: str, stop: tuple[str, ...] | None) -> str:
        max_tokens = self.max_tokens
        async with self.sem:
            kw: dict[str, Any] = dict(model=self.model, max_tokens=max_tokens, temperature=0,
                                      stream=True, stop=list(stop) if stop else None,
                                      extra_body={
                                          "ignore_eos": True,
                                          "min_tokens": max_tokens // 3 if stop else 0})
            if chat:
                st = await client.chat.completions.create(
                    messages=[{"role": "user", "content": prompt}], **kw)
                return "".join([c.choices[0].delta.content or "" async for c in st
                                if c.choices])
            st = await client.completions.create(prompt=prompt, **kw)
            return "".join([c.choices[0].text async for c in st if c.choices])

    async def references(self, direct: Any, rng: random.Random, distinct: int,
                         log: Callable[[str], None]) -> None:
        """The request mix: `distinct` prompts, completions and chat, each plain and with stops;
        each one's text made directly (no cut, no router)."""
        base = [(i % 2 == 1, f"{rng.choice(_WORDS)} {rng.choice(_WORDS)} {i}")
                for i in range(distinct)]
        log(f"reference: {len(base)} requests made directly")
        plain = await asyncio.gather(*(self.text_of(direct, c, p, None) for c, p in base))
        for (chat, prompt), ref in zip(base, plain):
            self.specs.append((chat, prompt, None))
            mid = len(ref) // 2
            self.specs.append((chat, prompt, (ref[mid:mid + 3] or "x", "walks")))
        self.refs = dict(zip([(c, p, None) for c, p in base], plain))
        with_stop = [s for s in self.specs if s[2]]
        for s, text in zip(with_stop, await asyncio.gather(
                *(self.text_of(direct, c, p, st) for c, p, st in with_stop))):
            self.refs[s] = text

    async def through_router(self, n: int, tokenizer: str | None) -> dict[str, Any]:
        """`n` streams of the mix through a router over the cutting proxies, compared."""
        import openai

        from relocator.router.config import BackendConfig, RouterSettings
        from relocator.router.server import RouterServer

        srv = await RouterServer(RouterSettings(
            port=0, control_port=0, hold_timeout_s=60, max_continuations=100_000, retries=4,
            unreachable_hold_s=0,
            backends=[BackendConfig(model=self.model, url=p.url, worker_id=f"w{i}",
                                    tokenizer=tokenizer) for i, p in enumerate(self.proxies)],
        )).start()
        inside = [0]  # streams with a splice inside a character or a held-back stop prefix
        counted = srv.hooks.stream_spliced

        def count(kinds: list[str]) -> None:
            inside[0] += bool({"char", "stop_buffer"} & set(kinds))
            counted(kinds)

        srv.hooks.stream_spliced = count  # type: ignore[method-assign]  # (the core holds srv.hooks)
        via = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        t0 = time.monotonic()
        cuts0 = sum(p.cuts for p in self.proxies)
        try:
            picks = [self.specs[k % len(self.specs)] for k in range(n)]
            got = await asyncio.gather(*(self.text_of(via, c, p, st) for c, p, st in picks),
                                       return_exceptions=True)
        finally:
            await via.close()
            await srv.stop()
        out = self._compared(picks, got, srv.hooks)
        out.update(streams_spliced_inside_char_or_stop_buffer=inside[0],
                   cuts=sum(p.cuts for p in self.proxies) - cuts0, seconds=round(time.monotonic() - t0, 1))
        return out

    def _compared(self, picks: list[Spec], got: list[Any], h: Any) -> dict[str, Any]:
        errors = [g for g in got if isinstance(g, BaseException)]
        bad = [(s, g) for s, g in zip(picks, got)
               if not isinstance(g, BaseException) and g != self.refs[s]]
        return {
            "streams": len(picks), "client_errors": len(errors),
            "errors": [f"{type(e).__name__}: {e}"[:200] for e in errors[:3]],
            "text_mismatched": len(bad),
            "text_mismatched_with_stop": sum(1 for s, _ in bad if s[2]),
            "examples": [{"chat": s[0], "prompt": s[1], "stop": s[2],
                          "expected": self.refs[s][:80], "got": g[:80]} for s, g in bad[:2]],
            "splices": {k: int(h.splices.labels(k)._value.get()) for k in KINDS},
            "streams_by_splice": {k: int(h.spliced_streams.labels(k)._value.get())
                                  for k in KINDS},
        }


async def _measure(workers: list[Any], model_dir: Any, streams: int, baseline_streams: int, concurrency: int,
                   max_tokens: int, distinct: int, seed: int,
                   log: Callable[[str], None]) -> tuple[dict[str, Any], dict[str, Any] | None, int]:
    """(router-made text's figures, the engine-text baseline's or None, requests in the mix)."""
    import openai

    from loadtests.cutproxy import RepeatCutProxy

    log("starting two vLLM CPU workers")
    await asyncio.gather(*(w.wait_ready() for w in workers))
    rng = random.Random(seed)
    proxies = [await RepeatCutProxy(w.base_url, rng).start() for w in workers]
    bench = _Bench(workers[0].model, proxies, concurrency, max_tokens)
    direct = openai.AsyncOpenAI(base_url=workers[1].base_url + "/v1", api_key="x",
                                max_retries=0)
    await bench.references(direct, rng, distinct, log)
    log(f"{streams} streams through the router (text made from ids)")
    exact = await bench.through_router(streams, str(model_dir))
    baseline = None
    if baseline_streams:
        log(f"baseline: {baseline_streams} streams through a router forwarding the "
            "engine's text")
        baseline = await bench.through_router(baseline_streams, None)
    await direct.close()
    for p in proxies:
        await p.close()
    return exact, baseline, len(bench.specs)


async def run(streams: int = 1000, baseline_streams: int = 200, concurrency: int = 16,
              max_tokens: int = 120, distinct: int = 40, seed: int = 0,
              log: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    from adapters.base import DEFAULT_ENGINE, LaunchSpec, get_adapter
    from relocator.local_worker import start_local_worker
    from relocator.ports import free_port
    from relocator.tinymodel import ensure_tiny_model

    t_all = time.monotonic()
    model_dir = ensure_tiny_model()
    workers = [start_local_worker(get_adapter(DEFAULT_ENGINE), LaunchSpec(
        model_dir=model_dir, served_model_name="tiny-llama", port=free_port())) for _ in range(2)]
    try:
        exact, baseline, n_specs = await _measure(workers, model_dir, streams, baseline_streams, concurrency,
                                                  max_tokens, distinct, seed, log)
    finally:
        for w in workers:
            w.stop()
    out: dict[str, Any] = {"router_text": exact, "engine_text_baseline": baseline,
                           "max_tokens": max_tokens, "concurrency": concurrency,
                           "distinct_requests": n_specs,
                           "seconds": round(time.monotonic() - t_all, 1)}
    if baseline:
        out["text_mismatch_rate"] = {
            "router_text": round(exact["text_mismatched"] / max(1, exact["streams"]), 4),
            "engine_text": round(baseline["text_mismatched"] / max(1, baseline["streams"]), 4)}
    return out
