"""Bad input and abuse against the router and its control API: malformed bodies, huge headers,
slow clients that trickle bytes, slow readers, idle connections and random disconnects.

Measures the router process's open file descriptors and RSS (psutil) before, and after
each round; reports a crash (process gone or /health not answering), a leak (fds not back to
baseline within a tolerance, RSS still growing in the last round), any 5xx the router itself
gives to bad input, any case that hangs, and in-flight counts that do not return to zero.

Safety: every target must resolve to a loopback address (refused otherwise); every loop is
bounded in count and time; the control API only gets invalid bodies and unknown workers, so
the routing table is never changed.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import random
import re
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable
from urllib.parse import urlsplit

import aiohttp
import psutil

from adapters.codec import CHAT_SAMPLING_KEYS
from relocator.waits import WaitTimeout, until_async


# ---- safety and process facts -------------------------------------------------------------
def loopback_target(url: str) -> tuple[str, int]:
    u = urlsplit(url)
    if u.scheme != "http" or not u.hostname:
        raise ValueError(f"{url}: only http://<loopback>:<port> targets are allowed")
    port = u.port or 80
    addrs = {ai[4][0] for ai in socket.getaddrinfo(u.hostname, port, proto=socket.IPPROTO_TCP)}
    if not addrs or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        raise ValueError(f"{url}: resolves to {sorted(addrs)}, not loopback; refusing")
    return sorted(addrs)[0], port


def listener_pid(port: int, host: str | None = "127.0.0.1") -> int | None:
    """PID of the process holding a listening TCP socket on `host`:`port`.

    The address matters: a port the kernel handed out on 127.0.0.1 may also be listened on by
    an unrelated process on another loopback address or on ::1 (a CI run found one). A
    wildcard listener (0.0.0.0, ::) counts for any host; `host=None` matches every address.
    Read from /proc, not psutil.net_connections: that names one process per socket (the last
    pid it scans), so with a socket shared by parent and child it named the parent once pids
    had wrapped around (a CI run)."""
    addrs = None if host is None else {host, "0.0.0.0", "::"}
    inodes = _listening_inodes(port, addrs)
    holders = sorted({pid for pid, inode in _socket_holders() if inode in inodes})
    if len(holders) > 1:
        # an inherited socket (the cluster daemon owns the router's listener and passes it to
        # the router child, which may pass it on to a child of its own): the server is the
        # holder whose parent holds it and whose grandparent does not
        held = set(holders)
        servers = [h for h in holders if _ppid(h) in held and _ppid(_ppid(h)) not in held]
        holders = servers or holders
    return holders[0] if holders else None


def _listening_inodes(port: int, addrs: set[str] | None) -> set[str]:
    """Socket inodes of TCP listeners on `port` (at one of `addrs`, or any), from /proc/net."""
    found: set[str] = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            local, state, inode = f[1], f[3], f[9]
            hex_ip, hex_port = local.split(":")
            if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            if addrs is None or _proc_net_ip(hex_ip, family) in addrs:
                found.add(inode)
    return found


def _proc_net_ip(hex_ip: str, family: int) -> str:
    """/proc/net/tcp* print addresses as host-order 32-bit words in hex."""
    raw = b"".join(struct.pack("<I", int(hex_ip[i:i + 8], 16)) for i in range(0, len(hex_ip), 8))
    return str(ipaddress.ip_address(raw)) if family == socket.AF_INET6 else socket.inet_ntoa(raw)


def _socket_holders():
    """(pid, socket inode) for every socket file descriptor of every process we can read."""
    for pid in psutil.pids():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                yield pid, link[8:-1]


def _ppid(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


def proc_stats(pid: int) -> dict[str, Any] | None:
    """The open file descriptors and RSS of a live process; None: gone (or a zombie)."""
    try:
        p = psutil.Process(pid)
        if p.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return None
        return {"fds": p.num_fds(), "rss_mb": round(p.memory_info().rss / 2**20, 1)}
    except psutil.Error:
        return None


# ---- raw HTTP -----------------------------------------------------------------------------
_STATUS = re.compile(rb"^HTTP/1\.[01] (\d{3})")


async def raw_http(host: str, port: int, data: bytes, timeout: float = 5.0,
                   read_limit: int = 1 << 16) -> tuple[int | None, bytes]:
    """Send bytes, read the answer (up to read_limit or EOF). Status None: the server closed
    without an HTTP answer. Raises asyncio.TimeoutError if nothing ends within timeout."""
    r, w = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        try:
            w.write(data)
            await w.drain()
        except (ConnectionError, OSError):
            pass  # the server may close early on garbage; read what it said
        buf = b""
        end = time.monotonic() + timeout
        while len(buf) < read_limit:
            left = end - time.monotonic()
            if left <= 0:
                raise asyncio.TimeoutError
            try:
                chunk = await asyncio.wait_for(r.read(8192), left)
            except (ConnectionError, OSError):
                break
            if not chunk:
                break
            buf += chunk
            m = _STATUS.match(buf)
            if m and b"\r\n\r\n" in buf and _complete(buf):
                break
        m = _STATUS.match(buf)
        return (int(m.group(1)) if m else None), buf
    finally:
        w.close()


def _complete(buf: bytes) -> bool:
    head, _, body = buf.partition(b"\r\n\r\n")
    m = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    if m:
        return len(body) >= int(m.group(1))
    if re.search(rb"(?im)^transfer-encoding:\s*chunked", head):
        return body.endswith(b"0\r\n\r\n")
    return False


def _req(method: str, path: str, host: str, body: bytes | None = None,
         headers: dict[str, str] | None = None, ctype: str = "application/json") -> bytes:
    h = {"Host": host, "Connection": "close"}
    if body is not None:
        h["Content-Type"] = ctype
        h["Content-Length"] = str(len(body))
    h.update(headers or {})
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items())
    return head.encode("latin-1") + b"\r\n" + (body or b"")


def _abort(w: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0), like a client that vanished."""
    sock = w.get_extra_info("socket")
    try:
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    w.transport.abort()


