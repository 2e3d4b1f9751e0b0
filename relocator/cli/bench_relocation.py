"""`relocator bench relocation`: one live relocation under 8 concurrent greedy streams, measured
against a cold start of the same model."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterator

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


import typer

from adapters.base import DEFAULT_ENGINE, Engine, LaunchSpec
from relocator.cli import bench_app
from relocator.cli.common import console, handle_errors, print_json, stdout_for_json
from relocator.choices import registry_choice
from relocator.vocab import TransferMode

MODEL = "tiny-llama"


#: what `--transfer all` runs, back to back on one cluster and one worker (auto is one of them)
ALL_MODES = ("shared", "stream", "postcopy", "handoff")
#: the phases a freezing mode keeps the source stopped through (until the target serves)
FROZEN_PHASES = ("DUMP", "TRANSFER", "RESTORE", "SWITCH")
#: --transfer: a mode, or all of them
BenchTransfer = registry_choice("BenchTransfer", (*TransferMode.values(), "all"), __name__)
#: tokens per KV block the context check rounds each stream up to (vLLM's CPU block size)
KV_BLOCK_TOKENS = 16


@dataclass
class LongContext:
    """What `--prompt-tokens` needs: the workers' context length (None: LaunchSpec's default
    holds it), the KV cache 8 streams of prompt + generated tokens take, and the tokenizer
    that sizes each prompt (text -> its token count)."""

    prompt_tokens: int
    max_model_len: int | None
    kv_cache_needed_mb: float
    count: Callable[[str], int]


def model_limits(model_dir) -> tuple[int, int]:
    """(the most tokens the model can hold: max_position_embeddings, KV bytes per token in bf16)."""
    import json
    from pathlib import Path

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    return int(cfg["max_position_embeddings"]), 2 * int(cfg["num_hidden_layers"]) * kv_heads * head_dim * 2


def plan_context(prompt_tokens: int, max_tokens: int, streams: int, kv_pool_mb: int, model_dir,
                 count: Callable[[str], int]) -> LongContext:
    """Check that `streams` streams of `prompt_tokens` + `max_tokens` fit the model and the KV
    pool (ValueError saying what would fit), and the context length the workers need."""
    from adapters.base import LaunchSpec

    if prompt_tokens < 1:
        raise ValueError(f"--prompt-tokens {prompt_tokens}: a prompt needs 1 token or more")
    limit, per_token = model_limits(model_dir)
    need = prompt_tokens + max_tokens
    if need > limit:
        raise ValueError(
            f"--prompt-tokens {prompt_tokens} + --max-tokens {max_tokens} = {need} tokens, more than {MODEL}'s "
            f"context of {limit} tokens (max_position_embeddings): take --max-tokens {max(0, limit - prompt_tokens)} "
            f"or fewer, or --prompt-tokens {max(0, limit - max_tokens)} or fewer")
    blocks = -(-need // KV_BLOCK_TOKENS)
    kv_mb = round(streams * blocks * KV_BLOCK_TOKENS * per_token / 2**20, 2)
    if kv_pool_mb and kv_pool_mb < kv_mb:
        raise ValueError(
            f"--kv-pool-mb {kv_pool_mb} cannot hold {streams} streams of {need} tokens "
            f"(--prompt-tokens + --max-tokens): they need {kv_mb} MB of KV cache; take --kv-pool-mb "
            f"{int(kv_mb) + 1} or more, or 0 (vLLM's own pool)")
    # the model's whole context (one warm image kind for every prompt length) when the default is short
    max_len = None if need <= LaunchSpec.max_model_len else limit
    return LongContext(prompt_tokens, max_len, kv_mb, count)


def token_counter(model_dir) -> Callable[[str], int]:
    """Text -> its token count with the model's own tokenizer (as the engine counts a prompt)."""
    from pathlib import Path

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return lambda text: len(tok.encode(text).ids)


def counted(ctx: LongContext, streams: int) -> list[int]:
    """[fewest, most] tokens of the streams' prompts, as the model's tokenizer counts them."""
    from relocator.cluster.streams import prompts_for

    n = [ctx.count(p) for p in prompts_for(streams, ctx.prompt_tokens, ctx.count)]
    return [min(n), max(n)]


def long_context(prompt_tokens: int | None, max_tokens: int, streams: int, kv_pool_mb: int) -> LongContext | None:
    """plan_context for the bench's model (None without --prompt-tokens)."""
    if prompt_tokens is None:
        return None
    from relocator.tinymodel import ensure_tiny_model

    model_dir = ensure_tiny_model()
    return plan_context(prompt_tokens, max_tokens, streams, kv_pool_mb, model_dir, token_counter(model_dir))


