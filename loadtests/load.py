"""An async streaming load generator speaking the OpenAI API over HTTP (aiohttp).

Closed loop: `concurrency` streams, each sends its next request as soon as the previous one
ends, until `requests` have been sent or `duration_s` has passed (or `stop` is set). The
request mix is a deterministic list of `RequestSpec`s built from the config (prompt and output
lengths, chat vs completions, greedy vs seeded sampling); request *i* uses spec
`specs[order[i]]`, the order itself drawn from the config's seed.

Per request: TTFT (send -> first token), inter-token gaps (between SSE events that carry
tokens), total time, token ids (always asked for: `return_token_ids: true`), errors (HTTP
status, error events, streams that end without `data: [DONE]`, connection errors).

Greedy requests are checked token by token against a reference (`make_reference` runs every
greedy spec once, directly against a backend; or a file from `save_reference`):
`check_tokens` aligns received ids with reference ids and counts lost, duplicated and
mismatched tokens, and compares each request's concatenated text with the reference's (what
users read: a stream can carry the right ids and the wrong text); text mismatches are counted
apart.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import aiohttp

from relocator.cluster.streams import compare_ids, text_diff
from relocator.router import sse
from relocator.router.auth import client_headers

_WORDS = ("the quick brown fox jumps over a lazy dog while seven tall ships sail past "
          "green hills under silver clouds and every small river runs toward the sea").split()

Phase = tuple[str, float, float]


# ---- request mix ------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestSpec:
    kind: str  # "completions" | "chat"
    prompt: str
    max_tokens: int
    greedy: bool = True
    seed: int | None = None
    temperature: float = 0.0
    ignore_eos: bool = True
    extra: tuple[tuple[str, Any], ...] = ()

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"

    def body(self, model: str) -> dict[str, Any]:
        b: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens, "stream": True,
                             "stream_options": {"include_usage": True},
                             "return_token_ids": True,
                             "temperature": 0.0 if self.greedy else self.temperature}
        if self.kind == "chat":
            b["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            b["prompt"] = self.prompt
        if self.ignore_eos:
            b["ignore_eos"] = True
        if not self.greedy:
            b["top_p"] = 0.95
            if self.seed is not None:
                b["seed"] = self.seed
        b.update(dict(self.extra))
        return b

    @property
    def key(self) -> str:
        """Identifies the request for the reference: everything but the model name."""
        d = {"kind": self.kind, "prompt": self.prompt, "max_tokens": self.max_tokens,
             "greedy": self.greedy, "seed": self.seed, "temperature": self.temperature,
             "ignore_eos": self.ignore_eos, "extra": [list(x) for x in self.extra]}
        return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _ints(v: int | Sequence[int]) -> list[int]:
    return [int(v)] if isinstance(v, (int, float)) else [int(x) for x in v]


@dataclass
class LoadConfig:
    url: str  # base URL of the router (or any OpenAI-compatible server)
    model: str | None = None  # None: the first of GET /v1/models
    concurrency: int = 8
    requests: int | None = None  # stop after this many requests ...
    duration_s: float | None = None  # ... or after this many seconds (both: whichever first)
    prompt_words: Sequence[int] = (16, 64)  # prompt lengths, in words, drawn per spec
    output_tokens: Sequence[int] = (32, 128)  # max_tokens, drawn per spec
    chat_fraction: float = 0.5
    greedy_fraction: float = 0.75  # the rest: temperature > 0 with a fixed per-spec seed
    temperature: float = 0.8
    distinct: int = 16  # distinct request specs in the mix
    seed: int = 0
    ignore_eos: bool = True  # vLLM: fixed output lengths
    request_timeout_s: float = 300.0
    api_key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    keep_token_ids: bool = True  # keep every request's ids in the report (needed for checks)
    specs: list[RequestSpec] | None = None  # explicit mix instead of the generated one

    def __post_init__(self) -> None:
        if self.requests is None and self.duration_s is None:
            self.requests = 32
        if self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        self.url = self.url.rstrip("/")


def build_specs(cfg: LoadConfig) -> list[RequestSpec]:
    if cfg.specs:
        return list(cfg.specs)
    rng = random.Random(cfg.seed)
    plens, olens = _ints(cfg.prompt_words), _ints(cfg.output_tokens)
    specs = []
    for i in range(max(1, cfg.distinct)):
        n = rng.choice(plens)
        words = [rng.choice(_WORDS) for _ in range(max(1, n))]
        greedy = rng.random() < cfg.greedy_fraction
        specs.append(RequestSpec(
            kind="chat" if rng.random() < cfg.chat_fraction else "completions",
            prompt=f"[{i}] " + " ".join(words), max_tokens=rng.choice(olens), greedy=greedy,
            seed=None if greedy else rng.randrange(1 << 31),
            temperature=0.0 if greedy else cfg.temperature, ignore_eos=cfg.ignore_eos))
    return specs


# ---- results ------------------------------------------------------------------------------
@dataclass
class RequestResult:
    index: int
    stream: int  # which of the concurrent streams sent it
    spec_key: str
    kind: str
    greedy: bool
    start: float  # seconds since the run started
    ttft: float | None = None
    total: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    token_ids: list[int] | None = None
    text: str = ""  # the concatenated text received
    token_times: list[tuple[float, int]] = field(default_factory=list)  # (t since run start, n)
    status: int | None = None
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class TokenCheck:
    checked: int = 0  # greedy requests with a reference entry
    exact: int = 0
    unchecked: int = 0  # greedy requests without a reference entry
    tokens_expected: int = 0
    tokens_lost: int = 0
    tokens_duplicated: int = 0
    tokens_mismatched: int = 0
    texts_checked: int = 0  # requests whose text was compared (the reference has text)
    text_mismatched: int = 0  # requests whose concatenated text differs from the reference's
    bad: list[dict[str, Any]] = field(default_factory=list)  # details of the first bad ones
    text_bad: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.checked > 0 and not (self.tokens_lost or self.tokens_duplicated
                                         or self.tokens_mismatched or self.text_mismatched)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        return d


def _pct(xs: Sequence[float], p: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)


def _phase_rel(phases: Iterable[Sequence[Any]] | None, t0: float) -> list[Phase]:
    """Phases as (name, start, end) in seconds since the run started. Values above 1e9 are
    taken as Unix times (time.time()) and converted."""
    out = []
    for p in phases or []:
        name, a, b = str(p[0]), float(p[1]), float(p[2])
        if a > 1e9:
            a -= t0
        if b > 1e9:
            b -= t0
        out.append((name, a, b))
    return out


@dataclass
class LoadReport:
    config: dict[str, Any]
    started_at: float  # Unix time of the run start (time.time())
    duration_s: float
    results: list[RequestResult]
    token_check: TokenCheck | None = None
    phases: list[Phase] = field(default_factory=list)

    # -- figures --
    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.results if r.ok]
        ttft = [r.ttft for r in ok if r.ttft is not None]
        gaps = [g for r in ok for g in r.gaps]
        total = [r.total for r in ok if r.total is not None]
        toks = sum(r.tokens for r in self.results)
        errs: dict[str, int] = {}
        for r in self.results:
            if r.error:
                k = r.error.split(":")[0][:60]
                errs[k] = errs.get(k, 0) + 1
        s: dict[str, Any] = {
            "requests": len(self.results), "ok": len(ok),
            "failed_requests": len(self.results) - len(ok), "errors": errs,
            "tokens": toks, "duration_s": round(self.duration_s, 3),
            "tokens_per_s": round(toks / self.duration_s, 1) if self.duration_s else None,
            "requests_per_s": round(len(self.results) / self.duration_s, 2)
            if self.duration_s else None,
            "ttft_ms": {f"p{p}": _ms(_pct(ttft, p)) for p in (50, 90, 99)},
            "itl_ms": {**{f"p{p}": _ms(_pct(gaps, p)) for p in (50, 90, 99)},
                       "max": _ms(max(gaps) if gaps else None)},
            "total_ms": {f"p{p}": _ms(_pct(total, p)) for p in (50, 90, 99)},
        }
        if self.token_check is not None:
            tc = self.token_check
            s.update(tokens_checked_requests=tc.checked, tokens_lost=tc.tokens_lost,
                     tokens_duplicated=tc.tokens_duplicated,
                     tokens_mismatched=tc.tokens_mismatched,
                     texts_checked_requests=tc.texts_checked, text_mismatched=tc.text_mismatched)
        return s

    def to_dict(self, with_requests: bool = True) -> dict[str, Any]:
        d: dict[str, Any] = {"config": self.config, "started_at": self.started_at,
                             "summary": self.summary(),
                             "phases": [list(p) for p in self.phases],
                             "token_check": self.token_check.to_dict()
                             if self.token_check else None}
        if with_requests:
            d["requests"] = [asdict(r) for r in self.results]
        return d

    def write_json(self, path: str | Path, with_requests: bool = True) -> None:
        Path(path).write_text(json.dumps(self.to_dict(with_requests), default=str))

    def table(self):  # -> rich.table.Table
        from rich.table import Table

        s = self.summary()
        t = Table(title=f"load: {s['requests']} requests, {self.config.get('concurrency')} "
                        f"streams, {s['duration_s']} s")
        t.add_column("metric")
        t.add_column("value", justify="right")
        t.add_row("ok / failed", f"{s['ok']} / {s['failed_requests']}")
        for k, v in s["errors"].items():
            t.add_row(f"  error {k}", str(v))
        t.add_row("tokens, tokens/s", f"{s['tokens']}, {s['tokens_per_s']}")
        t.add_row("requests/s", str(s["requests_per_s"]))
        for name in ("ttft_ms", "itl_ms", "total_ms"):
            t.add_row(name.replace("_ms", " ms") + " p50/p90/p99" +
                      ("/max" if name == "itl_ms" else ""),
                      " / ".join(str(v) for v in s[name].values()))
        if self.token_check is not None:
            tc = self.token_check
            t.add_row("token check: requests (exact)", f"{tc.checked} ({tc.exact})"
                      + (f", {tc.unchecked} without reference" if tc.unchecked else ""))
            style = "green" if tc.ok else "bold red"
            t.add_row("lost / duplicated / mismatched",
                      f"[{style}]{tc.tokens_lost} / {tc.tokens_duplicated} / "
                      f"{tc.tokens_mismatched}[/]")
            t.add_row("texts differing (of checked)",
                      f"[{style}]{tc.text_mismatched}[/] ({tc.texts_checked})")
        for name, a, b in self.phases:
            t.add_row(f"phase {name}", f"{a:.2f}-{b:.2f} s")
        return t

    def write_png(self, path: str | Path, phases: Iterable[Sequence[Any]] | None = None,
                  bin_s: float | None = None) -> Path:
        """Token rate per stream over time (heat map, one row per concurrent stream), the
        total token rate above it, failed requests marked, relocation phases shaded."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np

        ph = self.phases + _phase_rel(phases, self.started_at)
        end = max([self.duration_s] + [b for _, _, b in ph] + [0.1])
        bin_s = bin_s or max(0.05, end / 200)
        nb = int(math.ceil(end / bin_s)) + 1
        nstreams = max([r.stream for r in self.results] + [0]) + 1
        grid = np.zeros((nstreams, nb))
        for r in self.results:
            for t, n in r.token_times:
                grid[r.stream, min(nb - 1, max(0, int(t / bin_s)))] += n
        grid /= bin_s
        xs = np.arange(nb) * bin_s
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True,
                                       gridspec_kw={"height_ratios": [1, 2]})
        ax1.plot(xs, grid.sum(axis=0), lw=1)
        ax1.set_ylabel("tokens/s (all)")
        im = ax2.imshow(grid, aspect="auto", origin="lower", interpolation="nearest",
                        extent=(0, nb * bin_s, -0.5, nstreams - 0.5), cmap="viridis")
        fig.colorbar(im, ax=ax2, label="tokens/s", pad=0.01)
        ax2.set_ylabel("stream")
        ax2.set_xlabel("seconds since start")
        fails = [(r.start + (r.total or 0), r.stream) for r in self.results if not r.ok]
        if fails:
            ax2.scatter(*zip(*fails), marker="x", color="red", s=30, label="failed request")
            ax2.legend(loc="upper right", fontsize=8)
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for i, (name, a, b) in enumerate(ph):
            c = colors[(i + 1) % len(colors)]
            for ax in (ax1, ax2):
                ax.axvspan(a, max(b, a + bin_s / 4), color=c, alpha=0.25, lw=0)
            for x in (a, b):
                ax2.axvline(x, color=c, ls="--", lw=1)
            ax1.text(a, 1.0, name, transform=ax1.get_xaxis_transform(), fontsize=7,
                     rotation=45, va="bottom", ha="left")
        s = self.summary()
        title = (f"{s['requests']} requests, {s['failed_requests']} failed, "
                 f"{s['tokens_per_s']} tok/s")
        if self.token_check is not None:
            tc = self.token_check
            title += (f"; tokens lost/dup/mismatched {tc.tokens_lost}/{tc.tokens_duplicated}/"
                      f"{tc.tokens_mismatched}")
        fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return Path(path)