# ---- the pass -----------------------------------------------------------------------------
@dataclass
class AbuseConfig:
    router: str = "http://127.0.0.1:8000"
    control: str | None = None
    token: str | None = None
    pid: int | None = None
    model: str | None = None
    rounds: int = 2
    scale: float = 1.0  # multiplies counts and slow-client durations
    fd_tolerance: int = 4
    rss_tolerance_mb: float = 32.0
    case_timeout_s: float = 5.0
    slow_s: float = 3.0  # how long trickling / idle / non-reading clients hang on
    settle_s: float = 10.0  # how long to wait for fds and in-flight counts to come back
    seed: int = 0
    time_budget_s: float = 300.0  # the whole pass stops starting new sections after this

    def n(self, k: int) -> int:
        return max(1, int(round(k * self.scale)))


@dataclass
class _Ctx:
    cfg: AbuseConfig
    host: str
    port: int
    hosthdr: str
    chost: str | None
    cport: int | None
    model: str
    rng: random.Random
    findings: list[dict[str, Any]] = field(default_factory=list)
    cases: int = 0
    statuses: dict[str, dict[str, int]] = field(default_factory=dict)

    def note(self, section: str, status: int | None) -> None:
        self.cases += 1
        d = self.statuses.setdefault(section, {})
        k = str(status) if status is not None else "closed"
        d[k] = d.get(k, 0) + 1

    def finding(self, section: str, case: str, what: str) -> None:
        for f in self.findings:
            if (f["section"], f["case"], f["what"]) == (section, case, what):
                f["count"] += 1
                return
        self.findings.append({"section": section, "case": case, "what": what, "count": 1})

    def ctl_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.cfg.token}"} if self.cfg.token else {}


async def _case(ctx: _Ctx, section: str, name: str, host: str, port: int, data: bytes,
                ok: Callable[[int | None], bool], router_made: bool = True) -> None:
    try:
        st, buf = await raw_http(host, port, data, ctx.cfg.case_timeout_s)
    except asyncio.TimeoutError:
        ctx.note(section, -1)
        ctx.finding(section, name, f"no answer within {ctx.cfg.case_timeout_s:g} s")
        return
    except (ConnectionError, OSError) as e:
        ctx.note(section, None)
        ctx.finding(section, name, f"connect failed: {e}")
        return
    ctx.note(section, st)
    if not ok(st):
        snippet = buf.split(b"\r\n\r\n", 1)[-1][:160].decode(errors="replace")
        what = f"status {st}" + (" (router-made)" if router_made else "") + f": {snippet}"
        ctx.finding(section, name, what)


def _is4xx(st: int | None) -> bool:
    return st is not None and 400 <= st < 500


def _4xx_or_closed(st: int | None) -> bool:
    return st is None or 400 <= st < 500


def _not5xx(st: int | None) -> bool:
    return st is None or st < 500


