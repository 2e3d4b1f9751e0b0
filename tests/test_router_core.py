"""Router core without HTTP: policies, table (hold/switch/release), SSE state, engine."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from relocator.router import errors
from relocator.router.config import RouterSettings, parse_backend
from adapters.vllm.codec import Codec as VLLMCodec
from relocator.router.policies import make_policy
from relocator.router.stream import StreamState
from relocator.router.table import ReplicaState, RoutingTable, StreamHandle

ASYNC = pytest.mark.asyncio(loop_scope="session")


def test_core_does_not_import_aiohttp():
    code = ("import sys, relocator.router, relocator.router.core, relocator.router.stream;"
            "assert 'aiohttp' not in sys.modules, 'aiohttp imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_policies():
    t = RoutingTable("round_robin")
    for i in range(3):
        t.add(f"w{i}", "m", f"http://h{i}")
    reps = t.replicas("m")
    rr = make_policy("round_robin")
    assert [rr.choose(reps, None).worker_id for _ in range(4)] == ["w0", "w1", "w2", "w0"]
    reps[0].in_flight, reps[1].in_flight, reps[2].in_flight = 3, 1, 2
    assert make_policy("least_in_flight").choose(reps, None).worker_id == "w1"
    aff = make_policy("affinity", max_imbalance=100)
    picks = {aff.choose(reps, "session-42").worker_id for _ in range(5)}
    assert len(picks) == 1
    tight = make_policy("affinity", max_imbalance=0)
    assert tight.choose(reps, "session-42").worker_id == "w1"
    with pytest.raises(ValueError):
        make_policy("nope")


@ASYNC
async def test_hold_queue_fifo_bound_timeout_and_switch():
    t = RoutingTable("least_in_flight", hold_queue_max=3, hold_timeout_s=0.2)
    t.add("w", "m", "http://a")
    t.hold("w")
    order = []

    async def req(i):
        r = await t.acquire("m")
        order.append(i)
        t.done(r)
        return r.endpoint

    tasks = [asyncio.create_task(req(i)) for i in range(3)]
    await asyncio.sleep(0.01)
    assert t.held_requests() == 3
    with pytest.raises(errors.RouterError) as ei:
        await t.acquire("m")
    assert ei.value.code == "hold_queue_full"
    h = StreamHandle("w")
    cut = []
    h.abort = lambda: cut.append(1)
    t.register(t.get("w"), h)
    info = t.switch("w", "http://b/")
    assert info["moved_streams"] == 1 and h.moved and cut == [1] and info["released"] == 3
    assert await asyncio.gather(*tasks) == ["http://b"] * 3
    assert order == [0, 1, 2]
    assert t.get("w").in_flight == 0 and t.get("w").state is ReplicaState.ACTIVE
    t.hold("w")
    with pytest.raises(errors.RouterError) as ei:
        await t.acquire("m")
    assert ei.value.status == 503 and ei.value.code == "hold_timeout"
    assert t.held_requests() == 0 and t.get("w").in_flight == 0
    # a waiter whose client goes away does not leak an in-flight count
    task = asyncio.create_task(t.acquire("m"))
    await asyncio.sleep(0.01)
    task.cancel()
    t.release("w")
    with pytest.raises(asyncio.CancelledError):
        await task
    assert t.get("w").in_flight == 0
    with pytest.raises(errors.RouterError) as ei:
        await t.acquire("other")
    assert ei.value.status == 404


@ASYNC
async def test_remove_fails_waiters():
    t = RoutingTable(hold_timeout_s=5)
    t.add("w", "m", "http://a")
    t.hold("w")
    task = asyncio.create_task(t.acquire("m"))
    await asyncio.sleep(0.01)
    t.remove("w")
    with pytest.raises(errors.RouterError):
        await task


def test_vllm_engine_scan_strip_and_continuation():
    e = VLLMCodec()
    raw = b'{"model":"m","prompt":"x","stream":true}'
    assert e.ask_for_token_ids(raw).endswith(b',"return_token_ids":true}')
    ev = (b'data: {"id":"c","choices":[{"index":0,"text":"a","logprobs":null,'
          b'"finish_reason":null,"stop_reason":null,"prompt_token_ids":[1,2,3],'
          b'"token_ids":[7]}]}\n\n')
    assert e.scan(ev) == (b"1,2,3", [b"7"])
    assert b'"prompt_token_ids":null,"token_ids":null' in e.strip(ev)
    path, req = e.continuation_request("chat", {"model": "m", "messages": [], "max_tokens": 10,
                                                "temperature": 0, "stop": ["x"]}, [1, 2], [7, 8])
    assert path == "/v1/completions" and req["prompt"] == [1, 2, 7, 8]
    assert req["max_tokens"] == 8 and req["stop"] == ["x"] and "messages" not in req
    _, req = e.continuation_request("completions", {"model": "m", "prompt": "p", "stop": ["x"]},
                                    [1], [2], text_by_router=True)
    assert "stop" not in req  # the router applies stop strings to the text it makes
    assert e.unsupported_reason("completions", {"n": 2}) is not None
    assert e.unsupported_reason("chat", {"tools": [{}]}) is not None
    assert e.unsupported_reason("completions", {"prompt": "x"}) is None


def test_stream_state_framing_and_splice():
    st = StreamState("chat", {"model": "m", "messages": [], "max_tokens": 4,
                              "stream_options": {"include_usage": True}}, codec=VLLMCodec())
    first = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":5,'
             b'"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},'
             b'"logprobs":null,"finish_reason":null}],"prompt_token_ids":[1,2]}\n\n')
    tok = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":5,"model":"m",'
           b'"choices":[{"index":0,"delta":{"content":"a"},"logprobs":null,'
           b'"finish_reason":null,"token_ids":[9]}]}\n\n')
    # split mid-event: nothing is forwarded until the event is complete
    assert st.feed(first[:30]) == b""
    out = st.feed(first[30:] + tok[:10])
    assert out.endswith(b'"prompt_token_ids":null}\n\n')
    assert st.feed(tok[10:]).count(b"\n\n") == 1
    assert st.prompt_ids == [1, 2] and st.sent_ids == [9]
    st.begin_continuation()
    cont = (b'data: {"id":"cmpl-9","object":"text_completion","created":7,"model":"m",'
            b'"choices":[{"index":0,"text":"bc","logprobs":null,"finish_reason":"length",'
            b'"stop_reason":null,"prompt_token_ids":[1,2,9],"token_ids":[4,5]}]}\n\n'
            b'data: [DONE]\n\n')
    out = st.feed(cont).decode()
    assert '"id":"chatcmpl-1"' in out and '"object":"chat.completion.chunk"' in out
    assert '"delta":{"content":"bc"}' in out and '"finish_reason":"length"' in out
    assert '"completion_tokens":3' in out and '"prompt_tokens":2' in out
    assert out.endswith("data: [DONE]\n\n") and st.done


def test_settings_env_and_backend(monkeypatch, tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("router:\n  port: 9000\n  policy: round_robin\n")
    monkeypatch.setenv("RELOCATOR_ROUTER_PORT", "9100")
    s = RouterSettings.load(f)
    assert s.port == 9100 and s.policy == "round_robin"
    b = parse_backend("w1@tiny=http://127.0.0.1:8000/")
    assert (b.worker_id, b.model, b.url) == ("w1", "tiny", "http://127.0.0.1:8000")
    with pytest.raises(ValueError):
        parse_backend("nourl")
    with pytest.raises(ValueError):
        RouterSettings(policy="nope")


def _events(kind: str, prompt: list[int], body: dict) -> list[bytes]:
    """The fake engine's stream (vLLM framing, vLLM's text making) for `prompt`."""
    from relocator.router.fakeserver import FakeEngine, generate

    out, pieces, finish, reason = generate(prompt, body, body["max_tokens"])
    evs = FakeEngine("m")._events(kind, "c-1", 5, prompt, out, pieces, finish, reason, True, body)
    return [e.encode() for e in evs]


def _client_text(kind: str, raw: bytes) -> str:
    text = ""
    for ev in raw.decode().split("\n\n"):
        if ev.startswith("data: {"):
            for c in json.loads(ev[6:]).get("choices") or ():
                text += (c.get("delta") or {}).get("content") or "" if kind == "chat" else c["text"]
    return text


def _spliced(kind: str, body: dict, prompt: list[int], cut: int, tokenizer) -> tuple[str, str]:
    """(uninterrupted text, client text when the stream breaks after `cut` events and is
    continued on another engine)."""
    e = VLLMCodec()
    ref = _events(kind, prompt, body)
    st = StreamState(kind, body, codec=e)
    got = b"".join(st.feed(ev) for ev in ref[:cut])
    if not st.finished:
        st.make_text(tokenizer)
        path, req = e.continuation_request(kind, body, st.prompt_ids, st.sent_ids,
                                           text_by_router=st.text is not None)
        st.begin_continuation()
        for ev in _events("completions", req["prompt"], req):
            got += st.feed(ev)
            if st.done:  # the router closes the upstream (its own stop-string cut)
                break
    return _client_text(kind, b"".join(ref)), _client_text(kind, got)


def test_continued_text_is_made_from_ids_not_taken_from_the_engine():
    """The engine that continues a stream primes its detokenizer with prompt + sent ids and
    starts with an empty stop-string buffer: when the splice falls inside a multi-byte
    character or inside text held back for a stop string, its text differs from the original
    stream's. The router's text, made from ids with the original request's state, does not."""
    from relocator.router.fakeserver import fake_tokenizer

    tok = fake_tokenizer()
    body = {"model": "m", "prompt": "x", "max_tokens": 60, "stream": True}
    prompt = list(b"the prompt ")
    ref_text = _events("completions", prompt, body)
    damaged = 0
    for cut in range(2, 40):
        ref, got = _spliced("completions", body, prompt, cut, tok)
        assert got == ref, cut
        ref, engine = _spliced("completions", body, prompt, cut, None)
        damaged += engine != ref
    assert damaged > 0, "no splice fell inside a multi-byte character: the test shows nothing"
    assert ref_text


