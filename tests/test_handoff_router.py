"""The router's part of a handoff (make-before-break move): the streams in flight listed with
their progress, and a switch that leaves inexact continuations on the source."""

from __future__ import annotations

from adapters.vllm.codec import Codec as VLLMCodec
from relocator.router.stream import StreamState
from relocator.router.table import RoutingTable, StreamHandle

FIRST = (b'data: {"id":"cmpl-1","object":"text_completion","created":5,"model":"m",'
         b'"choices":[{"index":0,"text":"","logprobs":null,"finish_reason":null}],'
         b'"prompt_token_ids":[1,2,3]}\n\n')
TOK = (b'data: {"id":"cmpl-1","object":"text_completion","created":5,"model":"m",'
       b'"choices":[{"index":0,"text":"a","logprobs":null,"finish_reason":null,'
       b'"token_ids":[%d]}]}\n\n')


def _stream(table: RoutingTable, body: dict, ids: list[int]) -> StreamHandle:
    st = StreamState("completion", {"model": "m", "prompt": "x", "max_tokens": 50, **body}, codec=VLLMCodec())
    st.feed(FIRST)
    for i in ids:
        st.feed(TOK % i)
    cut: list[bool] = []
    h = StreamHandle("w", abort=lambda: cut.append(True), stream=st)
    table.register(table.get("w"), h)
    return h


def test_streams_lists_prompt_and_sent_ids_and_inexact_reasons():
    t = RoutingTable()
    t.add("w", "m", "http://src")
    _stream(t, {"temperature": 0}, [7, 8])
    _stream(t, {"temperature": 0.8, "seed": 3}, [9])
    t.register(t.get("w"), StreamHandle("w"))  # a unary request: nothing to warm up
    got = sorted(t.streams("w"), key=lambda p: len(p["sent_ids"]))
    assert [p["prompt_ids"] for p in got] == [[1, 2, 3], [1, 2, 3]]
    assert [p["sent_ids"] for p in got] == [[9], [7, 8]]
    assert got[0]["inexact"] == ["seed"] and got[1]["inexact"] == []


def test_switch_keeping_inexact_streams_cuts_only_exact_ones():
    t = RoutingTable()
    t.add("w", "m", "http://src")
    greedy = _stream(t, {"temperature": 0}, [7])
    seeded = _stream(t, {"temperature": 0.8, "seed": 3}, [9])
    info = t.switch("w", "http://dst", keep_inexact=True)
    assert info["moved_streams"] == 1 and info["kept_streams"] == 1
    assert greedy.moved and not seeded.moved
    assert t.get("w").endpoint == "http://dst"


def test_a_switch_cut_from_the_source_leaves_the_targets_streams_alone():
    t = RoutingTable()
    t.add("w", "m", "http://src")
    on_src = _stream(t, {"temperature": 0.8, "seed": 3}, [9])
    on_src.endpoint = "http://src"
    on_dst = _stream(t, {"temperature": 0.8, "seed": 4}, [9])
    on_dst.endpoint = "http://dst"
    info = t.switch("w", "http://dst", cut_from="http://src/")
    assert info["moved_streams"] == 1 and on_src.moved and not on_dst.moved


def test_plain_switch_still_cuts_every_stream():
    t = RoutingTable()
    t.add("w", "m", "http://src")
    a = _stream(t, {"temperature": 0}, [7])
    b = _stream(t, {"temperature": 0.8, "seed": 3}, [9])
    info = t.switch("w", "http://dst")
    assert info["moved_streams"] == 2 and info["kept_streams"] == 0
    assert a.moved and b.moved


# --- over HTTP, against the fake vLLM-framed engine (tests/test_router_http.py's env) -------------
import asyncio  # noqa: E402

import pytest  # noqa: E402

from relocator.router.client import ControlError, RouterControl  # noqa: E402
from tests.test_router_http import env, sse  # noqa: E402,F401 - the fixture and its reader


