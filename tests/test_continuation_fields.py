"""What a continuation keeps of each request field (docs/router.md, "What a continuation
keeps"): the continuation request bodies, the chat logprobs rebuild, and a model of vLLM's
sampler showing the penalty bias is exact (no engine, no processes); at the end two checks
with real vLLM CPU workers (integration: a moved run against an unmoved one)."""

from __future__ import annotations

import json
import random

import pytest

from adapters.codec import LOGIT_BIAS_LIMIT, chat_logprobs, inexact_reasons, penalty_bias
from adapters.sglang.codec import Codec as SGLCodec
from adapters.vllm.codec import Codec as VLLMCodec
from relocator.router.core import RouterCore
from relocator.router.metrics import PromHooks
from relocator.router.stream import StreamState
from relocator.router.table import RoutingTable

V = 40  # the model's vocabulary


# ---------------------------------------------------------------- vLLM's v1 sampler, modelled
def _logits(ctx: list[int]) -> list[float]:
    """A fixed 'model': logits from the last two tokens (deterministic, no ties)."""
    rng = random.Random(hash(tuple(ctx[-2:])) & 0xFFFFFFFF)
    return [rng.uniform(-5, 5) for _ in range(V)]


def _greedy(prompt: list[int], req: dict, n: int) -> list[int]:
    """Greedy decoding in vLLM's order (vllm/v1/sample/sampler.py): logit_bias (clamped to
    +-100), then repetition penalty over prompt + output, then frequency and presence penalty
    over output tokens only."""
    fp, pp = req.get("frequency_penalty", 0.0), req.get("presence_penalty", 0.0)
    rp = req.get("repetition_penalty", 1.0)
    bias = {int(k): max(-100.0, min(100.0, v)) for k, v in (req.get("logit_bias") or {}).items()}
    out: list[int] = []
    for _ in range(n):
        lg = _logits(prompt + out)
        for t, b in bias.items():
            lg[t] += b
        seen = set(prompt) | set(out)
        lg = [(x / rp if x > 0 else x * rp) if t in seen else x for t, x in enumerate(lg)]
        for t in set(out):
            lg[t] -= fp * out.count(t) + pp
        out.append(max(range(V), key=lg.__getitem__))
    return out


def _continued(body: dict, prompt: list[int], n: int, cut: int) -> list[int]:
    """The same request, broken after `cut` tokens and continued as the router does."""
    sent = _greedy(prompt, body, cut)
    _, req = VLLMCodec().continuation_request("completions", body, prompt, sent)
    return sent + _greedy(req["prompt"], req, n - cut)


@pytest.mark.parametrize("extra", [{"frequency_penalty": 0.5},
                                   {"frequency_penalty": 1.7, "logit_bias": {"3": 2.0}},
                                   {"frequency_penalty": -0.4}])
def test_frequency_penalty_continues_exactly(extra):
    """The tokens already sent become prompt tokens, which frequency penalty does not count:
    without the bias that stands in for it the greedy run diverges after the splice."""
    body = {"model": "m", "prompt": [1, 2, 3], "temperature": 0, **extra}
    prompt = [1, 2, 3]
    ref = _greedy(prompt, body, 60)
    assert len(set(ref)) > 3, "the model loops on one token: the test shows nothing"
    for cut in range(1, 60, 7):
        assert _continued(body, prompt, 60, cut) == ref, cut
        assert inexact_reasons("completions", body, ref[:cut]) == []


def test_without_the_bias_the_continuation_would_drift():
    """The model above is sensitive to the penalty: the old continuation (penalty over the
    new tokens only) gives another answer, so the exactness test can fail."""
    body = {"model": "m", "temperature": 0, "frequency_penalty": 0.5}
    prompt = [1, 2, 3]
    ref = _greedy(prompt, body, 60)
    drift = [cut for cut in range(1, 60, 7)
             if ref[:cut] + _greedy(prompt + ref[:cut], body, 60 - cut) != ref]
    assert drift