try:
    from hypothesis import given, settings, strategies as hs
except ImportError:  # pragma: no cover
    given = None

if given is not None:
    @settings(max_examples=300, deadline=None)
    @given(kind=hs.sampled_from(["completions", "chat"]),
           prompt=hs.text(alphabet="abcdefgh éü中😀", min_size=1, max_size=12),
           stop=hs.lists(hs.text(alphabet="abcdefghijklmnopqrstuvwxyzé中😀", min_size=1,
                                 max_size=4), max_size=3),
           include=hs.booleans(), min_tokens=hs.integers(0, 30), cut=hs.integers(1, 70),
           max_tokens=hs.integers(1, 60))
    def test_continued_text_equals_uninterrupted_text(kind, prompt, stop, include, min_tokens,
                                                      cut, max_tokens):
        """Hundreds of splices: multi-byte characters, stop strings held back across the
        splice, min_tokens, include_stop_str_in_output; completions and chat."""
        from relocator.router.fakeserver import fake_tokenizer

        body = {"model": "m", "max_tokens": max_tokens, "stream": True, "stop": stop,
                "include_stop_str_in_output": include, "min_tokens": min_tokens}
        if kind == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
            ids = list(f"<user>{prompt}<assistant>".encode())
        else:
            body["prompt"] = prompt
            ids = list(prompt.encode())
        ref, got = _spliced(kind, body, ids, cut, fake_tokenizer())
        assert got == ref