# ---- one streamed request -----------------------------------------------------------------
def _event_tokens(ev: dict[str, Any], kind: str) -> tuple[list[int] | None, int, str | None,
                                                         str]:
    """(token ids or None, tokens counted, finish_reason, text) for one parsed SSE chunk."""
    ids: list[int] = []
    have_ids = False
    n = 0
    fin = None
    text = ""
    for ch in ev.get("choices") or []:
        piece = (ch.get("delta") or {}).get("content") if kind == "chat" else ch.get("text")
        text += piece or ""
        t = ch.get("token_ids")
        if isinstance(t, list):
            have_ids = True
            ids.extend(t)
            n += len(t)
        elif piece:
            n += 1
        fin = ch.get("finish_reason") or fin
    return (ids if have_ids else None), n, fin, text


async def _one(session: aiohttp.ClientSession, cfg: LoadConfig, model: str, spec: RequestSpec,
               res: RequestResult, t0: float) -> None:
    body = spec.body(model)
    headers = dict(cfg.headers)
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    sent = time.perf_counter()
    last_tok: float | None = None
    ids: list[int] = []
    done = False
    try:
        async with session.post(cfg.url + spec.path, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=cfg.request_timeout_s)) as r:
            res.status = r.status
            if r.status != 200:
                txt = (await r.read())[:300].decode(errors="replace")
                res.error = f"http {r.status}: {txt}"
                return
            async for payload in sse.read(r.content.iter_any()):
                now = time.perf_counter()
                if payload == sse.DONE_PAYLOAD:
                    done = True
                    continue
                ev = sse.json_object(payload)
                if ev is None:
                    res.error = "bad event: " + payload[:100].decode(errors="replace")
                    continue
                if "error" in ev:
                    e = ev["error"]
                    res.error = f"error event {e.get('code')}: {e.get('message')}"[:300] \
                        if isinstance(e, dict) else f"error event: {e}"[:300]
                    continue
                tids, n, fin, text = _event_tokens(ev, spec.kind)
                res.text += text
                if fin:
                    res.finish_reason = fin
                if tids:
                    ids.extend(tids)
                if n:
                    if last_tok is None:
                        res.ttft = now - sent
                    else:
                        res.gaps.append(now - last_tok)
                    last_tok = now
                    res.tokens += n
                    res.token_times.append((now - t0, n))
            if not done and res.error is None:
                res.error = "incomplete: stream ended without [DONE]"
    except asyncio.TimeoutError:
        res.error = f"timeout: no completion within {cfg.request_timeout_s:g} s"
    except aiohttp.ClientError as e:
        res.error = f"connection: {type(e).__name__}: {e}"[:300]
    finally:
        res.total = time.perf_counter() - sent
        if cfg.keep_token_ids or spec.greedy:
            res.token_ids = ids