def run_bench(streams: int = 8, max_tokens: int = 256, transfer: TransferMode | str = TransferMode.SHARED,
              base_dir: str = "/var/lib/relocator/bench", engine: str = DEFAULT_ENGINE, emulate_hosts: int = 0,
              kv_pool_mb: int = 0, host_loss: bool = True, plaintext_transfers: bool = False,
              stagger: bool = True, prompt_tokens: int | None = None) -> dict:
    """One move in `transfer` mode (or, with "all", one move in each of ALL_MODES back and forth
    between the same two nodes, same worker and load: {"runs": [...], "handoff_vs_best_freeze"}).
    `plaintext_transfers`: the same move without TLS (no front, CRIU, keeper and pump in
    plaintext), to measure what the encryption costs; the bench's own cluster only. `stagger`:
    the clients' first requests spread over one request's length, so streams are in flight at
    every instant (else they run in step, and a handoff's switch may fall between their requests
    and move none). `prompt_tokens`: each stream's prompt about that long (its own text per
    client), the workers' context made long enough; refused (ValueError) beyond the model's
    context or the `kv_pool_mb` pool."""
    from relocator.worker import ENV_MAX_MODEL_LEN

    ctx = long_context(prompt_tokens, max_tokens, streams, kv_pool_mb)  # refused before anything starts

    from relocator.credentials import ENV_BENCH_PLAINTEXT

    # what the agents of the cluster started below read: a KV pool of that size, every page of it
    # touched (adapters/vllm/adapter.py); plaintext transfers (never inherited: this option only,
    # relocator.credentials); the workers' context (relocator.worker.default_spec)
    env: dict[str, str | None] = {ENV_BENCH_PLAINTEXT: "1" if plaintext_transfers else None,
                                  ENV_MAX_MODEL_LEN: str(ctx.max_model_len) if ctx is not None and ctx.max_model_len else None}
    if kv_pool_mb:
        env["RELOCATOR_KV_POOL_MB"] = str(kv_pool_mb)
    with agent_env(env):
        return _run(streams, max_tokens, transfer, base_dir, engine, emulate_hosts, kv_pool_mb, host_loss,
                    plaintext_transfers, stagger, prompt_tokens, ctx)


@contextlib.contextmanager
def agent_env(settings: dict[str, str | None]) -> Iterator[None]:
    """Each variable set (a string) or unset (None) while inside, then put back as it was."""
    prev = {k: os.environ.get(k) for k in settings}

    def put(values: dict[str, str | None]) -> None:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    put(settings)
    try:
        yield
    finally:
        put(prev)


def _run(streams: int, max_tokens: int, transfer: TransferMode | str, base_dir: str, engine: str,
         emulate_hosts: int, kv_pool_mb: int, host_loss: bool, plaintext_transfers: bool, stagger: bool,
         prompt_tokens: int | None, ctx) -> dict:
    """run_bench's cluster, moves and figures, in the agents' environment."""
    import relocator
    from relocator.cluster.streams import first_token_s

    if emulate_hosts:  # emulated hosts (docs/deploy.md): h1 runs the controller and router; h2 -> h3
        if emulate_hosts < 3:
            raise ValueError("--emulate-hosts needs 3 hosts or more (the move goes between two hosts that "
                             "do not run the router)")
        ctl = relocator.start(emulate_hosts=emulate_hosts, gpus_per_node=4, base_dir=base_dir)
        src, dst = "h2", "h3"
    else:
        ctl = relocator.start(nodes=2, gpus_per_node=4, base_dir=base_dir)
        src, dst = "n1", "n2"
    name = str(transfer.value if isinstance(transfer, TransferMode) else transfer)
    modes = ALL_MODES if name == "all" else (name,)
    runs = []
    moved = f"{src} -> {dst}"  # the first move (the loop swaps them for the next)
    try:
        t = time.monotonic()
        w = ctl.launch(MODEL, 2, src, engine=engine)
        ttft = first_token_s(ctl.router_url, MODEL)
        cold = time.monotonic() - t
        for mode in modes:
            runs.append(_measure(ctl, w["id"], dst, mode, streams, max_tokens, stagger, ctx))
            src, dst = dst, src  # the next mode moves it back
        lost = _host_loss(ctl, base_dir, w["id"], streams, max_tokens) if emulate_hosts and host_loss else None
    finally:
        ctl.down()
    common = {"cold_start_to_first_token_s": round(cold, 3), "cold_start_ready_s": w["launch_s"],
              "cold_start_ttft_s": round(ttft, 4), "kv_pool_mb": kv_pool_mb or None, "streams": streams,
              "max_tokens": max_tokens, "engine": engine, "transfer_tls": not plaintext_transfers,
              "staggered_clients": stagger, "prompt_tokens": prompt_tokens}
    if ctx is not None:  # what the long prompts took: the workers' context, the KV cache for the streams
        common.update({"max_model_len": ctx.max_model_len or LaunchSpec.max_model_len,
                       "kv_cache_needed_mb": ctx.kv_cache_needed_mb, "prompt_tokens_counted": counted(ctx, streams)})
    for r in runs:
        r["blackout_pct_of_cold_start"] = round(100 * r["blackout_max_s"] / cold, 1) if cold else None
    if emulate_hosts:
        common.update({"emulated_hosts": emulate_hosts, "moved": moved})
        if lost is not None:
            common["host_loss"] = lost
    if len(runs) == 1:
        return {**common, **runs[0]}
    return {**common, "runs": runs, "handoff_vs_best_freeze": compare(runs)}


