"""`relocator router serve` and `relocator bench router`."""

from __future__ import annotations

import asyncio
import json
from typing import List, Optional

import typer

from relocator.choices import LogLevel
from relocator.cli import app, bench_app
from relocator.router.policies import RouterPolicy

router_app = typer.Typer(help="The OpenAI-compatible router that moves traffic with workers.",
                         no_args_is_help=True)
app.add_typer(router_app, name="router")


@router_app.command("serve")
def serve(
    config: Optional[str] = typer.Option(None, "--config", "-c", help="YAML file (key `router:` "
                                         "or top level); RELOCATOR_ROUTER_* env overrides it"),
    host: Optional[str] = typer.Option(None, help="API listen address"),
    port: Optional[int] = typer.Option(None, help="API port"),
    backend: List[str] = typer.Option([], "--backend", "-b",
                                      help="MODEL=URL or WORKER@MODEL=URL, repeatable"),
    policy: Optional[RouterPolicy] = typer.Option(None, help="replica selection (default: the config's)"),
    fd: Optional[int] = typer.Option(None, "--fd", help="serve the API on this inherited "
                                     "listening socket (overrides host/port)"),
    state_file: Optional[str] = typer.Option(None, help="persist the routing table here and "
                                             "load it at start"),
    api_key: List[str] = typer.Option([], "--api-key", help="a key clients must send "
                                      "(Authorization: Bearer KEY), repeatable; also "
                                      "RELOCATOR_API_KEY"),
    insecure: bool = typer.Option(False, "--insecure", help="allow a non-loopback --host "
                                  "without any API key"),
    log_level: LogLevel = typer.Option(LogLevel.WARNING, help="Python log level"),
) -> None:
    """Serve /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics and the
    control API. (`python -m relocator.router` is the same without the CLI's start-up cost.)"""
    from relocator.router.config import RouterSettings, parse_backend
    from relocator.router.server import run

    settings = RouterSettings.load(config, host=host, port=port, policy=policy, listen_fd=fd,
                                   state_file=state_file, api_keys=api_key or None,
                                   insecure=insecure or None)
    if backend:
        settings.backends = settings.backends + [parse_backend(b) for b in backend]
    run(settings, log_level)


@bench_app.command("router")
def bench_router(
    json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
    concurrency: int = typer.Option(100, help="concurrent streams"),
    duration: float = typer.Option(5.0, help="seconds measured per target"),
    tokens: int = typer.Option(16, help="tokens per stream"),
    vllm_url: Optional[str] = typer.Option(None, help="real vLLM worker for a correctness pass"),
) -> None:
    """TTFB and req/s: direct vs relocator router vs vllm-router, same backend, one run."""
    from relocator.router.bench import run_bench

    res = asyncio.run(run_bench(concurrency, duration, tokens, vllm_url=vllm_url))
    if json_out:
        typer.echo(json.dumps(res))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"router benchmark, {concurrency} concurrent streams")
    for c in ("target", "ttfb p50 ms", "ttfb p99 ms", "req/s", "errors"):
        t.add_column(c)
    for k in ("direct", "relocator", "vllm_router"):
        v = res.get(k, {})
        if "error" in v and isinstance(v["error"], str):
            t.add_row(k, "-", "-", "-", v["error"])
        else:
            t.add_row(k, str(v["ttfb_p50_ms"]), str(v["ttfb_p99_ms"]), str(v["req_per_s"]),
                      str(v["errors"]))
    Console().print(t)
    if "correctness_vllm" in res:
        Console().print(res["correctness_vllm"])