@pytest.mark.asyncio(loop_scope="session")
async def test_a_handoff_switch_continues_a_live_stream_token_exact(env):  # noqa: F811
    srv, fakes, s = env
    base = {"model": "fake", "max_tokens": 20, "stream": True, "prompt": "abc", "return_token_ids": True}
    _, ref = await sse(s, fakes[1][1] + "/v1/completions", base)
    ref_ids = [t for c in ref if c["choices"] for t in c["choices"][0].get("token_ids") or []]
    rc = RouterControl(srv.control_url)
    fakes[0][0].knobs.stall_after = 7
    task = asyncio.create_task(sse(s, srv.url + "/v1/completions", base))
    for _ in range(200):
        await asyncio.sleep(0.01)
        if fakes[0][0]._stalls:
            break
    [st] = await rc.streams("w1")  # what the warm-up prefills
    assert st["prompt_ids"] and st["sent_ids"] == ref_ids[:7] and st["inexact"] == []
    assert st["endpoint"] == fakes[0][1].rstrip("/")
    info = await rc.switch("w1", fakes[1][1], keep_inexact=True)  # no hold first
    assert (info["moved_streams"], info["kept_streams"]) == (1, 0)
    _, got = await task
    fakes[0][0].unstall()
    assert [t for c in got if c["choices"] for t in c["choices"][0].get("token_ids") or []] == ref_ids
    with pytest.raises(ControlError) as ei:
        await rc._call("POST", "/control/workers/w1/switch", {"endpoint": fakes[0][1], "keep_inexact": "yes"})
    assert ei.value.status == 400 and ei.value.body["error"]["param"] == "keep_inexact"
    with pytest.raises(ControlError) as ei:
        await rc.streams("ghost")
    assert ei.value.status == 404
    await rc.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_a_switch_with_catch_up_prefills_the_target_first(env):  # noqa: F811
    """The router's last warm-up before its cut (relocator/router/catchup.py): the target gets
    each stream's continuation cut to one token, then the real continuation."""
    srv, fakes, s = env
    base = {"model": "fake", "max_tokens": 20, "stream": True, "prompt": "abc", "return_token_ids": True}
    _, ref = await sse(s, fakes[1][1] + "/v1/completions", base)
    ref_ids = [t for c in ref if c["choices"] for t in c["choices"][0].get("token_ids") or []]
    rc = RouterControl(srv.control_url)
    fakes[0][0].knobs.stall_after = 7
    task = asyncio.create_task(sse(s, srv.url + "/v1/completions", base))
    for _ in range(200):
        await asyncio.sleep(0.01)
        if fakes[0][0]._stalls:
            break
    n = len(fakes[1][0].requests)
    info = await rc.switch("w1", fakes[1][1], keep_inexact=True, catch_up_rounds=3)
    caught = info["catch_up"]
    # the stalled stream is within the gap after one round: no second one
    assert (caught["rounds"], caught["streams"], caught["tokens"]) == (1, 1, 3 + 7), caught
    assert "error" not in caught and info["moved_streams"] == 1
    _, got = await task
    fakes[0][0].unstall()
    assert [t for c in got if c["choices"] for t in c["choices"][0].get("token_ids") or []] == ref_ids
    pre, cont = fakes[1][0].requests[n:]
    assert pre["max_tokens"] == 1 and pre["prompt"] == list(b"abc") + ref_ids[:7]
    assert cont["prompt"] == pre["prompt"] and cont["max_tokens"] == 20 - 7
    await rc.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_a_failed_catch_up_still_switches_and_bad_rounds_are_refused(env):  # noqa: F811
    srv, fakes, s = env
    base = {"model": "fake", "max_tokens": 12, "stream": True, "prompt": "xy", "return_token_ids": True}
    _, ref = await sse(s, fakes[0][1] + "/v1/completions", base)
    rc = RouterControl(srv.control_url)
    fakes[0][0].knobs.stall_after = 4
    task = asyncio.create_task(sse(s, srv.url + "/v1/completions", base))
    for _ in range(200):
        await asyncio.sleep(0.01)
        if fakes[0][0]._stalls:
            break
    fakes[1][0].knobs.fail_status = 500  # the prefill fails (once): the continuation does it
    info = await rc.switch("w1", fakes[1][1], keep_inexact=True, catch_up_rounds=2)
    assert "500" in info["catch_up"]["error"] and info["moved_streams"] == 1
    _, got = await task
    fakes[0][0].unstall()
    assert [c["choices"][0]["text"] for c in got if c["choices"]] and \
        "".join(c["choices"][0]["text"] for c in got if c["choices"]) == \
        "".join(c["choices"][0]["text"] for c in ref if c["choices"])
    for bad in ("2", -1, 99, True):
        with pytest.raises(ControlError) as ei:
            await rc._call("POST", "/control/workers/w1/switch", {"endpoint": fakes[1][1], "catch_up_rounds": bad})
        assert ei.value.status == 400 and ei.value.body["error"]["param"] == "catch_up_rounds"
    await rc.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_eight_splices_at_once_check_the_tokenizer_with_one_engine_call(tmp_path):
    """A switch cuts every stream at once; the first continuations of a model all want its
    tokenizer checked against the engine's detokenizer: one call, the others take its verdict."""
    import json

    from adapters.vllm.codec import Codec
    from relocator.router.engine_calls import EngineCalls
    from relocator.router.fakeserver import fake_tokenizer, write_fake_tokenizer
    from relocator.router.table import Replica
    from relocator.router.tokenizers import TokenizerRegistry

    posts: list[str] = []

    class Resp:
        status = 200

        def __init__(self, body: bytes) -> None:
            self.body = body

        async def read(self) -> bytes:
            return self.body

        def close(self) -> None:
            pass

    async def post(url: str, body: bytes) -> Resp:
        posts.append(url)
        await asyncio.sleep(0.01)  # the engine answers while the other splices ask
        text = fake_tokenizer().decode(json.loads(body)["tokens"])
        return Resp(json.dumps({"prompt": text}).encode())

    reg = TokenizerRegistry()
    reg.register("fake", write_fake_tokenizer(tmp_path))
    calls = EngineCalls(post, reg)
    r = Replica("w1", "fake", "http://t")
    got = await asyncio.gather(*(calls.tokenizer(r, Codec(), "fake", [97, 98, 99]) for _ in range(8)))
    assert posts == ["http://t/detokenize"] and all(t is not None for t in got)
    # a tokenizer the engine disagrees with is distrusted for every waiter
    reg2 = TokenizerRegistry()
    reg2.register("fake", write_fake_tokenizer(tmp_path / "2"))

    async def liar(url: str, body: bytes) -> Resp:
        posts.append(url)
        await asyncio.sleep(0.01)
        return Resp(json.dumps({"prompt": "something else"}).encode())

    posts.clear()
    calls = EngineCalls(liar, reg2)
    got = await asyncio.gather(*(calls.tokenizer(r, Codec(), "fake", [97, 98]) for _ in range(8)))
    assert posts == ["http://t/detokenize"] and got == [None] * 8