def _malformed_bodies(model: str) -> list[tuple[str, bytes]]:
    deep = b"[" * 100_000 + b"]" * 100_000
    return [
        ("empty", b""),
        ("truncated", b'{"model": "' + model.encode() + b'", "prompt": "x"'),
        ("not-json", b"hello there"),
        ("array", b"[]"), ("number", b"1"), ("null", b"null"), ("string", b'"s"'),
        ("nan", b'{"model": NaN}'),
        ("model-int", b'{"model": 1, "prompt": "x"}'),
        ("model-empty", b'{"model": "", "prompt": "x"}'),
        ("model-unknown", b'{"model": "no-such-model-abuse", "prompt": "x", "stream": true}'),
        ("model-huge", json.dumps({"model": "m" * 200_000, "prompt": "x"}).encode()),
        ("no-prompt", json.dumps({"model": model}).encode()),
        ("bad-utf8", b'{"model": "\xff\xfe", "prompt": "x"}'),
        ("nul-bytes", b'{"model": "a\x00b", "prompt": "\x00"}'),
        ("deep-nesting", b'{"model": "x", "prompt": ' + deep + b"}"),
        ("dup-keys", b'{"model": "no-such", "model": 5, "prompt": "x"}'),
    ]


async def sec_malformed(ctx: _Ctx) -> None:
    """Bodies the router must refuse itself (4xx), on both endpoints; then a body over the
    size limit and a lying Content-Length."""
    h, p = ctx.host, ctx.port
    for path in ("/v1/completions", "/v1/chat/completions"):
        for name, body in _malformed_bodies(ctx.model):
            await _case(ctx, "malformed", f"{path} {name}", h, p,
                        _req("POST", path, ctx.hosthdr, body), _is4xx)
    big = b'{"model": "x", "prompt": "' + b"a" * (8 << 20) + b'"}'
    await _case(ctx, "malformed", "8 MiB body", h, p,
                _req("POST", "/v1/completions", ctx.hosthdr, big), _4xx_or_closed)
    for name, hdrs in [("content-length 1e12", {"Content-Length": str(10 ** 12)}),
                       ("content-length -1", {"Content-Length": "-1"}),
                       ("content-length junk", {"Content-Length": "12abc"}),
                       ("cl+te smuggling", {"Transfer-Encoding": "chunked"})]:
        data = _req("POST", "/v1/completions", ctx.hosthdr, b'{"model": "x"}', hdrs)
        await _case(ctx, "malformed", name, h, p, data, _4xx_or_closed)
    bad_chunk = (f"POST /v1/completions HTTP/1.1\r\nHost: {ctx.hosthdr}\r\nConnection: close"
                 "\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n").encode()
    await _case(ctx, "malformed", "bad chunk size", h, p, bad_chunk, _4xx_or_closed)
    for name, data in [
        ("GET on POST route", _req("GET", "/v1/completions", ctx.hosthdr)),
        ("unknown path", _req("POST", "/v1/../../etc/passwd", ctx.hosthdr, b"{}")),
        ("weird method", _req("BREW", "/v1/completions", ctx.hosthdr, b"{}")),
        ("binary garbage", bytes(ctx.rng.randrange(256) for _ in range(2048))),
        ("http/0.9", b"GET /\r\n\r\n"),
        ("form body", _req("POST", "/v1/completions", ctx.hosthdr, b"model=x&prompt=y",
                           ctype="application/x-www-form-urlencoded")),
    ]:
        await _case(ctx, "malformed", name, h, p, data, _4xx_or_closed)
    # Valid model, odd types the router itself looks at; the backend may refuse them, so
    # only a hang or a dropped connection counts here.
    for name, extra in [("stream string", {"stream": "yes"}),
                        ("stream_options junk", {"stream": True, "stream_options": "x"}),
                        ("return_token_ids junk", {"stream": True, "return_token_ids": "x"}),
                        ("max_tokens string", {"max_tokens": "lots"})]:
        body = json.dumps({"model": ctx.model, "prompt": "abuse", **extra}).encode()
        await _case(ctx, "malformed", name, h, p, _req("POST", "/v1/completions", ctx.hosthdr,
                                                       body), lambda st: st is not None,
                    router_made=False)