# ---- usage: what platforms bill from must equal a run that never moved (issue 25, 3) -----
def _usages(raw: bytes) -> list[tuple[bool, dict]]:
    """(final usage chunk?, usage) of every event carrying usage, in order."""
    out = []
    for ev in raw.decode().split("\n\n"):
        if ev.startswith("data: {"):
            obj = json.loads(ev[6:])
            if obj.get("usage") is not None:
                out.append((obj.get("choices") == [], obj["usage"]))
    return out


def _usage_body(kind: str, continuous: bool = False) -> dict:
    body = {"model": "m", "max_tokens": 9, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": continuous}}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if kind == "chat"
                else {"prompt": "hi"})
    return body


def _fake_stream(kind: str, prompt: list[int], body: dict, want_ids: bool = True) -> list[bytes]:
    from relocator.router.fakeserver import FakeEngine, generate

    out, pieces, finish, reason = generate(prompt, body, body["max_tokens"])
    evs = FakeEngine("m")._events(kind, "c-1", 5, prompt, out, pieces, finish, reason,
                                  want_ids, body)
    return [e.encode() for e in evs]


PROMPT = list(b"<user>hi<assistant>")


@pytest.mark.parametrize("kind", ["completions", "chat"])
@pytest.mark.parametrize("continuous", [False, True])
@pytest.mark.parametrize("engine_usage_passed", [False, True])
def test_usage_when_the_upstream_breaks_between_finish_and_done(kind, continuous,
                                                                engine_usage_passed):
    """The engine's stream ends after its finish chunk (before its usage chunk, or after it):
    the client still gets exactly one final usage chunk, the uninterrupted run's."""
    body = _usage_body(kind, continuous)
    ref = _fake_stream(kind, PROMPT, body)
    assert ref[-1] == b"data: [DONE]\n\n" and b'"choices":[]' in ref[-2]
    st = StreamState(kind, body, codec=VLLMCodec())
    got = b"".join(st.feed(ev) for ev in ref[:-1 if engine_usage_passed else -2])
    assert st.finished and not st.done
    got += st.tail_after_finish()
    assert got.endswith(b"data: [DONE]\n\n")
    want = _usages(b"".join(ref))
    assert [u for u in _usages(got) if u[0]] == [want[-1]]  # exactly one, the engine's counts
    assert _usages(got) == want


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_usage_of_an_untracked_stream_comes_from_the_engine(kind):
    """A stream the router does not continue carries no ids: the counts of a usage chunk
    the router must make come from the engine's per-chunk usage; without any, none is
    invented (no zeros)."""
    for continuous in (True, False):
        body = _usage_body(kind, continuous)
        ref = _fake_stream(kind, PROMPT, body, want_ids=False)
        st = StreamState(kind, body, continuation=False, codec=VLLMCodec())
        got = b"".join(st.feed(ev) for ev in ref[:-2]) + st.tail_after_finish()
        finals = [u for u in _usages(got) if u[0]]
        assert finals == ([_usages(b"".join(ref))[-1]] if continuous else [])
        assert got.endswith(b"data: [DONE]\n\n")


