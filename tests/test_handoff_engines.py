"""A handoff's warm-up prefill in each engine's form (relocator/agent/modes/handoff.py and each
codec's `prefill_request` / `prefill_cached_tokens`): OpenAI completions with a token-id prompt
on vLLM and the reference engine, SGLang's native /generate with input_ids; the engine is the one
of the target's cell (the worker record's), and what each says it found cached is read."""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from adapters.base import get_codec
from relocator.agent.modes.handoff import HandoffOps, cached_tokens, engine_at, prefill_request


@pytest.mark.parametrize("engine", ["vllm", "reference"])
def test_openai_engines_get_a_completions_request_on_token_ids(engine: str) -> None:
    path, body = prefill_request("tiny", [3, 4, 5], engine)
    assert path == "/v1/completions", path
    assert body == {"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 1, "temperature": 0, "stream": False}, body
    ans = {"usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}}
    assert cached_tokens(json.dumps(ans).encode(), engine) == 2
    assert cached_tokens(b'{"usage": {"prompt_tokens": 3, "prompt_tokens_details": null}}', engine) == 0


def test_sglang_gets_its_native_generate_on_input_ids() -> None:
    path, body = prefill_request("tiny", [3, 4, 5], "sglang")
    assert path == "/generate", path
    assert body == {"input_ids": [3, 4, 5], "stream": False,
                    "sampling_params": {"max_new_tokens": 1, "temperature": 0}}, body
    # docs/sglang.md (b): meta_info.cached_tokens is the radix cache's hit
    ans = {"text": "x", "output_ids": [7], "meta_info": {"prompt_tokens": 3, "cached_tokens": 2,
                                                         "cached_tokens_details": {"device": 2, "host": 0}}}
    assert cached_tokens(json.dumps(ans).encode(), "sglang") == 2
    # another engine's answer, no meta_info, or not JSON: nothing said, 0
    assert cached_tokens(b'{"usage": {"prompt_tokens_details": {"cached_tokens": 2}}}', "sglang") == 0
    assert cached_tokens(b'{"meta_info": {"cached_tokens": null}}', "sglang") == 0
    assert cached_tokens(b"[1, 2]", "sglang") == 0
    assert cached_tokens(b"<html>", "sglang") == 0
    assert get_codec("sglang").prefill_cached_tokens({"meta_info": "odd"}) == 0


class _Engine(BaseHTTPRequestHandler):
    """A fake engine: answers /v1/completions as vLLM and /generate as SGLang, each saying the
    request's prompt but its last token was cached; records what it got."""

    got: list[tuple[str, dict]] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Engine.got.append((self.path, body))
        if self.path == "/generate":
            ans = {"text": "x", "output_ids": [1], "meta_info": {"cached_tokens": len(body["input_ids"]) - 1}}
        elif self.path == "/v1/completions":
            ans = {"choices": [{"text": "x"}], "usage": {
                "prompt_tokens": len(body["prompt"]), "prompt_tokens_details": {"cached_tokens": len(body["prompt"]) - 1}}}
        else:
            self.send_error(404)
            return
        data = json.dumps(ans).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def engine_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    _Engine.got = []
    yield srv
    srv.shutdown()
    srv.server_close()


def _cell(engine: str, port: int) -> None:
    from relocator.cell.cell import Cell

    Cell(id=f"c-{engine}", netns="none", ip="127.0.0.1", port=port, init_pid=os.getpid(), engine=engine).save()


@pytest.mark.parametrize("engine,path", [("sglang", "/generate"), ("reference", "/v1/completions"),
                                         ("vllm", "/v1/completions")])
def test_the_prefill_op_speaks_the_engine_of_the_targets_cell(engine: str, path: str, engine_server, tmp_path,
                                                              monkeypatch) -> None:
    monkeypatch.setenv("RELOCATOR_STATE_DIR", str(tmp_path))
    port = engine_server.server_address[1]
    endpoint = f"http://127.0.0.1:{port}"
    assert engine_at(endpoint) == "vllm"  # no cell of this node serves it: the default engine
    _cell(engine, port)
    assert engine_at(endpoint + "/") == engine
    seqs = [[1, 2, 3, 4], [5, 6, 7]]
    got = HandoffOps().prefill(endpoint, "tiny", seqs)
    assert got["engine"] == engine and got["sequences"] == 2 and got["tokens"] == 7, got
    assert got["cached_tokens"] == 5, f"the engine said 3 + 2 cached, the op read {got}"
    assert sorted(p for p, _ in _Engine.got) == [path, path], _Engine.got
    # an explicit engine wins over the cell's
    _Engine.got = []
    other = "vllm" if engine == "sglang" else "sglang"
    HandoffOps().prefill(endpoint, "tiny", [[1, 2]], engine=other)
    assert [p for p, _ in _Engine.got] == ["/generate" if other == "sglang" else "/v1/completions"], _Engine.got
    assert HandoffOps().prefill(endpoint, "tiny", [])["tokens"] == 0