# ---- field by field: every request field the router reads, with the wrong type -------------
#: the fields the router reads (`body.get(` in relocator/router, adapters/*/codec.py and the
#: text making, adapters/vllm/outtext.py; the chat fields a continuation carries); dotted:
#: inside an object
ROUTER_FIELDS: dict[str, tuple[str, ...]] = {
    "both": tuple(dict.fromkeys((
        "model", "stream", "stream_options", "stream_options.include_usage",
        "stream_options.continuous_usage_stats", "user", "max_tokens", "max_completion_tokens",
        "min_tokens", "n", "best_of", "use_beam_search", "logprobs", "top_logprobs", "echo",
        "return_token_ids", "detokenize", "stop", "stop_regex", "include_stop_str_in_output",
        "skip_special_tokens", "spaces_between_special_tokens", "response_format",
        "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
        "json_schema", "regex", "ebnf", *CHAT_SAMPLING_KEYS))),
    "completions": ("prompt", "suffix"),
    "chat": ("messages", "tools", "tool_choice", "functions", "function_call",
             "return_prompt_token_ids", "continue_final_message", "chat_template_kwargs",
             "reasoning_effort"),
}
WRONG_VALUES: list[tuple[str, Any]] = [
    ("string", "abuse"), ("empty string", ""), ("object", {"a": 1}), ("empty object", {}),
    ("mixed list", [1, "x", None]), ("empty list", []), ("null", None), ("true", True),
    ("false", False), ("negative", -1), ("zero", 0), ("fraction", 0.5), ("huge", 10 ** 30),
    ("huge float", 1e308), ("nested", [[[{"a": [None]}]]]),
]
#: values an engine may honour rather than refuse (10**30 sequences): a denial of service of
#: the engine, not a test of the router
_HONOURED = {("n", "huge"), ("best_of", "huge"), ("n", "huge float"), ("best_of", "huge float")}
KIND_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def field_cases(model: str) -> list[tuple[str, str, bytes]]:
    """(kind, case name, body): each field the router reads, set to each wrong value, in a
    streamed and an unstreamed request of both endpoints (everything else valid)."""
    out = []
    for kind, path in KIND_PATHS.items():
        base: dict[str, Any] = {"model": model, "max_tokens": 4}
        base.update({"prompt": "abuse"} if kind == "completions" else
                    {"messages": [{"role": "user", "content": "abuse"}]})
        for f in ROUTER_FIELDS["both"] + ROUTER_FIELDS[kind]:
            for stream in ((True,) if f == "stream" else (True, False)):
                for vname, v in WRONG_VALUES:
                    if (f, vname) in _HONOURED:
                        continue
                    body = dict(base, stream=stream)
                    if "." in f:
                        top, sub = f.split(".", 1)
                        body[top] = {"include_usage": True, sub: v}
                    else:
                        body[f] = v
                    out.append((kind, f"{path} stream={stream} {f}={vname}",
                                json.dumps(body).encode()))
    return out


def _router_made(buf: bytes) -> bool:
    """A 5xx the router made (its own error shape, or aiohttp's page for a crash), not one
    an engine answered and the router passed through."""
    body = buf.split(b"\r\n\r\n", 1)[-1]
    return b'"type": "upstream_error"' in body or b'"type": "service_unavailable"' in body \
        or b'"error"' not in body


async def sec_fields(ctx: _Ctx, concurrency: int = 8) -> None:
    """`field_cases` against the router: no 5xx, no hang, every stream ends cleanly."""
    sem = asyncio.Semaphore(concurrency)

    async def one(kind: str, name: str, body: bytes) -> None:
        async with sem:
            data = _req("POST", KIND_PATHS[kind], ctx.hosthdr, body)
            try:
                st, buf = await raw_http(ctx.host, ctx.port, data, ctx.cfg.case_timeout_s,
                                         read_limit=1 << 20)
            except asyncio.TimeoutError:
                ctx.note("fields", -1)
                ctx.finding("fields", name, f"no answer within {ctx.cfg.case_timeout_s:g} s")
                return
            except (ConnectionError, OSError) as e:
                ctx.note("fields", None)
                ctx.finding("fields", name, f"connect failed: {e}")
                return
            ctx.note("fields", st)
            if st is None or st >= 500:
                who = "router-made" if st is None or _router_made(buf) else "engine's"
                snippet = buf.split(b"\r\n\r\n", 1)[-1][:160].decode(errors="replace")
                ctx.finding("fields", name, f"status {st} ({who}): {snippet}")
            elif st == 200 and not _complete(buf):
                ctx.finding("fields", name, "200 but the response broke off")

    await asyncio.gather(*(one(*c) for c in field_cases(ctx.model)))


