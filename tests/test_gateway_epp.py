"""The endpoint picker (relocator.gateways.epp) over real gRPC with Envoy's real ext_proc
protobuf types (xds-protos): the message sequence Envoy sends for one request (request
headers, the buffered body, response headers, stream closed), replayed by a gRPC client."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import json_format

from relocator.gateways.epp import DESTINATION, LB_NAMESPACE, EndpointPicker, host_port, serve_epp
from relocator.router.table import RoutingTable

pytestmark = pytest.mark.asyncio(loop_scope="session")


def _hdrs(path="/v1/chat/completions", eos=False, **extra):
    hs = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in
          {":method": "POST", ":path": path, ":authority": "gw", "content-type":
           "application/json", **extra}.items()]
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=hs), end_of_stream=eos))


def _body(obj, eos=True):
    raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=eos))


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class _Envoy:
    """The Envoy side of one Process stream: send a message, read the answer(s)."""

    def __init__(self, stub):
        self.q: asyncio.Queue = asyncio.Queue()
        self.call = stub.Process(self._requests())

    async def _requests(self):
        while (m := await self.q.get()) is not None:
            yield m

    async def send(self, m):
        await self.q.put(m)
        return await self.call.read()

    async def close(self):
        await self.q.put(None)
        try:
            await self.call.read()
        except grpc.aio.AioRpcError:
            pass


@pytest.fixture
async def epp():
    table = RoutingTable(hold_timeout_s=30)
    table.add("w1", "m", "http://127.0.0.1:18001")
    picker = EndpointPicker(table, router_endpoint="127.0.0.1:8000")
    server, port = await serve_epp(picker, "127.0.0.1", 0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.ExternalProcessorStub(channel)
    yield table, picker, stub
    await channel.close()
    await server.stop(0)


def _destination(resp: pb.ProcessingResponse) -> tuple[str, str]:
    assert resp.WhichOneof("response") == "request_body", resp
    common = resp.request_body.response
    assert common.status == pb.CommonResponse.CONTINUE and common.clear_route_cache
    [h] = common.header_mutation.set_headers
    assert h.header.key == DESTINATION
    meta = json_format.MessageToDict(resp.dynamic_metadata)
    return h.header.raw_value.decode(), meta[LB_NAMESPACE][DESTINATION]


async def test_envoy_sequence_picks_the_current_endpoint_and_counts_in_flight(epp):
    table, picker, stub = epp
    e = _Envoy(stub)
    r = await e.send(_hdrs())
    assert r.WhichOneof("response") == "request_headers"
    assert r.request_headers.response.status == pb.CommonResponse.CONTINUE
    assert _destination(await e.send(_body(CHAT))) == ("127.0.0.1:18001",) * 2
    assert table.get("w1").in_flight == 1  # until Envoy closes the stream
    r = await e.send(pb.ProcessingRequest(response_headers=pb.HttpHeaders()))
    assert r.WhichOneof("response") == "response_headers"
    await e.close()
    for _ in range(100):
        if table.get("w1").in_flight == 0:
            break
        await asyncio.sleep(0.01)
    assert table.get("w1").in_flight == 0
    table.switch("w1", "http://127.0.0.1:18002")  # a finished move: new requests go there
    e = _Envoy(stub)
    await e.send(_hdrs())
    assert _destination(await e.send(_body(CHAT)))[0] == "127.0.0.1:18002"
    await e.close()


async def test_held_worker_delays_the_answer_until_switch(epp):
    table, picker, stub = epp
    table.hold("w1")
    e = _Envoy(stub)
    await e.send(_hdrs())
    await e.q.put(_body(CHAT))
    first = await e.call.read()  # the picker asks Envoy to wait longer, then waits itself
    assert first.WhichOneof("response") is None and first.override_message_timeout.seconds >= 30
    nxt = asyncio.ensure_future(e.call.read())
    await asyncio.sleep(0.3)
    assert not nxt.done() and len(table.get("w1").waiters) == 1
    table.switch("w1", "http://127.0.0.1:18003")
    assert _destination(await asyncio.wait_for(nxt, 10))[0] == "127.0.0.1:18003"
    await e.close()


async def test_envoy_going_away_while_held_leaves_no_waiter(epp):
    table, picker, stub = epp
    table.hold("w1")
    e = _Envoy(stub)
    await e.send(_hdrs())
    await e.q.put(_body(CHAT))
    await e.call.read()  # override_message_timeout
    e.call.cancel()  # Envoy's message timeout / the client gave up
    for _ in range(200):
        if not table.get("w1").waiters:
            break
        await asyncio.sleep(0.01)
    assert not table.get("w1").waiters
    table.release("w1")
    assert table.get("w1").in_flight == 0


@pytest.mark.parametrize("body,status,code", [
    ({"model": "nope", "messages": []}, 404, "model_not_found"),
    (b"{not json", 400, "invalid_json"),
    ({"messages": []}, 400, "missing_model"),
])
async def test_bad_requests_are_answered_by_envoy_with_openai_errors(epp, body, status, code):
    table, picker, stub = epp
    e = _Envoy(stub)
    await e.send(_hdrs())
    r = await e.send(_body(body))
    assert r.WhichOneof("response") == "immediate_response"
    assert r.immediate_response.status.code == status
    assert json.loads(r.immediate_response.body)["error"]["code"] == code
    await e.close()


async def test_hold_timeout_is_a_503(epp):
    table, picker, stub = epp
    table.hold_timeout_s = 0.3
    table.hold("w1")
    e = _Envoy(stub)
    await e.send(_hdrs())
    await e.q.put(_body(CHAT))
    await e.call.read()
    r = await asyncio.wait_for(e.call.read(), 10)
    assert r.immediate_response.status.code == 503
    assert json.loads(r.immediate_response.body)["error"]["code"] == "hold_timeout"
    await e.close()


async def test_streams_go_through_the_router_and_streamed_bodies_are_acknowledged(epp):
    table, picker, stub = epp
    e = _Envoy(stub)
    await e.send(_hdrs())
    raw = json.dumps({**CHAT, "stream": True}).encode()
    r = await e.send(_body(raw[:10], eos=False))  # STREAMED body mode: one chunk at a time
    assert r.WhichOneof("response") == "request_body" and not r.request_body.response.header_mutation.set_headers
    assert _destination(await e.send(_body(raw[10:])))[0] == "127.0.0.1:8000"
    assert table.get("w1").in_flight == 0  # the router counts it when it serves it
    await e.close()
    assert picker.picks["router"] == 1


async def test_host_port():
    assert host_port("http://10.0.0.5:8000/") == "10.0.0.5:8000"
    assert host_port("http://[::1]:9000") == "[::1]:9000"
    with pytest.raises(ValueError):
        host_port("http://nohost")


async def test_cli_serves_and_stops(tmp_path):
    """`relocator gateway epp` as a process: answers Envoy's sequence, exits 0 on SIGTERM; a bad
    option is one line and exit 2; `gateway litellm-config` prints a loadable config."""
    import signal
    import subprocess
    import sys

    import yaml

    from relocator.ports import free_port

    bad = subprocess.run([sys.executable, "-m", "relocator", "gateway", "epp", "-b", "nourl"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0, bad.stderr
    assert bad.stderr.startswith("error:"), bad.stderr
    cfg = subprocess.run([sys.executable, "-m", "relocator", "gateway", "litellm-config", "-m",
                          "tiny"], capture_output=True, text=True, timeout=60, check=True)
    conf = yaml.safe_load(cfg.stdout)
    assert conf["model_list"][0]["litellm_params"]["model"] == "relocator/tiny"
    assert conf["litellm_settings"]["custom_provider_map"][0]["custom_handler"] == \
        "relocator.gateways.litellm.handler"

    gport = free_port()
    p = subprocess.Popen([sys.executable, "-m", "relocator", "gateway", "epp", "-b",
                          "w1@m=http://127.0.0.1:18009", "--grpc-port", str(gport), "--port", "0",
                          "--control-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{gport}")
        await asyncio.wait_for(channel.channel_ready(), 60)
        e = _Envoy(pb_grpc.ExternalProcessorStub(channel))
        await e.send(_hdrs())
        assert _destination(await e.send(_body(CHAT)))[0] == "127.0.0.1:18009"
        await e.close()
        await channel.close()
        p.send_signal(signal.SIGTERM)
        out, err = await asyncio.to_thread(p.communicate, timeout=30)
        assert p.returncode == 0, err
        assert "endpoint picker on" in out
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