def test_penalty_bias_counts_sent_tokens_and_merges_the_clients_bias():
    body = {"frequency_penalty": 0.5, "presence_penalty": 0.25, "logit_bias": {"7": 1.0, "9": 3}}
    bias = penalty_bias(body, [7, 7, 8, 7])
    assert bias == {"7": 1.0 - 1.5 - 0.25, "8": -0.75, "9": 3.0}
    assert all(isinstance(k, str) for k in bias)  # vLLM takes string keys
    assert penalty_bias({"frequency_penalty": 0}, [1, 2]) is None
    assert penalty_bias({"frequency_penalty": 1}, []) is None
    clamped = penalty_bias({"frequency_penalty": 2.0}, [5] * 80)
    assert clamped == {"5": -LOGIT_BIAS_LIMIT}
    assert "logit_bias_clamped" in inexact_reasons("completions", {"frequency_penalty": 2.0},
                                                   [5] * 80)


@pytest.mark.parametrize("codec", [VLLMCodec(), SGLCodec()])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_continuation_request_fields(codec, kind):
    body = {"model": "m", "max_tokens": 20, "min_tokens": 5, "frequency_penalty": 0.5,
            "truncate_prompt_tokens": 3, "logit_bias": {"4": 1.5}, "temperature": 0,
            "stop_token_ids": [2], "ignore_eos": True}
    body.update({"messages": []} if kind == "chat" else {"prompt": "p"})
    _, req = codec.continuation_request(kind, body, [10, 11, 12], [4, 4, 6])
    assert req["prompt"] == [10, 11, 12, 4, 4, 6]
    # the prompt ids are already truncated: truncating again would cut into what was sent
    assert "truncate_prompt_tokens" not in req
    assert req["logit_bias"] == {"4": 1.5 - 1.0, "6": -0.5}
    assert req["frequency_penalty"] == 0.5  # the tokens generated from now on count as ever
    assert (req["max_tokens"], req["min_tokens"]) == (17, 2)
    assert req["stop_token_ids"] == [2] and req["ignore_eos"] is True
    # ids not yet truncated (SGLang's chat, rendered by the router): cut as the engine would
    _, req = codec.continuation_request(kind, body, [9, 10, 11, 12], [4])
    assert req["prompt"] == [10, 11, 12, 4]
    _, req = codec.continuation_request(kind, {**body, "truncation_side": "right"},
                                        [9, 10, 11, 12], [4])
    assert req["prompt"] == [9, 10, 11, 4] and "truncation_side" not in req


def test_vllm_continues_best_of_which_it_ignores():
    assert VLLMCodec().unsupported_reason("completions", {"prompt": "x", "best_of": 3}) is None
    assert VLLMCodec().unsupported_reason("completions", {"prompt": "x", "n": 2}) is not None


def test_vllm_echo_is_sent_as_it_is():
    """vLLM drops the echoed prompt text when `return_token_ids` is set: the router must not
    add it to an echo request (the client would miss its prompt text, with no move at all)."""
    raw = b'{"model":"m","prompt":"hello","echo":true,"stream":true}'
    st = StreamState("completions", json.loads(raw), raw, codec=VLLMCodec())
    assert st.unsupported == "echo" and not st.track
    assert st.use(VLLMCodec()) == raw


def test_inexact_reasons():
    sent = [1, 2, 1]
    assert inexact_reasons("completions", {"temperature": 0, "frequency_penalty": 1}, sent) == []
    assert inexact_reasons("chat", {"presence_penalty": 0.3, "temperature": 0},
                           sent) == ["presence_penalty"]
    assert "repetition_penalty_with_bias" in inexact_reasons(
        "completions", {"frequency_penalty": 1, "repetition_penalty": 1.2}, sent)
    assert inexact_reasons("completions", {"repetition_penalty": 1.2}, sent) == []
    assert inexact_reasons("completions", {"seed": 3, "temperature": 0.8}, sent) == ["seed"]
    assert inexact_reasons("completions", {"seed": 3, "temperature": 0}, sent) == []
    assert inexact_reasons("completions", {"bad_words": ["a b"]}, sent) == ["bad_words"]
    assert inexact_reasons("completions", {"presence_penalty": 1, "seed": 1}, []) == []


