"""The LiteLLM plugin: relocator's router core inside a LiteLLM proxy, as a custom provider.

LiteLLM loads it from its config (its documented `custom_provider_map` hook)::

    model_list:
      - model_name: tiny-llama                 # what clients ask for
        litellm_params: {model: relocator/tiny-llama}   # relocator/<model in the table>
    litellm_settings:
      custom_provider_map:
        - {provider: relocator, custom_handler: relocator.gateways.litellm.handler}

A custom provider gets the whole upstream call in-process: the plugin hands the request to
`RouterCore.handle()` (the standalone router's core: routing table, policy, hold queue,
retries before the first byte, token-exact continuation with router-made text) and turns what
the core yields into LiteLLM's `GenericStreamingChunk`s. So a worker that is held waits
(HOLD..SWITCH), a switched worker's streams are continued on its new endpoint, and LiteLLM's
own features (keys, budgets, logging) stay in front.

The routing table is fed by the same control API as the standalone router's
(relocator.router.control), served from LiteLLM's event loop on `control_port` as soon as the
proxy loads its config. Settings: `RouterSettings` from the YAML file named by
RELOCATOR_GATEWAY_CONFIG (top level or under `router:`), then RELOCATOR_ROUTER_* variables
(`backends`, `control_port`, `control_token`, `hold_timeout_s`, ...); the router's Prometheus
metrics are served beside the control API (`GET /metrics`). Run LiteLLM with one
worker process (its default): each process would hold a table of its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import AsyncIterator

from aiohttp import web
from litellm.llms.custom_llm import CustomLLM, CustomLLMError
from litellm.types.utils import GenericStreamingChunk, ModelResponse

from relocator.gateways.litellm_codec import StreamError, chunk_of, request_body, sse_events
from relocator.router.config import RouterSettings
from relocator.router.control import ControlAPI, serve_app
from relocator.router.core import Stream
from relocator.router.errors import RouterError
from relocator.router.runtime import RouterRuntime

log = logging.getLogger(__name__)

def _settings() -> RouterSettings:
    path = os.environ.get("RELOCATOR_GATEWAY_CONFIG")
    return RouterSettings.load(path) if path else RouterSettings()


class RelocatorLLM(CustomLLM):
    """The custom provider. One per proxy process (`handler` below), holding one
    `RouterRuntime`; started in the proxy's event loop."""

    def __init__(self, settings: RouterSettings | None = None) -> None:
        super().__init__()
        self._settings = settings
        self.rt: RouterRuntime | None = None
        self.control_port: int | None = None
        self._started: asyncio.Future | None = None

    def runtime(self) -> RouterRuntime:
        if self.rt is None:
            self.rt = RouterRuntime(self._settings or _settings())
        return self.rt

    async def start(self) -> RouterRuntime:
        """Build the core and serve the control API (once, in the running loop)."""
        if self._started is None:
            self._started = asyncio.get_running_loop().create_future()
            try:
                rt = self.runtime()
                rt.start()
                control = ControlAPI(rt)
                app = control.app()
                # the router's Prometheus metrics (relocator_router_*), beside its control API
                app.router.add_get("/metrics", lambda _r: web.Response(
                    body=rt.hooks.render(),
                    headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}))
                self.control_port = await serve_app(app, control.host(),
                                                    rt.settings.control_port)
                log.warning("relocator plugin: control API on %s:%d, %d replicas",
                            control.host(), self.control_port, len(rt.table.replicas()))
                self._started.set_result(rt)
            except BaseException as e:
                self._started.set_exception(e)
                raise
        return await asyncio.shield(self._started)

    async def _handle(self, model: str, messages: list, optional_params: dict, stream: bool):
        rt = await self.start()
        assert rt.core is not None
        try:
            return await rt.core.handle("chat", request_body(model, messages, optional_params,
                                                             stream))
        except RouterError as e:
            raise CustomLLMError(status_code=e.status, message=str(e)) from None

    async def acompletion(self, model: str, messages: list, api_base: str,
                          custom_prompt_dict: dict, model_response: ModelResponse,
                          print_verbose, encoding, api_key, logging_obj, optional_params: dict,
                          acompletion=None, litellm_params=None, logger_fn=None, headers={},
                          timeout=None, client=None) -> ModelResponse:
        res = await self._handle(model, messages, optional_params, stream=False)
        if isinstance(res, Stream):  # pragma: no cover - the core streams only when asked
            raise CustomLLMError(status_code=500, message="unexpected stream")
        try:
            data = json.loads(res.body)
        except ValueError:
            data = {}
        if res.status != 200:
            err = data.get("error") if isinstance(data, dict) else None
            msg = err.get("message") if isinstance(err, dict) else res.body[:500].decode(
                errors="replace")
            raise CustomLLMError(status_code=res.status, message=msg)
        return ModelResponse(**data)

    async def astreaming(self, model: str, messages: list, api_base: str,
                         custom_prompt_dict: dict, model_response: ModelResponse,
                         print_verbose, encoding, api_key, logging_obj, optional_params: dict,
                         acompletion=None, litellm_params=None, logger_fn=None, headers={},
                         timeout=None, client=None) -> AsyncIterator[GenericStreamingChunk]:
        res = await self._handle(model, messages, optional_params, stream=True)
        if not isinstance(res, Stream):  # the engine refused it (4xx/5xx before any byte)
            try:
                err = json.loads(res.body).get("error", {})
                msg = err.get("message") if isinstance(err, dict) else str(err)
            except (ValueError, AttributeError):
                msg = res.body[:500].decode(errors="replace")
            raise CustomLLMError(status_code=res.status, message=msg)
        gen = res.chunks
        try:
            async for event in sse_events(gen):
                c = chunk_of(event)
                if c is not None:
                    yield GenericStreamingChunk(**c)  # type: ignore[typeddict-item]
        except StreamError as e:  # the core's error event (continuation_failed, ...)
            raise CustomLLMError(status_code=e.status, message=e.message) from None
        finally:
            await gen.aclose()  # type: ignore[attr-defined]  # closes the upstream request


#: what `custom_handler: relocator.gateways.litellm.handler` names
handler = RelocatorLLM()


def _start_with_proxy() -> None:
    """LiteLLM imports this module while it loads its config inside its running event loop:
    start serving the control API there, so the controller can register workers before the
    first request."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return  # imported outside a loop (tests, tooling): started on the first request
    task = loop.create_task(handler.start())
    task.add_done_callback(lambda t: t.cancelled() or t.exception() is None or log.error(
        "relocator plugin did not start: %s", t.exception()))


_start_with_proxy()
