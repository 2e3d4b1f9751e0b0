"""Greedy streaming clients for relocation runs: reference outputs, closed-loop load through
the router, and the figures a relocation is judged by (longest pause each client saw, tokens
lost / duplicated / mismatched against the reference, requests whose text differs from the
reference's, client errors). Text is checked apart from ids: it is what users read.

Self-contained (aiohttp only) so the demo, the benchmark and the tests measure the same way.
"""

from __future__ import annotations

import asyncio
import difflib
import json
import random
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import aiohttp

from relocator.router import sse
from relocator.router.auth import client_headers  # RELOCATOR_API_KEY, for a keyed router

PROMPTS = [
    "the cluster node", "a worker moves to a new", "red river mountain light and",
    "once upon a time the", "seven quiet servers in a", "move the running job without",
    "tokens flow through the router", "the frozen process wakes on",
    "a scheduler that cannot move", "green fields under the morning",
]
#: the words long prompts are made of (long_prompt): those of PROMPTS, in a fixed order
PROMPT_WORDS = sorted({w for p in PROMPTS for w in p.split()})
#: tokens per word of PROMPT_WORDS text with the tiny model's tokenizer, about: long_prompt's
#: guess when it has no tokenizer to count with
TOKENS_PER_WORD = 2.35


#: how many of the longest gaps overlapping a move a load report keeps (Load.report)
LONG_GAPS = 2048

@dataclass
class RequestResult:
    client: int
    prompt: int
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # the concatenated text the client received
    times: list[float] = field(default_factory=list)  # send time, then one per token event
    error: str = ""
    finish_reason: str | None = None

    def gaps(self) -> list[tuple[float, float]]:
        """(start, end) of every wait: send → first token, then between token events."""
        return list(zip(self.times, self.times[1:]))


async def stream_once(session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int,
                      client: int = 0, prompt_idx: int = 0, timeout: float = 300.0) -> RequestResult:
    res = RequestResult(client, prompt_idx)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "return_token_ids": True, "ignore_eos": True}
    res.times.append(time.monotonic())
    done = False
    try:
        async with session.post(f"{url}/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return res
            async for data in sse.read(r.content.iter_any()):
                if data == sse.DONE_PAYLOAD:
                    done = True
                    continue
                obj = json.loads(data)
                if "error" in obj:
                    res.error = f"error event: {obj['error']}"
                    continue
                for ch in obj.get("choices", []):
                    res.text += ch.get("text") or ""
                    ids = ch.get("token_ids") or []
                    if ids:
                        res.tokens.extend(ids)
                        res.times.append(time.monotonic())
                    if ch.get("finish_reason"):
                        res.finish_reason = ch["finish_reason"]
        if not done and not res.error:
            res.error = "stream ended without [DONE]"
    except Exception as exc:  # noqa: BLE001 - a client error is a result
        res.error = f"{type(exc).__name__}: {exc}"
    return res


def long_prompt(client: int, n_tokens: int, count: Callable[[str], int] | None = None) -> str:
    """Client `client`'s prompt of about `n_tokens` tokens: PROMPT_WORDS drawn from a generator
    seeded by the client, so every run gives each client the same text and no two clients
    share a prefix (a handoff's warm-up recomputes each prompt on its own). `count` (text ->
    its token count, the served model's tokenizer): the longest such text of at most
    `n_tokens` tokens; without it, a guess at TOKENS_PER_WORD."""
    if n_tokens < 1:
        raise ValueError(f"a prompt of {n_tokens} tokens: it needs 1 or more")
    rng = random.Random(f"relocator-long-prompt:{client}")
    words = [rng.choice(PROMPT_WORDS) for _ in range(n_tokens)]  # every word is a token or more
    if count is None:
        return " ".join(words[:max(1, round(n_tokens / TOKENS_PER_WORD))])
    lo, hi = 1, len(words)  # the most words whose text fits (a word never takes fewer tokens)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(" ".join(words[:mid])) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def prompts_for(n_prompts: int, prompt_tokens: int | None = None,
                count: Callable[[str], int] | None = None) -> list[str]:
    """The prompts a reference and its load send (index i: prompt i): PROMPTS, or with
    `prompt_tokens` one long_prompt per index."""
    if prompt_tokens is None:
        return [PROMPTS[i % len(PROMPTS)] for i in range(n_prompts)]
    return [long_prompt(i, prompt_tokens, count) for i in range(n_prompts)]


#: prompt index -> that prompt's uninterrupted result (ids and text)
Reference = dict[int, RequestResult]


