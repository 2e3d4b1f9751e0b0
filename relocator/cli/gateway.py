"""`relocator gateway epp` (the endpoint picker for Envoy-based gateways) and
`relocator gateway litellm-config` (a LiteLLM proxy config that loads the relocator plugin)."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import List, Optional

import typer

from relocator.choices import LogLevel
from relocator.cli import app
from relocator.cli.common import console, fail, handle_errors
from relocator.gateways import ViaRouter

gateway_app = typer.Typer(help="Plugins for request gateways: an Envoy endpoint picker, the "
                               "LiteLLM plugin's config.", no_args_is_help=True)
app.add_typer(gateway_app, name="gateway")


def _settings(config: Optional[str], backend: List[str], **overrides):
    from pydantic import ValidationError

    from relocator.router.config import RouterSettings, parse_backend

    try:
        s = RouterSettings.load(config, **overrides)
        if backend:
            s.backends = s.backends + [parse_backend(b) for b in backend]
    except (ValidationError, ValueError, OSError) as e:
        fail(" ".join(str(e).split()), 2)
    return s


@gateway_app.command("epp")
@handle_errors
def epp(
    config: Optional[str] = typer.Option(None, "--config", "-c", help="router YAML (top level "
                                         "or `router:`); RELOCATOR_ROUTER_* env overrides it"),
    backend: List[str] = typer.Option([], "--backend", "-b",
                                      help="MODEL=URL or WORKER@MODEL=URL, repeatable"),
    grpc_host: str = typer.Option("127.0.0.1", help="ext_proc gRPC listen address"),
    grpc_port: int = typer.Option(9002, min=0, max=65535, help="ext_proc gRPC port"),
    port: Optional[int] = typer.Option(None, min=0, max=65535,
                                       help="the router's OpenAI API port (streams it continues)"),
    control_port: Optional[int] = typer.Option(None, min=0, max=65535, help="control API port"),
    router_address: Optional[str] = typer.Option(
        None, help="ip:port Envoy reaches the router at (default 127.0.0.1:<port>)"),
    via_router: ViaRouter = typer.Option(ViaRouter.STREAMS, help="requests sent through the "
                                         "router, which continues them across a move"),
    log_level: LogLevel = typer.Option(LogLevel.WARNING, help="Python log level"),
) -> None:
    """Serve the GAIE endpoint-picker protocol over Envoy ext_proc on the relocator routing
    table: each request goes to its worker's current endpoint (dynamic metadata envoy.lb /
    x-gateway-destination-endpoint), waits while the worker is held; streams go through the
    router served by this process, which continues them across a move."""
    from relocator.gateways.epp import EppGateway

    s = _settings(config, backend, port=port, control_port=control_port)
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def main() -> None:
        gw = await EppGateway(s, grpc_host, grpc_port, router_address, via_router).start()
        console.print(f"endpoint picker on {grpc_host}:{gw.grpc_port} (ext_proc), router on "
                      f":{gw.server.port}, control API {gw.control_url}", highlight=False)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await gw.stop()

    asyncio.run(main())


@gateway_app.command("litellm-config")
@handle_errors
def litellm_config(
    model: List[str] = typer.Option(..., "--model", "-m", help="model name(s) served through "
                                    "the plugin (as registered in the routing table)"),
) -> None:
    """Print a LiteLLM proxy config (YAML) whose models go through the relocator plugin. Run
    LiteLLM with RELOCATOR_GATEWAY_CONFIG pointing at the router settings (backends,
    control_port, control_token); see docs/gateways.md."""
    import yaml

    from relocator.gateways.litellm_proxy import plugin_config

    typer.echo(yaml.safe_dump(plugin_config(list(model)), sort_keys=False), nl=False)