async def sec_headers(ctx: _Ctx, host: str, port: int, label: str) -> None:
    mk = lambda hdrs, path="/health": _req("GET", path, ctx.hosthdr, headers=hdrs)  # noqa: E731
    cases = [
        ("64 KiB header value", mk({"X-Big": "a" * 65536})),
        ("2000 headers", mk({f"X-H{i}": "v" for i in range(2000)})),
        ("100 KiB URL", mk({}, "/health?" + "a" * 102400)),
        ("header without colon", b"GET /health HTTP/1.1\r\nHost: x\r\nnocolon\r\n\r\n"),
        ("nul in header", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n"),
        ("1 MiB unterminated headers", b"GET /health HTTP/1.1\r\nX-A: " + b"a" * (1 << 20)),
        ("1000 x 1 KiB cookies", mk({"Cookie": "; ".join(f"c{i}=" + "v" * 1000
                                                           for i in range(1000))})),
    ]
    for name, data in cases:
        await _case(ctx, f"headers-{label}", name, host, port, data, _4xx_or_closed)


async def _trickle(host: str, port: int, data: bytes, seconds: float, rng: random.Random,
                   prefix: bytes = b"") -> None:
    r, w = await asyncio.open_connection(host, port)
    end = time.monotonic() + seconds
    try:
        if prefix:
            w.write(prefix)
        for b in data:
            if time.monotonic() >= end or w.is_closing():
                break
            w.write(bytes([b]))
            await w.drain()
            await asyncio.sleep(0.02 + rng.random() * 0.05)
    except (ConnectionError, OSError):
        pass
    finally:
        _abort(w) if rng.random() < 0.5 else w.close()


async def _idle(host: str, port: int, seconds: float) -> None:
    r, w = await asyncio.open_connection(host, port)
    await asyncio.sleep(seconds)
    w.close()


async def _slow_reader(host: str, port: int, data: bytes, seconds: float) -> None:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, port))
    r, w = await asyncio.open_connection(sock=sock)
    w.write(data)
    await w.drain()
    await asyncio.sleep(seconds)  # read nothing: the router's writes back up
    await r.read(1024)  # then a little, then vanish
    _abort(w)