def _spliced_usage(kind: str, body: dict, cut: int, second_break: bool = False,
                   details: dict | None = None) -> bytes:
    """The client's bytes when the stream breaks after `cut` events and is continued (the
    continuation itself breaking between its finish and [DONE] if `second_break`)."""
    e = VLLMCodec()
    st = StreamState(kind, body, codec=e)
    ref = _fake_stream(kind, PROMPT, body)
    got = b"".join(st.feed(ev) for ev in ref[:cut])
    assert not st.finished
    _, req = e.continuation_request(kind, body, st.prompt_ids, st.sent_ids)
    st.begin_continuation()
    cont = _fake_stream("completions", req["prompt"], req)
    if details is not None:  # an engine reporting cached prompt tokens (of prompt + sent ids)
        cont[-2] = cont[-2].replace(b'"completion_tokens"', b'"prompt_tokens_details":'
                                    + json.dumps(details).encode() + b',"completion_tokens"')
    for ev in cont[:-2] if second_break else cont:
        got += st.feed(ev)
    if second_break:
        assert st.finished and not st.done
        got += st.tail_after_finish()
    return got


@pytest.mark.parametrize("kind", ["completions", "chat"])
@pytest.mark.parametrize("second_break", [False, True])
def test_continuous_usage_through_a_splice(kind, second_break):
    """vLLM's per-chunk usage (continuous_usage_stats, as aiperf asks) after a splice counts
    the whole request: the original prompt, every token sent so far; one final usage."""
    body = _usage_body(kind, continuous=True)
    want = _usages(b"".join(_fake_stream(kind, PROMPT, body)))
    assert len(want) > 5 and all(u["prompt_tokens"] == len(PROMPT) for _, u in want)
    for cut in (2, 4, 7):
        got = _usages(_spliced_usage(kind, body, cut, second_break))
        assert got == want, cut


