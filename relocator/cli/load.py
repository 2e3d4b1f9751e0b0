"""`relocator load` (streaming load with a token check) and `relocator abuse` (bad input)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Optional

import typer

from relocator.cli import app
from relocator.cli.common import console, handle_errors, print_json


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.replace(" ", "").split(",") if x]


@app.command("load")
@handle_errors
def load(
    url: str = typer.Option("http://127.0.0.1:8000", "--url", "-u",
                            help="router (or any OpenAI-compatible server) base URL"),
    model: Optional[str] = typer.Option(None, help="model name (default: first of /v1/models)"),
    concurrency: int = typer.Option(8, "--concurrency", "-c", help="concurrent streams"),
    requests: Optional[int] = typer.Option(None, "--requests", "-n", help="requests to send"),
    duration: Optional[float] = typer.Option(None, "--duration", "-d", help="seconds to run"),
    prompt_words: str = typer.Option("16,64", help="prompt lengths in words, comma list"),
    output_tokens: str = typer.Option("32,128", help="max_tokens values, comma list"),
    chat_fraction: float = typer.Option(0.5, help="share of chat requests"),
    greedy_fraction: float = typer.Option(0.75, help="share of greedy requests (rest: seeded)"),
    distinct: int = typer.Option(16, help="distinct requests in the mix"),
    seed: int = typer.Option(0, help="seed of the mix"),
    reference: Optional[Path] = typer.Option(None, help="reference token ids (JSON file)"),
    reference_url: Optional[str] = typer.Option(
        None, help="build the reference by running the greedy requests once against this URL "
                   "(a backend directly)"),
    save_reference: Optional[Path] = typer.Option(None, help="write the reference here"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="full report (JSON) here"),
    png: Optional[Path] = typer.Option(None, help="timeline PNG here"),
    phases: Optional[Path] = typer.Option(
        None, help="JSON list of [name, start, end] (seconds since start, or Unix times)"),
    api_key: Optional[str] = typer.Option(None, envvar=["RELOCATOR_API_KEY", "OPENAI_API_KEY"],
                                           help="bearer token"),
    timeout: float = typer.Option(300.0, help="per-request timeout, seconds"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object (summary)"),
) -> None:
    """Streaming load through the router: TTFT, inter-token gaps, errors, and for greedy
    requests a token-level check (lost, duplicated, mismatched) against a reference run.
    Exits 1 if any request failed or any token was wrong."""
    from loadtests import LoadConfig, check_tokens, load_reference, make_reference, run_load
    from loadtests import save_reference as _save

    cfg = LoadConfig(url=url, model=model, concurrency=concurrency, requests=requests,
                     duration_s=duration, prompt_words=_ints(prompt_words),
                     output_tokens=_ints(output_tokens), chat_fraction=chat_fraction,
                     greedy_fraction=greedy_fraction, distinct=distinct, seed=seed,
                     api_key=api_key, request_timeout_s=timeout)

    async def go():
        ref = None
        if reference is not None:
            ref = load_reference(reference)
        elif reference_url:
            ref = await make_reference(cfg, url=reference_url)
        if ref is not None and save_reference is not None:
            _save(ref, save_reference)
        ph = json.loads(phases.read_text()) if phases else None
        rep = await run_load(cfg, phases=ph)
        if ref is not None:
            check_tokens(rep, ref)
        return rep

    rep = asyncio.run(go())
    if out:
        rep.write_json(out)
    if png:
        rep.write_png(png)
    s = rep.summary()
    if json_out:
        d = {"summary": s, "token_check": rep.token_check.to_dict() if rep.token_check else None}
        print_json(d)
    else:
        console.print(rep.table())
        if rep.token_check and rep.token_check.bad:
            console.print(rep.token_check.bad[:5])
    bad = s["failed_requests"] or (rep.token_check is not None and not rep.token_check.ok)
    if bad:
        raise typer.Exit(1)


@app.command("abuse")
@handle_errors
def abuse(
    router: str = typer.Option("http://127.0.0.1:8000", "--router", help="router API URL"),
    control: Optional[str] = typer.Option(None, "--control", help="control API URL"),
    token: Optional[str] = typer.Option(None, envvar="RELOCATOR_ROUTER_CONTROL_TOKEN",
                                        help="control API token, if it has one"),
    pid: Optional[int] = typer.Option(None, help="router PID (default: found by its port)"),
    model: Optional[str] = typer.Option(None, help="model for valid probes (default: first)"),
    rounds: int = typer.Option(2, help="passes; leak = growth between the last two"),
    scale: float = typer.Option(1.0, help="multiplies every count (0.2 = quick)"),
    fd_tolerance: int = typer.Option(4, help="open fds allowed above baseline"),
    rss_tolerance_mb: float = typer.Option(32.0, help="RSS growth allowed in the last round"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Malformed bodies, huge headers, slow (trickling) clients and random disconnects against
    the router and its control API (loopback only); measures the router's open fds and RSS
    before and after. Exits 1 on a crash, a leak or a 5xx answer to bad input."""
    from loadtests.abuse import AbuseConfig, run_abuse

    cfg = AbuseConfig(router=router, control=control, token=token, pid=pid, model=model,
                      rounds=rounds, scale=scale, fd_tolerance=fd_tolerance,
                      rss_tolerance_mb=rss_tolerance_mb)
    rep = asyncio.run(run_abuse(cfg))
    if json_out:
        print_json(rep)
    else:
        from loadtests.abuse import render

        console.print(render(rep))
    if not rep["ok"]:
        raise typer.Exit(1)