async def sec_slow(ctx: _Ctx) -> dict[str, Any]:
    """Trickling headers and bodies, idle connections and non-reading streaming clients, all
    at once for slow_s seconds, while a probe measures that normal requests still get through."""
    cfg, h, p = ctx.cfg, ctx.host, ctx.port
    secs = cfg.slow_s
    body = json.dumps({"model": ctx.model, "prompt": "slow client", "max_tokens": 4000,
                       "stream": True, "ignore_eos": True}).encode()
    req = _req("POST", "/v1/completions", ctx.hosthdr, body)
    tasks = []
    for i in range(cfg.n(8)):
        tasks.append(_trickle(h, p, req, secs, random.Random(ctx.rng.random())))
    for i in range(cfg.n(4)):
        # headers at once, then the body one byte at a time
        head, _, b = req.partition(b"\r\n\r\n")
        tasks.append(_trickle(h, p, b, secs, random.Random(ctx.rng.random()),
                              prefix=head + b"\r\n\r\n"))
    for i in range(cfg.n(8)):
        tasks.append(_idle(h, p, secs))
    for i in range(cfg.n(4)):
        tasks.append(_slow_reader(h, p, req, secs))
    if ctx.chost:
        for i in range(cfg.n(3)):
            creq = _req("POST", "/control/workers/no-such-worker/hold", ctx.hosthdr, b"{}",
                        ctx.ctl_headers())
            tasks.append(_trickle(ctx.chost, ctx.cport, creq, secs,  # type: ignore[arg-type]
                                  random.Random(ctx.rng.random())))
            tasks.append(_idle(ctx.chost, ctx.cport, secs))  # type: ignore[arg-type]

    lat: list[float] = []

    async def probe() -> None:
        end = time.monotonic() + secs
        pb = json.dumps({"model": ctx.model, "prompt": "probe", "max_tokens": 4}).encode()
        while time.monotonic() < end:
            t = time.monotonic()
            try:
                st, _ = await raw_http(h, p, _req("POST", "/v1/completions", ctx.hosthdr, pb),
                                       cfg.case_timeout_s)
            except (asyncio.TimeoutError, ConnectionError, OSError):
                st = None
            ctx.note("slow-probe", st)
            if st != 200:
                ctx.finding("slow", "probe during slow clients", f"probe got {st}")
            lat.append(time.monotonic() - t)
            await asyncio.sleep(0.1)

    res = await asyncio.gather(*(asyncio.wait_for(t, secs + cfg.case_timeout_s) for t in tasks),
                               probe(), return_exceptions=True)
    for r in res:
        ctx.note("slow", None)
        if isinstance(r, asyncio.TimeoutError):
            ctx.finding("slow", "slow client", "client task did not end in time")
    lat.sort()
    return {"slow_clients": len(tasks), "probes": len(lat),
            "probe_p50_ms": round(lat[len(lat) // 2] * 1e3, 1) if lat else None,
            "probe_max_ms": round(lat[-1] * 1e3, 1) if lat else None}


async def sec_disconnects(ctx: _Ctx) -> None:
    """Requests cut at random points: mid-headers, mid-body, after some of the stream (with a
    FIN or an RST), and aiohttp requests cancelled at random times."""
    cfg, h, p, rng = ctx.cfg, ctx.host, ctx.port, ctx.rng
    body = json.dumps({"model": ctx.model, "prompt": "disconnect me", "max_tokens": 200,
                       "stream": True, "ignore_eos": True}).encode()
    chat = json.dumps({"model": ctx.model, "messages": [{"role": "user", "content": "bye"}],
                       "max_tokens": 200, "stream": True, "ignore_eos": True}).encode()

    async def one(i: int) -> None:
        path, b = ("/v1/completions", body) if i % 2 else ("/v1/chat/completions", chat)
        data = _req("POST", path, ctx.hosthdr, b)
        r, w = await asyncio.open_connection(h, p)
        try:
            mode = rng.randrange(3)
            if mode == 0:  # cut while sending
                w.write(data[:rng.randrange(1, len(data))])
                await w.drain()
                await asyncio.sleep(rng.random() * 0.05)
            else:  # cut while reading
                w.write(data)
                await w.drain()
                want = rng.randrange(0, 4000)
                got = 0
                end = time.monotonic() + 2.0
                while got < want and time.monotonic() < end:
                    try:
                        c = await asyncio.wait_for(r.read(512), max(0.01, end - time.monotonic()))
                    except asyncio.TimeoutError:
                        break
                    if not c:
                        break
                    got += len(c)
        except (ConnectionError, OSError):
            pass
        finally:
            _abort(w) if rng.random() < 0.5 else w.close()
        ctx.note("disconnect", None)

    n = cfg.n(40)
    sem = asyncio.Semaphore(8)

    async def guarded(i: int) -> None:
        async with sem:
            try:
                await asyncio.wait_for(one(i), cfg.case_timeout_s)
            except asyncio.TimeoutError:
                ctx.finding("disconnect", f"#{i}", "client side hung")
            except (ConnectionError, OSError) as e:
                ctx.finding("disconnect", f"#{i}", f"connect failed: {e}")

    await asyncio.gather(*(guarded(i) for i in range(n)))

    async with aiohttp.ClientSession() as s:
        async def cancelled() -> None:
            async with s.post(f"http://{ctx.hosthdr}/v1/completions", data=body,
                              headers={"Content-Type": "application/json"}) as resp:
                async for _ in resp.content.iter_any():
                    pass

        for _ in range(cfg.n(10)):
            t = asyncio.create_task(cancelled())
            await asyncio.sleep(rng.random() * 0.05)
            t.cancel()
            try:
                await t
            except (asyncio.CancelledError, aiohttp.ClientError):
                pass
            ctx.note("disconnect", None)


async def sec_control(ctx: _Ctx) -> None:
    """Invalid bodies, unknown and odd worker names, wrong methods, a big body; a wrong token
    when the control API has one. Nothing that changes the routing table."""
    h, p, hh = ctx.chost, ctx.cport, ctx.hosthdr
    assert h is not None and p is not None
    auth = ctx.ctl_headers()
    bodies = [b"", b"{", b"[]", b"null", b"1", b'"x"', b"\xff\xfe",
              b'{"worker_id": 1, "model": "m", "url": "http://x"}',
              b'{"worker_id": "", "model": "m", "url": "http://x"}',
              b'{"worker_id": "w", "model": "m", "url": "ftp://x"}',
              b'{"worker_id": "w", "model": "m"}',
              b"[" * 100_000 + b"]" * 100_000]
    for i, b in enumerate(bodies):
        await _case(ctx, "control", f"add replica body #{i}", h, p,
                    _req("POST", "/control/replicas", hh, b, auth), _is4xx)
    names = ["no-such-worker", "%00", "..%2F..%2Fetc", "a" * 4000, "%ff%fe", "w%20x",
             "%F0%9F%92%A5"]
    for nm in names:
        for verb in ("hold", "release"):
            await _case(ctx, "control", f"{verb} {nm[:20]}", h, p,
                        _req("POST", f"/control/workers/{nm}/{verb}", hh, b"{}", auth), _is4xx)
        await _case(ctx, "control", f"delete {nm[:20]}", h, p,
                    _req("DELETE", f"/control/replicas/{nm}", hh, None, auth), _is4xx)
    for b in (b"{", b"[]", b'{"endpoint": 5}', b'{"endpoint": "file:///etc/passwd"}',
              b'{"endpoint": "http://127.0.0.1:1", "release": "maybe"}'):
        await _case(ctx, "control", f"switch unknown {b[:20]!r}", h, p,
                    _req("POST", "/control/workers/no-such-worker/switch", hh, b, auth), _is4xx)
    await _case(ctx, "control", "GET on hold", h, p,
                _req("GET", "/control/workers/x/hold", hh, None, auth), _is4xx)
    await _case(ctx, "control", "2 MiB body", h, p,
                _req("POST", "/control/replicas", hh, b'{"a": "' + b"a" * (2 << 20) + b'"}',
                     auth), _4xx_or_closed)
    if ctx.cfg.token:
        for bad in ("Bearer wrong", "Bearer ", "Basic xyz", "Bearer " + "a" * 5000):
            await _case(ctx, "control", f"auth {bad[:16]}", h, p,
                        _req("GET", "/control/replicas", hh, None, {"Authorization": bad}),
                        _is4xx)
    await sec_headers(ctx, h, p, "control")


async def _in_flight(ctx: _Ctx) -> float | None:
    """Sum of relocator_router_in_flight over backends, from /metrics."""
    try:
        st, buf = await raw_http(ctx.host, ctx.port, _req("GET", "/metrics", ctx.hosthdr), 5)
    except (asyncio.TimeoutError, ConnectionError, OSError):
        return None
    if st != 200:
        return None
    tot = 0.0
    for m in re.finditer(rb"(?m)^relocator_router_in_flight(?:\{[^}]*\})? ([0-9.eE+-]+)$", buf):
        tot += float(m.group(1))
    return tot


async def _healthy(ctx: _Ctx) -> bool:
    try:
        st, _ = await raw_http(ctx.host, ctx.port, _req("GET", "/health", ctx.hosthdr), 5)
        return st == 200
    except (asyncio.TimeoutError, ConnectionError, OSError):
        return False


async def _settle(ctx: _Ctx, pid: int | None, base_fds: int | None) -> dict[str, Any]:
    """Wait (bounded) until in-flight is 0 and fds are back near baseline; then measure."""
    last: dict[str, Any] = {"in_flight": None, "st": None}

    async def settled() -> bool:
        last["in_flight"] = infl = await _in_flight(ctx)
        last["st"] = st = proc_stats(pid) if pid else None
        fds_ok = st is None or base_fds is None or st["fds"] <= base_fds + ctx.cfg.fd_tolerance
        return infl == 0 and fds_ok

    try:
        await until_async(settled, ctx.cfg.settle_s, 0.25, what="the router to settle")
    except WaitTimeout:
        pass  # measured as it is
    out: dict[str, Any] = dict(last["st"] or {})
    out["in_flight"] = last["in_flight"]
    return out


async def _warm(ctx: _Ctx, n: int) -> None:
    """Valid concurrent streams so the router's upstream pool holds its connections before the
    baseline is taken (keep-alive connections are not leaks)."""
    body = {"model": ctx.model, "prompt": "warm", "max_tokens": 8, "stream": True}
    async with aiohttp.ClientSession() as s:
        async def one() -> None:
            async with s.post(f"http://{ctx.hosthdr}/v1/completions", json=body) as r:
                await r.read()

        await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)


async def run_abuse(cfg: AbuseConfig) -> dict[str, Any]:
    host, port = loopback_target(cfg.router)
    chost = cport = None
    if cfg.control:
        chost, cport = loopback_target(cfg.control)
    hosthdr = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    pid = cfg.pid or listener_pid(port, host)
    model = cfg.model
    if model is None:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://{hosthdr}/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
    ctx = _Ctx(cfg, host, port, hosthdr, chost, cport, model, random.Random(cfg.seed))
    t_start = time.monotonic()
    await _warm(ctx, cfg.n(8) + 8)
    await asyncio.sleep(0.3)
    base = proc_stats(pid) if pid else None
    report: dict[str, Any] = {"router": cfg.router, "control": cfg.control, "pid": pid,
                              "model": model, "baseline": base, "rounds": [], "crashed": None}
    sections: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
        ("malformed", lambda: sec_malformed(ctx)),
        ("fields", lambda: sec_fields(ctx)),
        ("headers", lambda: sec_headers(ctx, host, port, "api")),
        ("slow", lambda: sec_slow(ctx)),
        ("disconnects", lambda: sec_disconnects(ctx)),
    ]
    if chost:
        sections.append(("control", lambda: sec_control(ctx)))
    for rnd in range(cfg.rounds):
        info: dict[str, Any] = {"round": rnd + 1, "sections": {}}
        for name, fn in sections:
            if time.monotonic() - t_start > cfg.time_budget_s:
                info["sections"][name] = "skipped: time budget"
                continue
            t = time.monotonic()
            extra = await fn()
            info["sections"][name] = {"s": round(time.monotonic() - t, 2),
                                      **(extra if isinstance(extra, dict) else {})}
            if pid and proc_stats(pid) is None or not await _healthy(ctx):
                report["crashed"] = f"round {rnd + 1}, after section {name}"
                break
        if report["crashed"]:
            report["rounds"].append(info)
            break
        info.update(await _settle(ctx, pid, base["fds"] if base else None))
        report["rounds"].append(info)
    last = report["rounds"][-1] if report["rounds"] else {}
    prev = report["rounds"][-2] if len(report["rounds"]) > 1 else {"rss_mb": (base or {}).get(
        "rss_mb")}
    leak: dict[str, Any] = {}
    if base and last.get("fds") is not None:
        leak["fds_over_baseline"] = last["fds"] - base["fds"]
        leak["fds"] = leak["fds_over_baseline"] > cfg.fd_tolerance
    if base and last.get("rss_mb") is not None and prev.get("rss_mb") is not None:
        leak["rss_growth_last_round_mb"] = round(last["rss_mb"] - prev["rss_mb"], 1)
        leak["rss_growth_total_mb"] = round(last["rss_mb"] - base["rss_mb"], 1)
        leak["rss"] = leak["rss_growth_last_round_mb"] > cfg.rss_tolerance_mb
    leak["in_flight_left"] = last.get("in_flight")
    report.update(leak=leak, cases=ctx.cases, statuses=ctx.statuses,
                  findings=ctx.findings, seconds=round(time.monotonic() - t_start, 1))
    if not pid:
        report["note"] = "router PID not found (not a local process?): no fd/RSS measure"
    report["ok"] = bool(not report["crashed"] and not leak.get("fds") and not leak.get("rss")
                        and not ctx.findings and leak.get("in_flight_left") in (0, 0.0))
    return report


