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


def test_plain_switch_still_cuts_every_stream():
    t = RoutingTable()
    t.add("w", "m", "http://src")
    a = _stream(t, {"temperature": 0}, [7])
    b = _stream(t, {"temperature": 0.8, "seed": 3}, [9])
    info = t.switch("w", "http://dst")
    assert info["moved_streams"] == 2 and info["kept_streams"] == 0
    assert a.moved and b.moved
