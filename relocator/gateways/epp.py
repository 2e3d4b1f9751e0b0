"""The endpoint picker for Envoy-based gateways (`relocator gateway epp`): the Gateway API
Inference Extension's endpoint-picker protocol over Envoy's external processing (ext_proc)
gRPC API, picking from relocator's routing table.

Per HTTP request Envoy opens one `Process` stream and sends its request headers, then (with
`request_body_mode: BUFFERED`) the whole body. The picker reads `model` (and the affinity key)
from the body, asks the routing table for a replica - `table.acquire()`, which **waits while
the worker is held** (HOLD..SWITCH), bounded by `hold_timeout_s` - and answers the body message
with the chosen endpoint as `ip:port`, both as dynamic metadata (namespace `envoy.lb`, key
`x-gateway-destination-endpoint`, what GAIE's Envoy configuration reads) and as the request
header of the same name (`clear_route_cache` set), so an ORIGINAL_DST cluster can route on
either. While it waits it first tells Envoy to extend its per-message timeout
(`override_message_timeout`, honoured when the filter sets `max_message_timeout`). An unknown
model, a bad body or a hold that runs out is answered by Envoy with an OpenAI-shaped error
(`immediate_response`). The request's in-flight count ends when Envoy closes the stream.

Envoy keeps the data path, so a picker alone moves **new** requests only: a stream in flight
on a worker being moved would break. Streams that should be continued are therefore sent
through the relocator router served by the same process on the same table (`via_router`:
`streams`, the default, sends streaming requests there; `all` every request; `none` nothing);
the router continues them token-exactly on the switched worker. The control API is the
router's (one table, one control API for both)."""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Callable, Mapping
from urllib.parse import urlsplit

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2, struct_pb2

from relocator.gateways import ViaRouter
from relocator.router import errors
from relocator.router.core import RouterCore, parse_body
from relocator.router.errors import RouterError
from relocator.router.table import Replica, RoutingTable

log = logging.getLogger(__name__)

#: GAIE's names: the dynamic-metadata namespace and the key / header carrying the endpoint
LB_NAMESPACE = "envoy.lb"
DESTINATION = "x-gateway-destination-endpoint"


def host_port(url: str) -> str:
    """`http://10.0.0.5:8000` -> `10.0.0.5:8000` (what Envoy's ORIGINAL_DST cluster wants)."""
    u = urlsplit(url)
    if not u.hostname or not u.port:
        raise ValueError(f"endpoint needs a host and a port: {url!r}")
    host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
    return f"{host}:{u.port}"


def _headers(h: pb.HttpHeaders) -> dict[str, str]:
    # Envoy sends values in raw_value (bytes) since 1.27; older ones in value
    return {x.key.lower(): (x.raw_value.decode("utf-8", "replace") if x.raw_value else x.value)
            for x in h.headers.headers}


def _continue_headers() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse(
        response=pb.CommonResponse(status=pb.CommonResponse.CONTINUE)))


def picked(endpoint: str) -> pb.ProcessingResponse:
    """The body answer naming the destination: header mutation + dynamic metadata."""
    hv = base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=DESTINATION, raw_value=endpoint.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
    meta = struct_pb2.Struct()
    meta.update({LB_NAMESPACE: {DESTINATION: endpoint}})
    return pb.ProcessingResponse(
        request_body=pb.BodyResponse(response=pb.CommonResponse(
            status=pb.CommonResponse.CONTINUE, clear_route_cache=True,
            header_mutation=pb.HeaderMutation(set_headers=[hv]))),
        dynamic_metadata=meta)


def refused(e: RouterError) -> pb.ProcessingResponse:
    """Envoy answers the client itself, with the router's OpenAI-shaped error."""
    ct = base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(
        key="content-type", raw_value=b"application/json"))
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=e.status), body=e.json_body(),
        headers=pb.HeaderMutation(set_headers=[ct]), details=e.code or "relocator_epp"))


def wait_longer(seconds: float) -> pb.ProcessingResponse:
    d = duration_pb2.Duration()
    d.FromMilliseconds(int(seconds * 1000))
    return pb.ProcessingResponse(override_message_timeout=d)