async def _resolve_model(session: aiohttp.ClientSession, cfg: LoadConfig) -> str:
    if cfg.model:
        return cfg.model
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    async with session.get(cfg.url + "/v1/models", headers=headers) as r:
        data = await r.json()
    return data["data"][0]["id"]


async def run_load(cfg: LoadConfig, stop: asyncio.Event | None = None,
                   phases: Iterable[Sequence[Any]] | None = None) -> LoadReport:
    """Run the load; returns when `requests` were sent and answered, `duration_s` passed
    (requests in flight then are finished, not cut), or `stop` was set."""
    specs = build_specs(cfg)
    rng = random.Random(cfg.seed + 1)
    results: list[RequestResult] = []
    counter = 0
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    # RELOCATOR_API_KEY unless cfg.api_key (sent per request) says otherwise
    async with aiohttp.ClientSession(connector=conn, headers=client_headers()) as session:
        model = await _resolve_model(session, cfg)
        started_at = time.time()
        t0 = time.perf_counter()
        deadline = t0 + cfg.duration_s if cfg.duration_s is not None else math.inf

        async def stream(k: int) -> None:
            nonlocal counter
            while True:
                if stop is not None and stop.is_set():
                    return
                if time.perf_counter() >= deadline:
                    return
                if cfg.requests is not None and counter >= cfg.requests:
                    return
                i = counter
                counter += 1
                spec = specs[rng.randrange(len(specs))]
                res = RequestResult(index=i, stream=k, spec_key=spec.key, kind=spec.kind,
                                    greedy=spec.greedy, start=time.perf_counter() - t0)
                results.append(res)
                await _one(session, cfg, model, spec, res, t0)

        await asyncio.gather(*(stream(k) for k in range(cfg.concurrency)))
        dur = time.perf_counter() - t0
    conf = {k: v for k, v in asdict(cfg).items() if k not in ("specs", "api_key", "headers")}
    conf["model"] = model
    conf["specs"] = [dict(asdict(s), key=s.key) for s in specs]
    results.sort(key=lambda r: r.index)
    return LoadReport(config=conf, started_at=started_at, duration_s=dur, results=results,
                      phases=_phase_rel(phases, started_at))