async def reference(url: str, model: str, max_tokens: int, n_prompts: int, concurrency: int = 8,
                    prompts: Sequence[str] | None = None) -> Reference:
    """Each prompt once, streamed with the same parameters as the load, no relocation.
    `prompts`: what prompt i is (i modulo its length; None: PROMPTS); the load must get the same."""
    sem = asyncio.Semaphore(concurrency)
    texts = list(prompts or PROMPTS)
    async with aiohttp.ClientSession(headers=client_headers()) as s:
        async def one(i: int) -> RequestResult:
            async with sem:
                return await stream_once(s, url, model, texts[i % len(texts)], max_tokens, prompt_idx=i)

        results = await asyncio.gather(*(one(i) for i in range(n_prompts)))
    bad = [r.error for r in results if r.error]
    if bad:
        raise RuntimeError(f"reference run failed: {bad[0]}")
    return {r.prompt: r for r in results}


def compare_ids(ref: Sequence[int], got: Sequence[int]) -> dict[str, int]:
    """Align `got` with `ref` (difflib): tokens of ref missing in got are lost, extra tokens in
    got are duplicated, tokens replaced by others are mismatched; `first_divergence` is the
    index in `got` where they first differ (-1: identical). The one token comparison of the
    tree: a positional one would count one lost token as every later token mismatched."""
    if list(ref) == list(got):
        return {"lost": 0, "duplicated": 0, "mismatched": 0, "first_divergence": -1}
    lost = dup = mis = 0
    sm = difflib.SequenceMatcher(None, list(ref), list(got), autojunk=False)
    first = -1
    for op, i1, i2, j1, j2 in sm.get_opcodes():
        if op == "equal":
            continue
        if first < 0:
            first = j1
        a, b = i2 - i1, j2 - j1
        if op == "delete":
            lost += a
        elif op == "insert":
            dup += b
        else:
            mis += min(a, b)
            lost += max(0, a - b)
            dup += max(0, b - a)
    return {"lost": lost, "duplicated": dup, "mismatched": mis, "first_divergence": first}