def test_inexact_continuations_are_counted_once_per_stream_and_reason():
    hooks = PromHooks()
    core = RouterCore(RoutingTable("round_robin"), None, hooks=hooks)  # type: ignore[arg-type]
    st = StreamState("completions", {"model": "m"}, codec=VLLMCodec())
    core._report_inexact(st, ["seed", "presence_penalty"])
    core._report_inexact(st, ["seed"])  # a second splice of the same stream
    get = hooks.registry.get_sample_value
    assert get("relocator_continuations_inexact_total", {"reason": "seed"}) == 1
    assert get("relocator_continuations_inexact_total", {"reason": "presence_penalty"}) == 1
    assert st.inexact == ["seed", "presence_penalty"]


# ---------------------------------------------------------------- chat with logprobs
def test_vllm_continues_chat_with_logprobs():
    body = {"model": "m", "messages": [], "logprobs": True, "top_logprobs": 2}
    e = VLLMCodec()
    assert e.unsupported_reason("chat", body) is None
    _, req = e.continuation_request("chat", body, [1], [2])
    assert req["logprobs"] == 2 and "top_logprobs" not in req
    _, req = e.continuation_request("chat", {"model": "m", "messages": [], "logprobs": True},
                                    [1], [2])
    assert req["logprobs"] == 0
    _, req = e.continuation_request("chat", {"model": "m", "messages": []}, [1], [2])
    assert "logprobs" not in req


def test_chat_logprobs_from_completions_logprobs():
    lp = {"text_offset": [0, 1], "token_logprobs": [-0.5, -1.25], "tokens": ["a", "é"],
          "top_logprobs": [{"a": -0.5, "b": -0.75, "c": -2.0}, {"x": -0.1, "é": -1.25}]}
    got = chat_logprobs(lp, 2, 2)
    assert got == {"content": [
        {"token": "a", "logprob": -0.5, "bytes": [97],
         "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]},
                          {"token": "b", "logprob": -0.75, "bytes": [98]}]},
        {"token": "é", "logprob": -1.25, "bytes": [195, 169],
         "top_logprobs": [{"token": "x", "logprob": -0.1, "bytes": [120]},
                          {"token": "é", "logprob": -1.25, "bytes": [195, 169]}]}]}
    assert [c["token"] for c in chat_logprobs(lp, 0, 1)["content"]] == ["a"]
    assert chat_logprobs(lp, 0, 1)["content"][0]["top_logprobs"] == []
    assert len(chat_logprobs(lp, -1, 2)["content"][0]["top_logprobs"]) == 3  # -1: all of them
    assert chat_logprobs(None, 2, 1) is None


def test_chat_stream_with_logprobs_keeps_them_after_a_splice():
    body = {"model": "m", "messages": [], "max_tokens": 4, "logprobs": True, "top_logprobs": 1}
    e = VLLMCodec()
    st = StreamState("chat", body, codec=e)
    assert st.track, st.unsupported
    first = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":5,'
             b'"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},'
             b'"logprobs":null,"finish_reason":null}],"prompt_token_ids":[1,2]}\n\n')
    tok = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":5,"model":"m",'
           b'"choices":[{"index":0,"delta":{"content":"a"},"logprobs":{"content":[{"token":"a",'
           b'"logprob":-0.5,"bytes":[97],"top_logprobs":[{"token":"a","logprob":-0.5,'
           b'"bytes":[97]}]}]},"finish_reason":null,"token_ids":[9]}]}\n\n')
    st.feed(first)
    st.feed(tok)
    _, req = e.continuation_request("chat", body, st.prompt_ids, st.sent_ids)
    assert req["logprobs"] == 1
    st.begin_continuation()
    cont = (b'data: {"id":"cmpl-9","object":"text_completion","created":7,"model":"m",'
            b'"choices":[{"index":0,"text":"b","logprobs":{"text_offset":[1],'
            b'"token_logprobs":[-0.25],"tokens":["b"],"top_logprobs":[{"b":-0.25,"c":-1.5}]},'
            b'"finish_reason":"length","stop_reason":null,"token_ids":[4]}]}\n\n'
            b'data: [DONE]\n\n')
    out = st.feed(cont).decode()
    chunk = json.loads(out.split("\n\n")[0][6:])
    assert chunk["object"] == "chat.completion.chunk"
    assert chunk["choices"][0]["logprobs"] == {"content": [
        {"token": "b", "logprob": -0.25, "bytes": [98],
         "top_logprobs": [{"token": "b", "logprob": -0.25, "bytes": [98]}]}]}


