"""Pure pieces of the gateway shells: the LiteLLM plugin's translation (no LiteLLM needed)."""

from __future__ import annotations

import json

import pytest

from relocator.gateways.litellm_codec import StreamError, chunk_of, request_body, sse_events


def test_request_body_keeps_openai_fields_and_asks_for_usage():
    b = json.loads(request_body("m", [{"role": "user", "content": "hi"}],
                                {"max_tokens": 5, "temperature": 0, "stop": ["x"],
                                 "max_retries": 0, "extra_body": {"ignore_eos": True},
                                 "stream_options": {"include_usage": False}, "user": None},
                                stream=True))
    assert b == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                 "temperature": 0, "stop": ["x"], "ignore_eos": True, "stream": True,
                 "stream_options": {"include_usage": True}}
    assert "stream" not in json.loads(request_body("m", [], {}, stream=False))


def test_chunks_of_chat_events():
    ev = {"choices": [{"index": 0, "delta": {"content": "ab"}, "finish_reason": None}]}
    assert chunk_of(ev) == {"text": "ab", "tool_use": None, "is_finished": False,
                            "finish_reason": "", "usage": None, "index": 0}
    end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    assert chunk_of(end)["is_finished"] and chunk_of(end)["finish_reason"] == "length"
    u = chunk_of({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4,
                                           "total_tokens": 7}})
    assert u["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert chunk_of({"choices": []}) is None


async def _collect(parts):
    async def gen():
        for p in parts:
            yield p
    return [e async for e in sse_events(gen())]


@pytest.mark.asyncio
async def test_sse_events_split_anywhere_and_stop_at_done():
    raw = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\ndata: {"choices":[]}\n\n' \
          b'data: [DONE]\n\ndata: {"late":1}\n\n'
    for cut in range(1, len(raw)):
        assert len(await _collect([raw[:cut], raw[cut:]])) == 2


@pytest.mark.asyncio
async def test_error_event_raises():
    raw = (b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
           b'data: {"error":{"message":"gone","code":"continuation_failed"}}\n\ndata: [DONE]\n\n')
    with pytest.raises(StreamError) as e:
        await _collect([raw])
    assert e.value.code == "continuation_failed" and e.value.status == 502