# --- a switch at_token: each stream cut right after its next token (a handoff's source serves on)
def test_a_switch_at_token_marks_the_cut_and_cuts_anyway_after_the_wait(monkeypatch):
    import relocator.router.table as table

    monkeypatch.setattr(table, "AT_TOKEN_WAIT_S", 0.05)

    async def main() -> tuple[StreamHandle, list[bool], list[bool]]:
        t = RoutingTable()
        t.add("w", "m", "http://src")
        h = _stream(t, {"temperature": 0}, [7])
        cut: list[bool] = []
        h.abort = lambda: cut.append(True)
        info = t.switch("w", "http://dst", keep_inexact=True, at_token=True)
        assert info["moved_streams"] == 1 and h.moved and h.cut_due, info
        at_once = list(cut)  # not cut yet: its relay ends the leg after the next token
        await asyncio.sleep(0.3)  # no token came (a stream in its prefill, a stalled source)
        return h, at_once, cut

    h, at_once, cut = asyncio.run(main())
    assert at_once == [] and cut == [True] and not h.cut_due, (at_once, cut)
    # no event loop (a switch from a synchronous caller): cut at once
    t = RoutingTable()
    t.add("w", "m", "http://src")
    h2 = _stream(t, {"temperature": 0}, [7])
    t.switch("w", "http://dst", at_token=True)
    assert h2.moved and not h2.cut_due