def _host_loss(ctl, base_dir: str, wid: str, streams: int, max_tokens: int) -> dict:
    """The worker's own host killed under load (issue 28): seconds until its streams are served
    again (`serving_again_s`: the longest gap clients saw), and how the replacement started."""
    import asyncio

    from relocator.cluster.info import read_info
    from relocator.cluster.scenario import lose_host_under_load
    from relocator.cluster.streams import reference

    tokens = min(max_tokens, 128)
    ref = asyncio.run(reference(ctl.router_url, MODEL, tokens, streams, streams))
    out = lose_host_under_load(ctl, read_info(base_dir) or {}, wid, MODEL, ref, concurrency=streams,
                               max_tokens=tokens)
    return {"serving_again_s": out["blackout_max_s"], **out}


def compare(runs: list[dict]) -> dict:
    """The handoff's blackout next to the best freezing mode's of the same run."""
    freeze = [r for r in runs if r["transfer"] != "handoff" and r["result"] == "done"]
    hand = next((r for r in runs if r["transfer"] == "handoff"), None)
    if not freeze or hand is None:
        return {}
    best = min(freeze, key=lambda r: r["blackout_max_s"])
    h = hand["blackout_max_s"]
    return {"handoff_blackout_s": h, "best_freeze_mode": best["transfer"], "best_freeze_blackout_s": best["blackout_max_s"],
            "times_lower": round(best["blackout_max_s"] / h, 1) if h > 0 else None}