def text_diff(expected: str, got: str) -> dict[str, Any] | None:
    """None if equal, else where the text first differs and a little of each side."""
    if expected == got:
        return None
    i = next((k for k, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    return {"first_difference": i, "expected_len": len(expected), "got_len": len(got),
            "expected": expected[max(0, i - 20):i + 40], "got": got[max(0, i - 20):i + 40]}


def start_offsets(concurrency: int, stagger_s: float) -> list[float]:
    """When each of `concurrency` clients sends its first request (seconds after the first):
    spread evenly over `stagger_s`, one request's length, so the streams in flight at any
    instant are at every point of their requests. Clients that all start at once stay in step
    (every request has the same length, ignore_eos): they end together, and for the moment
    before their next requests nothing is in flight (a handoff switching then moves nothing)."""
    step = max(0.0, stagger_s) / max(1, concurrency)
    return [round(c * step, 6) for c in range(concurrency)]


def request_s(ref: Reference) -> float:
    """The mean length of the reference's requests (send to last token): one request's time."""
    spans = [r.times[-1] - r.times[0] for r in ref.values() if len(r.times) > 1]
    return statistics.fmean(spans) if spans else 0.0


class Load:
    """`concurrency` clients, each streaming its own prompt again and again until stopped.
    Runs its own event loop on a thread, so sync code (CLI, tests, actors) can drive it."""

    def __init__(self, url: str, model: str, ref: Reference, max_tokens: int,
                 concurrency: int = 8, stagger_s: float = 0.0, prompts: Sequence[str] | None = None) -> None:
        self.url, self.model, self.ref = url, model, ref
        #: what prompt i is (i modulo its length): the list the reference ran (None: PROMPTS)
        self.prompts = list(prompts or PROMPTS)
        self.max_tokens, self.concurrency = max_tokens, concurrency
        #: client c sends its first request c * stagger_s / concurrency after the first (0: all
        #: at once, and then, every request of the same length, they end and start together)
        self.stagger_s = stagger_s
        self.results: list[RequestResult] = []
        self.request_timeout_s = 120.0  # a request stuck this long counts as a client error
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.started = 0.0

    def start(self) -> "Load":
        self.started = time.monotonic()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()
        return self

    def in_flight(self) -> int:
        return sum(1 for r in list(self.results) if r.finish_reason is None and not r.error)

    async def _main(self) -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=client_headers()) as s:
            async def client(c: int) -> None:
                # the prompt the reference ran as that index (fewer reference prompts than
                # clients: clients share them, and each must send the prompt it is checked against)
                idx = c % len(self.ref)
                await asyncio.sleep(start_offsets(self.concurrency, self.stagger_s)[c])
                while not self._stop.is_set():
                    res_task = asyncio.ensure_future(stream_once(
                        s, self.url, self.model, self.prompts[idx % len(self.prompts)], self.max_tokens, client=c,
                        prompt_idx=idx, timeout=self.request_timeout_s))
                    res = await res_task
                    self.results.append(res)
                    if res.error:
                        await asyncio.sleep(0.2)

            await asyncio.gather(*(client(c) for c in range(self.concurrency)))

    def stop(self, timeout: float = 300.0) -> None:
        """Let every stream in flight finish, then stop."""
        self._stop.set()
        if self._thread:
            self._thread.join(timeout)

    def report(self, window: tuple[float, float] | None = None) -> dict[str, Any]:
        """Figures over every completed request; `window` (monotonic start, end) of the
        relocation: `blackout_max_s` is the longest wait any client saw overlapping it."""
        totals = {"lost": 0, "duplicated": 0, "mismatched": 0}
        text_mismatched = 0
        text_bad: list[dict[str, Any]] = []
        errors: list[str] = []
        clients: dict[int, dict[str, Any]] = {}
        blackout = normal = 0.0
        before: list[float] = []  # the gaps before the move: the load's normal inter-token pace
        span: list[float] = []  # (start, end) of the blackout's gap, monotonic
        long_gaps: list[tuple[float, float, float]] = []  # (length, start, end) within the window
        for r in self.results:
            c = clients.setdefault(r.client, {"client": r.client, "requests": 0, "tokens": 0, "max_gap_s": 0.0,
                                              "errors": 0, "verified": 0})
            c["requests"] += 1
            c["tokens"] += len(r.tokens)
            if r.error:
                c["errors"] += 1
                errors.append(r.error)
                continue
            want = self.ref[r.prompt]
            diff = compare_ids(want.tokens, r.tokens)
            for k in totals:
                totals[k] += diff[k]
            text = text_diff(want.text, r.text)
            if text:
                text_mismatched += 1
                if len(text_bad) < 5:
                    text_bad.append({"client": r.client, "prompt": r.prompt, **text})
            if diff["first_divergence"] < 0 and not text:
                c["verified"] += 1
            for a, b in r.gaps():
                c["max_gap_s"] = max(c["max_gap_s"], b - a)
                if window and a <= window[1] and b >= window[0]:
                    long_gaps.append((b - a, a, b))
                    if b - a > blackout:
                        blackout, span = b - a, [a, b]
                elif window and b < window[0]:  # before the move: the load's normal gaps
                    normal = max(normal, b - a)
                    before.append(b - a)
        for c in clients.values():
            c["max_gap_s"] = round(c["max_gap_s"], 4)
        return {"requests": len(self.results), "tokens": sum(len(r.tokens) for r in self.results),
                "tokens_lost": totals["lost"], "tokens_duplicated": totals["duplicated"],
                "tokens_mismatched": totals["mismatched"], "text_mismatched": text_mismatched,
                "text_bad": text_bad, "client_errors": len(errors),
                "errors": errors[:5], "blackout_max_s": round(blackout, 4), "blackout_span": span,
                "normal_gap_max_s": round(normal, 4),
                # the mean gap before the move (events read in one burst have gaps of 0, so the
                # median is 0): the "normal inter-token gap"
                "normal_gap_mean_s": round(statistics.fmean(before), 4) if before else None,
                # the longest gaps overlapping the window: [start, end] (where each phase's lies;
                # enough of them that a short phase's, SWITCH's, is among them beside a long RESTORE)
                "long_gaps": [[a, b] for _, a, b in sorted(long_gaps, reverse=True)[:LONG_GAPS]],
                "clients": [clients[k] for k in sorted(clients)]}


def first_token_s(url: str, model: str, timeout: float = 60.0) -> float:
    """Seconds from sending a request to its first token (cold-start measurements)."""
    async def go() -> float:
        async with aiohttp.ClientSession(headers=client_headers()) as s:
            r = await stream_once(s, url, model, PROMPTS[0], 4, timeout=timeout)
            if r.error or len(r.times) < 2:
                raise RuntimeError(f"no first token from {url}: {r.error}")
            return r.times[1] - r.times[0]

    return asyncio.run(go())