def test_the_relay_ends_the_leg_right_after_the_token_it_passes_on():
    """RouterCore._relay with a fake upstream: the leg marked `cut_due` while a token is with the
    client reads no further event from the source (the continuation starts from there)."""
    from types import SimpleNamespace

    from relocator.router.core import RouterCore

    st = StreamState("completion", {"model": "m", "prompt": "x", "max_tokens": 50}, codec=VLLMCodec())
    h = StreamHandle("w", stream=st)
    read: list[bytes] = []

    class Upstream:
        async def chunks(self):
            for ev in (FIRST, TOK % 7, TOK % 8, TOK % 9):
                read.append(ev)
                yield ev

        def close(self):
            pass

    core = SimpleNamespace(hooks=SimpleNamespace(ttfb=lambda s: None))

    async def main() -> list[bytes]:
        got = []
        async for out in RouterCore._relay(core, st, h, Upstream(), 0.0):
            got.append(out)
            if b"[7]" in out or st.sent_ids == [7]:
                h.cut_due = True  # the switch came while token 7 was with the client
        return got

    got = asyncio.run(main())
    assert st.sent_ids == [7] and len(read) == 2 and not h.cut_due, (st.sent_ids, read, got)


@pytest.mark.asyncio(loop_scope="session")
async def test_a_stalled_stream_switched_at_token_is_cut_after_the_wait_and_continued(env, monkeypatch):  # noqa: F811
    import relocator.router.table as table

    monkeypatch.setattr(table, "AT_TOKEN_WAIT_S", 0.1)
    srv, fakes, s = env
    base = {"model": "fake", "max_tokens": 20, "stream": True, "prompt": "abc", "return_token_ids": True}
    _, ref = await sse(s, fakes[1][1] + "/v1/completions", base)
    ref_ids = [t for c in ref if c["choices"] for t in c["choices"][0].get("token_ids") or []]
    rc = RouterControl(srv.control_url)
    fakes[0][0].knobs.stall_after = 7
    task = asyncio.create_task(sse(s, srv.url + "/v1/completions", base))
    for _ in range(200):
        await asyncio.sleep(0.01)
        if fakes[0][0]._stalls:
            break
    n = len(fakes[1][0].requests)
    info = await rc.switch("w1", fakes[1][1], keep_inexact=True, at_token=True)
    assert info["moved_streams"] == 1, info
    _, got = await asyncio.wait_for(task, 10)  # no token came: cut by the wait, continued on the target
    fakes[0][0].unstall()
    assert [t for c in got if c["choices"] for t in c["choices"][0].get("token_ids") or []] == ref_ids
    assert [r["max_tokens"] for r in fakes[1][0].requests[n:]] == [20 - 7], fakes[1][0].requests[n:]
    with pytest.raises(ControlError) as ei:
        await rc._call("POST", "/control/workers/w1/switch", {"endpoint": fakes[0][1], "at_token": "yes"})
    assert ei.value.status == 400 and ei.value.body["error"]["param"] == "at_token"
    await rc.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_reach_says_whether_the_router_gets_an_answer_from_the_workers_endpoint(env):  # noqa: F811
    """RELEASE's last check of a handoff: the target copy as the router sees it."""
    import socket

    srv, fakes, s = env
    rc = RouterControl(srv.control_url)
    got = await rc.reach("w1", timeout_s=2)
    assert got["reachable"] is True and got["endpoint"] == fakes[0][1] and got["seconds"] >= 0, got
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    await rc.switch("w1", dead)
    got = await rc.reach("w1", timeout_s=1)
    assert got["reachable"] is False and got["endpoint"] == dead, got
    await rc.switch("w1", fakes[0][1])
    for bad in ("0", "31", "x"):
        with pytest.raises(ControlError) as ei:
            await rc._call("GET", f"/control/workers/w1/reach?timeout_s={bad}")
        assert ei.value.status == 400 and ei.value.body["error"]["param"] == "timeout_s", ei.value.body
    with pytest.raises(ControlError) as ei:
        await rc.reach("nope")
    assert ei.value.status == 404
    await rc.close()