def _measure(ctl, wid: str, dst: str, transfer: str, streams: int, max_tokens: int, stagger: bool = True,
             ctx: LongContext | None = None) -> dict:
    """One move of `wid` to `dst` under `streams` greedy clients: the bench's figures (`ctx`:
    each client's long prompt, --prompt-tokens)."""
    from relocator.cluster.scenario import relocate_under_load

    res = relocate_under_load(ctl, wid, dst, MODEL, concurrency=streams, max_tokens=max_tokens, transfer=transfer,
                              stagger=stagger, prompt_tokens=ctx.prompt_tokens if ctx else None,
                              count_tokens=ctx.count if ctx else None)
    full = ctl.get_relocation(res["relocation"]["id"]) or {}
    rel, load = res["relocation"], res["load"]
    pc = rel.get("postcopy") or {}
    restore = next((p.get("info") or {} for p in full.get("phases", []) if p["name"] == "RESTORE"), {})
    frozen = 0.0 if rel["transfer"] == "handoff" else sum(v for k, v in rel["phases"].items() if k in FROZEN_PHASES)
    return {
        "blackout_max_s": load["blackout_max_s"],
        "phases": rel["phases"], "relocation_total_s": round(sum(rel["phases"].values()), 3),
        "image_bytes": rel["image_bytes"], "transfer": rel["transfer"],
        # post-copy: memory that arrived after the router switched, and how long the target
        # needed the source (0 / None for the other modes)
        "pages_after_switch_bytes": pc.get("pages_after_switch_bytes", 0), "postcopy_s": pc.get("postcopy_s"),
        # of the memory, what came by the source's push channel rather than by request
        "pushed_bytes": pc.get("pushed_bytes", 0),
        # handoff: the target's warm-up (0 / None for the freezing modes); how long the source
        # was stopped (the freezing modes: DUMP to SWITCH)
        "warmup_s": restore.get("warmup_s"), "warmup_rounds": restore.get("warmup_rounds", 0),
        "prefix_hit_tokens": restore.get("prefix_hit_tokens", 0),
        "recomputed_tokens": restore.get("recomputed_tokens", 0),
        "engine_cached_tokens": restore.get("engine_cached_tokens", 0), "source_frozen_s": round(frozen, 4),
        "target_start_s": restore.get("start_s"), "target_warm_start": restore.get("warm"),
        # handoff: the target's nice while it started, and whether it was set back to 0 after
        "target_nice": restore.get("target_nice"), "target_normal_priority": restore.get("target_normal_priority"),
        # the CPUs its warm start could take at most (relocator/cpucap.py; None: not capped)
        "target_cpu_cap": restore.get("start_cpu_cap"),
        # the on-demand copy of the warm image that began the target's start (None: none needed)
        "target_copy_s": (restore.get("start_copy") or {}).get("seconds"),
        # how it went: "local" (a peer's store on this host, read in place), "ray" (object stores)
        "target_copy_via": (restore.get("start_copy") or {}).get("via"),
        "phase_info": _phase_info(full),
        "tokens_lost": load["tokens_lost"], "tokens_duplicated": load["tokens_duplicated"],
        "tokens_mismatched": load["tokens_mismatched"], "text_mismatched": load["text_mismatched"],
        "client_errors": load["client_errors"], "errors": (load.get("errors") or [])[:5],
        "requests": load["requests"], "tokens": load["tokens"],
        "result": rel["result"], "client_max_gap_s": [c["max_gap_s"] for c in load["clients"]],
        # the load's longest gap before the move (its normal pace), and where the blackout fell
        "normal_gap_max_s": load.get("normal_gap_max_s"), "normal_gap_mean_s": load.get("normal_gap_mean_s"),
        # the blackout: the longest gap minus the normal (mean) inter-token gap
        "blackout_excess_s": excess(load["blackout_max_s"], load.get("normal_gap_mean_s")),
        # the longest gap that overlaps SWITCH (a handoff's cut-over; the freezing modes' is longer)
        "switch_gap_s": switch_gap(full, load.get("long_gaps") or [], res.get("clock_offset_s", 0.0)),
        "blackout_at": blackout_at(full, load.get("blackout_span") or [], res.get("clock_offset_s", 0.0)),
        "gap_by_phase": gap_by_phase(full, load.get("long_gaps") or [], res.get("clock_offset_s", 0.0)),
        # where in its phase each of those gaps began (seconds into the phase it ended in)
        "gap_by_phase_at": gap_by_phase_at(full, load.get("long_gaps") or [], res.get("clock_offset_s", 0.0)),
    }


def excess(blackout: float, normal: float | None) -> float | None:
    return None if normal is None else round(max(0.0, blackout - normal), 4)


def switch_gap(rel: dict, gaps: list[list[float]], offset: float) -> float | None:
    """The longest client gap overlapping SWITCH (`gaps`: the load's longest, monotonic)."""
    p = next((p for p in rel.get("phases", []) if p["name"] == "SWITCH" and p.get("ended")), None)
    if p is None:
        return None
    over = [b - a for a, b in gaps if a + offset <= p["ended"] and b + offset >= p["started"]]
    return round(max(over), 4) if over else 0.0


def gap_by_phase(rel: dict, gaps: list[list[float]], offset: float) -> dict[str, float]:
    """The longest client gap ending in each phase (`gaps`: the load's longest, monotonic)."""
    out: dict[str, float] = {}
    for a, b in gaps:
        t = b + offset
        for p in rel.get("phases", []):
            if p["started"] <= t <= (p.get("ended") or t):
                out[p["name"]] = round(max(out.get(p["name"], 0.0), b - a), 4)
                break
    return out


def gap_by_phase_at(rel: dict, gaps: list[list[float]], offset: float) -> dict[str, float]:
    """For the longest client gap ending in each phase (gap_by_phase): seconds from that phase's
    start to the gap's start (negative: it began in an earlier phase)."""
    best: dict[str, tuple[float, float]] = {}
    for a, b in gaps:
        t = b + offset
        for p in rel.get("phases", []):
            if p["started"] <= t <= (p.get("ended") or t):
                if b - a > best.get(p["name"], (-1.0, 0.0))[0]:
                    best[p["name"]] = (b - a, round(a + offset - p["started"], 4))
                break
    return {name: at for name, (_, at) in best.items()}