# ---------------------------------------------------------------- real vLLM CPU (integration)
async def _moved_and_direct(vllm_server, vllm_server_b, tiny_model_dir, chat: bool, body: dict,
                            limit: int = 2500):
    """(chunks of `body` made directly on B, chunks of it through the router while its worker
    A's connection drops after `limit` bytes and B continues it)."""
    import aiohttp

    from tests.test_router_vllm import _CutProxy, _read_sse, _router, _W

    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with aiohttp.ClientSession() as s:
        async with s.post(vllm_server_b.base_url + path, json=body) as r:
            ref = await _read_sse(r)
        proxy = await _CutProxy.start(vllm_server.base_url, limit=limit, mode="cut")
        srv = await _router(_W(proxy.url, vllm_server.model), vllm_server_b,
                            tokenizer=tiny_model_dir)
        try:
            async with s.post(srv.url + path, json=body) as r:
                assert r.status == 200
                got = await _read_sse(r)
            assert proxy.tripped.is_set()
            assert srv.hooks.cont.labels("ok")._value.get() == 1  # one splice, continued
        finally:
            await srv.stop()
            await proxy.close()
    return ref, got


def _finish(chunks) -> str | None:
    return [c["choices"][0]["finish_reason"] for c in chunks
            if isinstance(c, dict) and c.get("choices")][-1]


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="session")
async def test_vllm_frequency_penalty_stream_continues_token_identically(
        vllm_server, vllm_server_b, tiny_model_dir):
    from tests.test_router_vllm import _body, _ids

    # best_of: not a field of vLLM 0.32's request (ignored), so continued like the rest
    body = _body(vllm_server.model, False, return_token_ids=True, frequency_penalty=0.5,
                 max_tokens=300, ignore_eos=False, best_of=2)
    ref, got = await _moved_and_direct(vllm_server, vllm_server_b, tiny_model_dir, False, body)
    assert got[-1] == "[DONE]" and not any(isinstance(c, dict) and "error" in c for c in got)
    assert len(_ids(ref)) > 50
    assert _ids(got) == _ids(ref)
    assert _finish(got) == _finish(ref)


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="session")
async def test_vllm_chat_with_logprobs_survives_a_break(vllm_server, vllm_server_b,
                                                        tiny_model_dir):
    from tests.test_router_vllm import _body, _ids

    body = _body(vllm_server.model, True, return_token_ids=True, logprobs=True, top_logprobs=2,
                 max_tokens=120)
    ref, got = await _moved_and_direct(vllm_server, vllm_server_b, tiny_model_dir, True, body,
                                       limit=6000)
    assert got[-1] == "[DONE]" and not any(isinstance(c, dict) and "error" in c for c in got)
    assert _ids(got) == _ids(ref)

    def entries(chunks):
        out = []
        for c in chunks:
            if isinstance(c, dict) and c.get("choices") and c["choices"][0].get("token_ids"):
                lp = c["choices"][0]["logprobs"]
                assert lp and len(lp["content"]) == len(c["choices"][0]["token_ids"]), c
                out += lp["content"]
        return out

    a, b = entries(ref), entries(got)
    assert len(b) == len(_ids(ref))
    for x, y in zip(a, b):
        assert (x["token"], x["bytes"]) == (y["token"], y["bytes"])
        assert [t["token"] for t in x["top_logprobs"]] == [t["token"] for t in y["top_logprobs"]]
        assert y["logprob"] == pytest.approx(x["logprob"], abs=1e-3)


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="session")
async def test_vllm_echo_stream_through_the_router_keeps_the_prompt_text(vllm_server,
                                                                         tiny_model_dir):
    import aiohttp

    from tests.test_router_vllm import _body, _read_sse, _router, _text

    body = _body(vllm_server.model, False, echo=True, max_tokens=8)
    srv = await _router(vllm_server, tokenizer=tiny_model_dir)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(vllm_server.base_url + "/v1/completions", json=body) as r:
                ref = await _read_sse(r)
            async with s.post(srv.url + "/v1/completions", json=body) as r:
                got = await _read_sse(r)
    finally:
        await srv.stop()
    assert _text(ref, False).startswith(body["prompt"])
    assert _text(got, False) == _text(ref, False)