# ---- reference and token check ------------------------------------------------------------
class Reference(dict):
    """{spec key: token ids} of uninterrupted runs, with `.text` {spec key: text}."""

    def __init__(self, ids: dict[str, list[int]] | None = None,
                 text: dict[str, str] | None = None) -> None:
        super().__init__(ids or {})
        self.text: dict[str, str] = dict(text or {})


async def make_reference(cfg: LoadConfig, url: str | None = None,
                         concurrency: int = 4) -> Reference:
    """Run every greedy spec of the mix once against `url` (default cfg.url: point it at a
    backend directly, not through the router) and return their ids and text."""
    specs = [s for s in build_specs(cfg) if s.greedy]
    base = (url or cfg.url).rstrip("/")
    c = LoadConfig(**{**{k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
                      "url": base, "specs": specs})
    ref = Reference()
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as session:
        model = await _resolve_model(session, c)

        async def one(s: RequestSpec) -> None:
            async with sem:
                r = RequestResult(index=0, stream=0, spec_key=s.key, kind=s.kind, greedy=True,
                                  start=0.0)
                await _one(session, c, model, s, r, time.perf_counter())
                if r.error:
                    raise RuntimeError(f"reference request failed: {r.error}")
                ref[s.key] = r.token_ids or []
                ref.text[s.key] = r.text

        await asyncio.gather(*(one(s) for s in specs))
    return ref


def save_reference(ref: dict[str, list[int]], path: str | Path) -> None:
    Path(path).write_text(json.dumps({"version": 2, "token_ids": dict(ref),
                                      "text": getattr(ref, "text", {})}, ensure_ascii=False))


def load_reference(path: str | Path) -> Reference:
    d = json.loads(Path(path).read_text())
    if "token_ids" in d:
        return Reference(d["token_ids"], d.get("text"))  # version 1 has no text
    return Reference(d)


def check_tokens(report: LoadReport, reference: dict[str, list[int]] | str | Path,
                 max_details: int = 20) -> TokenCheck:
    """Compare every greedy request's ids (failed ones too: what they did not get is lost)
    with the reference; stores the result in `report.token_check` and returns it."""
    ref = load_reference(reference) if isinstance(reference, (str, Path)) else reference
    texts: dict[str, str] = getattr(ref, "text", {})
    tc = TokenCheck()
    for r in report.results:
        if not r.greedy:
            continue
        want = ref.get(r.spec_key)
        if want is None:
            tc.unchecked += 1
            continue
        tc.checked += 1
        tc.tokens_expected += len(want)
        c = compare_ids(want, r.token_ids or [])
        tc.tokens_lost += c["lost"]
        tc.tokens_duplicated += c["duplicated"]
        tc.tokens_mismatched += c["mismatched"]
        want_text = texts.get(r.spec_key)
        text = text_diff(want_text, r.text) if want_text is not None else None
        if want_text is not None:
            tc.texts_checked += 1
        if text:
            tc.text_mismatched += 1
            if len(tc.text_bad) < max_details:
                tc.text_bad.append({"index": r.index, "spec_key": r.spec_key, "error": r.error,
                                    **text})
        if c["first_divergence"] < 0:
            tc.exact += 1
        elif len(tc.bad) < max_details:
            tc.bad.append({"index": r.index, "spec_key": r.spec_key, "error": r.error, **c,
                           "expected": len(want), "got": len(r.token_ids or [])})
    report.token_check = tc
    return tc