def blackout_at(rel: dict, span: list[float], offset: float) -> dict:
    """The phase the blackout's gap began in and the one it ended in, and its start and end in
    seconds from the start of that phase (`span`: monotonic; `offset`: wall minus monotonic)."""
    if len(span) != 2:
        return {}
    out: dict = {}
    for key, t in (("start", span[0] + offset), ("end", span[1] + offset)):
        for p in rel.get("phases", []):
            if p["started"] <= t <= (p.get("ended") or t):
                out[f"{key}_phase"], out[f"{key}_in_phase_s"] = p["name"], round(t - p["started"], 4)
                break
    return out


def _phase_info(rel: dict) -> dict:
    """Where DUMP, TRANSFER and RESTORE spent their time, as the agents reported it."""
    keep = ("seconds", "timings", "bytes", "lazy_bytes", "streamed_pages_bytes", "page_server_s", "hash_tail_s",
            "criu_restore_s", "health_s", "gb_per_s", "requested", "why", "postcopy_s", "page_bytes",
            "pages_after_switch_bytes", "pushed_bytes", "pump_port", "pump_error", "image_on", "postcopy", "link",
            "catch_up", "moved_streams", "kept_streams")
    out = {}
    for p in rel.get("phases", []):
        info = {k: v for k, v in (p.get("info") or {}).items() if k in keep}
        if info:
            out[p["name"]] = info
    return out


@bench_app.command("relocation")
@handle_errors
def bench_relocation(json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
                     streams: int = typer.Option(8, help="concurrent greedy streams"),
                     max_tokens: int = typer.Option(256, help="tokens per request"),
                     transfer: BenchTransfer = typer.Option(  # type: ignore[valid-type]
                         BenchTransfer("shared"), help="shared: one image store; stream: memory through a page server "
                         "on the target, checksummed; postcopy: restore first, memory on demand; handoff: a second "
                         "copy warmed up while the source serves (make-before-break); auto: the best possible; "
                         "all: shared, stream, postcopy and handoff back to back on one cluster and load"),
                     kv_pool_mb: int = typer.Option(0, "--kv-pool-mb", min=0,
                                                    help="a KV pool of N MB with every page touched (0: vLLM's, "
                                                    "untouched pages left out of the image)"),
                     cluster_dir: str = typer.Option("/var/lib/relocator/bench", "--cluster-dir"),
                     engine: Engine = typer.Option(Engine(DEFAULT_ENGINE), help="the worker's engine"),
                     emulate_hosts: int = typer.Option(0, "--emulate-hosts", min=0, max=15,
                                                       help="on N emulated hosts (own network and mount "
                                                       "namespaces, nothing shared; 3 or more), not the local cluster"),
                     host_loss: bool = typer.Option(True, "--host-loss/--no-host-loss",
                                                    help="with --emulate-hosts: then kill the worker's host under "
                                                    "load and measure until its streams are served again"),
                     plaintext_transfers: bool = typer.Option(
                         False, "--plaintext-transfers", help="bench only: the move's transfers without TLS (no "
                         "TLS front; CRIU, keeper and pump in plaintext), to measure the encryption's cost; "
                         "refused beyond loopback and the emulated hosts' bridge"),
                     stagger: bool = typer.Option(True, "--stagger-clients/--no-stagger-clients",
                                                  help="spread the clients' first requests over one request's "
                                                  "length (streams in flight at every instant); off: all start "
                                                  "at once and run in step, as the bench did before"),
                     prompt_tokens: int | None = typer.Option(
                         None, "--prompt-tokens", min=1, help="each stream's prompt about N tokens long (its own "
                         "text per client; default: the short built-in prompts), the workers' context made long "
                         "enough: how each mode's blackout grows with context; N + --max-tokens must fit the "
                         "model (4096 for tiny-llama)")) -> None:
    """Blackout, phases and token check of one live relocation vs a cold start."""
    json_file = stdout_for_json() if json_out else None  # Ray's driver prints raylet errors there
    out = run_bench(streams, max_tokens, transfer.value, cluster_dir, engine.value, emulate_hosts, kv_pool_mb,
                    host_loss, plaintext_transfers, stagger, prompt_tokens)
    if json_file is not None:
        print_json(out, json_file)
        return
    for k, v in out.items():
        console.print(f"{k:32} {v}", highlight=False)