def _by_index(chunks) -> dict[int, str]:
    out: dict[int, str] = {}
    for c in chunks:
        for ch in (c.get("choices") or []) if isinstance(c, dict) else []:
            out[ch["index"]] = out.get(ch["index"], "") + (ch.get("text") or "")
    return out


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="session")
async def test_vllm_n_choices_are_vllms_and_survive_a_break(vllm_server, vllm_server_b,
                                                            tiny_model_dir):
    """n > 1 through the router (one request per choice, router/fanout.py) is what vLLM's own
    n > 1 gives, seeded sampling included (its children use seed + index); a break of one
    choice's connection is continued instead of ending the stream; greedy n > 1 is still
    refused by vLLM, as without the router."""
    import aiohttp

    from tests.test_router_vllm import _CutProxy, _body, _read_sse, _router, _W

    seeded = _body(vllm_server.model, False, n=3, temperature=0.8, seed=11, max_tokens=60)
    cut = _body(vllm_server.model, False, n=3, temperature=0.8, max_tokens=200)
    greedy = _body(vllm_server.model, False, n=3, max_tokens=5)
    async with aiohttp.ClientSession() as s:
        async with s.post(vllm_server_b.base_url + "/v1/completions", json=seeded) as r:
            ref = await _read_sse(r)
        proxy = await _CutProxy.start(vllm_server.base_url, limit=3000, mode="cut")
        srv = await _router(_W(proxy.url, vllm_server.model), vllm_server_b,
                            tokenizer=tiny_model_dir)
        try:
            async with s.post(srv.url + "/v1/completions", json=cut) as r:
                assert r.status == 200
                moved = await _read_sse(r)
            assert proxy.tripped.is_set()  # the one-shot cut fell in this request
            async with s.post(srv.url + "/v1/completions", json=seeded) as r:
                got = await _read_sse(r)
            async with s.post(srv.url + "/v1/completions", json=greedy) as r:
                refused = (r.status, await r.json())
        finally:
            await srv.stop()
            await proxy.close()
    assert refused[0] == 400 and "greedy" in json.dumps(refused[1]), refused
    assert srv.hooks.cont.labels("ok")._value.get() >= 1
    for chunks in (moved, got):
        assert chunks[-1] == "[DONE]"
        assert not any(isinstance(c, dict) and "error" in c for c in chunks), chunks[-3:]
        assert len(_by_index(chunks)) == 3
    assert _by_index(got) == _by_index(ref)  # seeded: vLLM's own n > 1, choice by choice

    def usage(chunks):
        return [(c["usage"]["prompt_tokens"], c["usage"]["completion_tokens"])
                for c in chunks if isinstance(c, dict) and c.get("usage")]

    assert usage(got) == usage(ref)[-1:] and usage(moved) == [(usage(ref)[-1][0], 3 * 200)]