def test_usage_fields_beyond_the_counts_after_a_splice():
    """The engine's other usage fields pass; cached prompt tokens of a continuation (counted
    over prompt + sent ids) are never more than the original prompt."""
    body = _usage_body("completions")
    got = _usages(_spliced_usage("completions", body, 3, details={"cached_tokens": 25}))
    assert [u for fin, u in got if fin] == [{
        "prompt_tokens": len(PROMPT), "total_tokens": len(PROMPT) + 9, "completion_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": len(PROMPT)}}]
    got = _usages(_spliced_usage("completions", body, 3, details={"cached_tokens": 4}))
    assert got[-1][1]["prompt_tokens_details"] == {"cached_tokens": 4}


def test_stream_flags_are_read_as_the_engine_reads_them():
    from relocator.router.stream import lax_bool

    assert [lax_bool(v) for v in (True, "true", "yes", 1, "on")] == [True] * 5
    assert [lax_bool(v) for v in (False, "false", "no", 0, "off", None, [], {})] == [False] * 8
    st = StreamState("completions", {"model": "m", "stream_options": {
        "include_usage": "false", "continuous_usage_stats": True}})
    assert not st.include_usage and not st.continuous_usage
    st = StreamState("completions", {"model": "m", "stream_options": "junk"})
    assert not st.include_usage


def test_parse_body_refuses_the_types_the_router_would_crash_on():
    """A 400 in OpenAI's shape for a wrong-typed field the router reads itself before an
    engine validates it: stream_options (the stream state), and the integers a translated
    first request (SGLang chat) converts (its text making and budget: int() would raise)."""
    from adapters.vllm.outtext import TextParams
    from relocator.router.core import parse_body

    t = RoutingTable()
    t.add("w", "m", "http://a")
    with pytest.raises(ValueError):
        TextParams.from_body({"min_tokens": "lots"})  # what the 400 keeps from happening
    for field, raw in [("stream_options", b'"x"'), ("stream_options", b"true"),
                       ("stream_options", b"[1]"), ("max_tokens", b'"lots"'),
                       ("max_tokens", b"Infinity"), ("min_tokens", b"NaN"),
                       ("max_completion_tokens", b"{}"), ("min_tokens", b"true"),
                       ("max_tokens", b"2.5")]:
        with pytest.raises(errors.RouterError) as ei:
            parse_body(b'{"model": "m", "%s": %s}' % (field.encode(), raw), t)
        e = ei.value
        assert (e.status, e.param, e.code) == (400, field, "invalid_type"), (field, raw)
        assert set(e.body()["error"]) == {"message", "type", "param", "code"}
    for ok in (b'"stream_options": null', b'"stream_options": {}', b'"max_tokens": 5.0',
               b'"max_tokens": -1', b'"min_tokens": null', b'"max_tokens": 100000000000000'):
        assert parse_body(b'{"model": "m", %s}' % ok, t)["model"] == "m"  # the engine's to judge


def test_a_stream_flag_the_engine_reads_as_true_is_streamed_by_the_router():
    """"stream": "true" (a string) is a streamed request to vLLM's pydantic: the router must take
    the stream path for it too, and the unary one for the strings vLLM reads as false."""
    from relocator.router.core import RouterCore, parse_body

    t = RoutingTable()
    t.add("w", "m", "http://a")
    for raw, want in [(b'"true"', True), (b'"on"', True), (b"1", True), (b"true", True),
                      (b'"false"', False), (b'"off"', False), (b"0", False), (b"null", False)]:
        assert parse_body(b'{"model": "m", "prompt": "x", "stream": %s}' % raw, t)["stream"] is want

    core = RouterCore(t, None)  # type: ignore[arg-type]  # never reaches an upstream here
    taken: list[str] = []

    async def stream(*a, **k):
        taken.append("stream")

    async def unary(*a, **k):
        taken.append("unary")

    core._stream, core._unary = stream, unary  # type: ignore[method-assign]
    for flag in (b'"true"', b'"false"'):
        asyncio.run(core.handle("completions", b'{"model": "m", "prompt": "x", "stream": %s}' % flag))
    assert taken == ["stream", "unary"]