class EndpointPicker(pb_grpc.ExternalProcessorServicer):
    """One `Process` stream per HTTP request. `router_endpoint`: `ip:port` of the relocator
    router that continues streams (None: every request goes to a worker directly)."""

    def __init__(self, table: RoutingTable, *, router_endpoint: str | None = None,
                 via_router: str = ViaRouter.STREAMS, max_body_bytes: int = 4 << 20,
                 on_pick: Callable[[str], None] | None = None) -> None:
        self.table = table
        self.router_endpoint = router_endpoint
        self.via_router = ViaRouter(via_router)
        self.max_body_bytes = max_body_bytes
        #: picks made, by destination kind: worker, router, refused
        self.picks = {"worker": 0, "router": 0, "refused": 0}
        self.on_pick = on_pick  # a metric hook (EppGateway: relocator_epp_picks_total)

    def _count(self, kind: str) -> None:
        self.picks[kind] += 1
        if self.on_pick is not None:
            self.on_pick(kind)

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        headers: dict[str, str] = {}
        body = b""
        acquired: Replica | None = None
        try:
            async for req in request_iterator:
                kind = req.WhichOneof("request")
                if kind == "request_headers":
                    # a request without a body (GET /v1/models) is routed by Envoy's own rules
                    headers = _headers(req.request_headers)
                    yield _continue_headers()
                elif kind == "request_body":
                    body += req.request_body.body
                    if len(body) > self.max_body_bytes:
                        self._count("refused")
                        yield refused(errors.body_too_large(self.max_body_bytes))
                        return
                    if not req.request_body.end_of_stream:
                        # STREAMED body mode: acknowledge each chunk, pick at the end
                        yield pb.ProcessingResponse(request_body=pb.BodyResponse(
                            response=pb.CommonResponse()))
                        continue
                    async for resp in self._pick(headers, body):
                        if isinstance(resp, Replica):
                            acquired = resp
                            continue
                        yield resp
                elif kind == "response_headers":
                    yield pb.ProcessingResponse(response_headers=pb.HeadersResponse(
                        response=pb.CommonResponse()))
                elif kind == "response_body":
                    yield pb.ProcessingResponse(response_body=pb.BodyResponse(
                        response=pb.CommonResponse()))
                elif kind == "request_trailers":
                    yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
                elif kind == "response_trailers":
                    yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
        finally:
            if acquired is not None:  # the request is over (or Envoy went away)
                self.table.done(acquired)

    async def _pick(self, headers: Mapping[str, str], raw: bytes):
        """Yields responses for Envoy, and the acquired replica (kept until the stream ends)."""
        try:
            body = parse_body(raw, self.table)
            model = body["model"]
            if self._via_router(body):
                if not self.table.has_model(model):
                    raise errors.model_not_found(model)
                self._count("router")
                yield picked(self.router_endpoint)  # type: ignore[arg-type]
                return
            key = RouterCore.affinity_key(body, headers) if self.table.policy.needs_key else None
            task = asyncio.ensure_future(self.table.acquire(model, key))
            done, _ = await asyncio.wait({task}, timeout=0)
            if not done:  # held: keep Envoy from timing the message out while we wait
                yield wait_longer(self.table.hold_timeout_s + 5)
            try:
                r = await task
            except asyncio.CancelledError:
                task.cancel()
                raise
            yield r
            self._count("worker")
            yield picked(host_port(r.endpoint))
        except RouterError as e:
            self._count("refused")
            yield refused(e)

    def _via_router(self, body: dict) -> bool:
        if self.router_endpoint is None or self.via_router is ViaRouter.NONE:
            return False
        return self.via_router is ViaRouter.ALL or body.get("stream") is True


async def serve_epp(picker: EndpointPicker, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Start the ext_proc gRPC server; returns it and the bound port."""
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(picker, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise OSError(f"cannot listen on {host}:{port}")
    await server.start()
    return server, bound


class EppGateway:
    """`relocator gateway epp`: the relocator router (OpenAI API for the streams it continues,
    and the control API) and the endpoint picker on one routing table, in one process."""

    def __init__(self, settings, grpc_host: str = "127.0.0.1", grpc_port: int = 9002,
                 router_address: str | None = None,
                 via_router: str = ViaRouter.STREAMS) -> None:
        from relocator.router.server import RouterServer

        self.server = RouterServer(settings)
        self.grpc_host, self.grpc_port = grpc_host, grpc_port
        self.router_address = router_address
        self.via_router = via_router
        self.picker: EndpointPicker | None = None
        self._grpc: grpc.aio.Server | None = None

    async def start(self) -> "EppGateway":
        await self.server.start()
        from prometheus_client import Counter

        picks = Counter("relocator_epp_picks", "Endpoint picker answers by destination: "
                        "worker, router (streams it continues), refused (an error for Envoy)",
                        ["to"], registry=self.server.hooks.registry)
        addr = self.router_address or f"127.0.0.1:{self.server.port}"
        self.picker = EndpointPicker(self.server.table, router_endpoint=addr,
                                     via_router=self.via_router,
                                     max_body_bytes=self.server.settings.max_body_bytes,
                                     on_pick=lambda kind: picks.labels(kind).inc())
        self._grpc, self.grpc_port = await serve_epp(self.picker, self.grpc_host, self.grpc_port)
        return self

    async def stop(self) -> None:
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
        await self.server.stop()

    @property
    def control_url(self) -> str:
        return self.server.control_url