def render(rep: dict[str, Any]):  # -> rich renderable
    from rich.table import Table

    t = Table(title=f"abuse pass: {rep['cases']} cases in {rep['seconds']} s, router pid "
                    f"{rep['pid']}")
    t.add_column("what")
    t.add_column("value")
    ok = "[green]ok[/]" if rep["ok"] else "[bold red]FAILED[/]"
    t.add_row("result", ok)
    t.add_row("crashed", str(rep["crashed"] or "no"))
    b = rep.get("baseline") or {}
    t.add_row("baseline fds / RSS MB", f"{b.get('fds')} / {b.get('rss_mb')}")
    for r in rep["rounds"]:
        t.add_row(f"after round {r['round']} fds / RSS MB / in-flight",
                  f"{r.get('fds')} / {r.get('rss_mb')} / {r.get('in_flight')}")
        slow = r["sections"].get("slow")
        if isinstance(slow, dict) and slow.get("probes"):
            t.add_row(f"  probe during slow clients p50/max ms",
                      f"{slow['probe_p50_ms']} / {slow['probe_max_ms']}")
    t.add_row("leak", json.dumps(rep["leak"]))
    for sec, d in rep["statuses"].items():
        t.add_row(f"statuses {sec}", ", ".join(f"{k}: {v}" for k, v in sorted(d.items())))
    for f in rep["findings"][:20]:
        what = " ".join(f["what"].split())
        t.add_row(f"[red]finding[/] {f['section']} (x{f['count']})",
                  f"{f['case']}: {what}"[:200])
    return t
