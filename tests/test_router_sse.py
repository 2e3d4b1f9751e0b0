"""The one SSE reader (relocator/router/sse.py): events cut anywhere, [DONE], odd framing."""

from __future__ import annotations

import asyncio

from relocator.router import sse

BODY = (b'data: {"a":1}\n\n'
        b': a comment, no data\n\n'
        b'data:{"b":2}\n\n'
        b'event: x\ndata: {"c":\ndata: 3}\n\n'
        b'data: [DONE]\n\n')
WANT = [b'{"a":1}', b'{"b":2}', b'{"c":\n3}', b"[DONE]"]


def _read(chunks: list[bytes]) -> list[bytes]:
    async def go() -> list[bytes]:
        async def gen():
            for c in chunks:
                yield c
        return [p async for p in sse.read(gen())]

    return asyncio.run(go())


def test_payloads_of_whole_events():
    assert list(sse.payloads(BODY)) == WANT


def test_read_gives_the_same_payloads_however_the_body_is_cut():
    for size in (1, 2, 3, 7, 16, len(BODY)):
        chunks = [BODY[i:i + size] for i in range(0, len(BODY), size)]
        assert _read(chunks) == WANT, size


def test_a_partial_event_at_the_end_is_dropped():
    assert _read([b'data: {"a":1}\n\ndata: {"b"']) == [b'{"a":1}']


def test_framer_keeps_the_partial_event_until_it_completes():
    f = sse.Framer()
    assert f.push(b'data: {"a"') == b""
    assert f.push(b':1}\n\ndata: {"b":2}') == b'data: {"a":1}\n\n'
    assert f.push(b"\n\n") == b'data: {"b":2}\n\n'
    f.push(b"data: half")
    f.clear()
    assert f.push(b"data: [DONE]\n\n") == sse.DONE


def test_json_object_and_done_tail():
    assert sse.json_object(b'{"x":1}') == {"x": 1}
    assert sse.json_object(b"[DONE]") is None
    assert sse.json_object(b"[1, 2]") is None
    assert sse.ends_done(b'data: {"a":1}\n\ndata: [DONE]\n\n')
    assert not sse.ends_done(b'data: {"a":1}\n\n')
    assert sse.event(b"[DONE]") == sse.DONE
