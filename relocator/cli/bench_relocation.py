"""`relocator bench relocation`: one live relocation under 8 concurrent greedy streams, measured
against a cold start of the same model."""

from __future__ import annotations

import os
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import typer

from adapters.base import DEFAULT_ENGINE, Engine
from relocator.cli import bench_app
from relocator.cli.common import console, handle_errors, print_json
from relocator.vocab import TransferMode

MODEL = "tiny-llama"


def run_bench(streams: int = 8, max_tokens: int = 256, transfer: TransferMode = TransferMode.SHARED,
              base_dir: str = "/var/lib/relocator/bench", engine: str = DEFAULT_ENGINE, emulate_hosts: int = 0,
              kv_pool_mb: int = 0) -> dict:
    import relocator
    from relocator.cluster.scenario import relocate_under_load
    from relocator.cluster.streams import first_token_s

    # a KV pool of that size, every page of it touched (in the image): the agents read it when
    # they launch the worker (adapters/vllm/adapter.py)
    prev_pool = os.environ.get("RELOCATOR_KV_POOL_MB")
    if kv_pool_mb:
        os.environ["RELOCATOR_KV_POOL_MB"] = str(kv_pool_mb)

    if emulate_hosts:  # emulated hosts (docs/deploy.md): h1 runs the controller and router; h2 -> h3
        if emulate_hosts < 3:
            raise ValueError("--emulate-hosts needs 3 hosts or more (the move goes between two hosts that "
                             "do not run the router)")
        ctl = relocator.start(emulate_hosts=emulate_hosts, gpus_per_node=4, base_dir=base_dir)
        src, dst = "h2", "h3"
    else:
        ctl = relocator.start(nodes=2, gpus_per_node=4, base_dir=base_dir)
        src, dst = "n1", "n2"
    try:
        t = time.monotonic()
        w = ctl.launch(MODEL, 2, src, engine=engine)
        ttft = first_token_s(ctl.router_url, MODEL)
        cold = time.monotonic() - t
        res = relocate_under_load(ctl, w["id"], dst, MODEL, concurrency=streams, max_tokens=max_tokens,
                                  transfer=transfer)
        full = ctl.get_relocation(res["relocation"]["id"]) or {}
    finally:
        ctl.down()
        if prev_pool is None:
            os.environ.pop("RELOCATOR_KV_POOL_MB", None)
        else:
            os.environ["RELOCATOR_KV_POOL_MB"] = prev_pool
    rel, load = res["relocation"], res["load"]
    pc = rel.get("postcopy") or {}
    out = {
        "cold_start_to_first_token_s": round(cold, 3),
        "cold_start_ready_s": w["launch_s"], "cold_start_ttft_s": round(ttft, 4),
        "blackout_max_s": load["blackout_max_s"],
        "blackout_pct_of_cold_start": round(100 * load["blackout_max_s"] / cold, 1) if cold else None,
        "phases": rel["phases"], "relocation_total_s": round(sum(rel["phases"].values()), 3),
        "image_bytes": rel["image_bytes"], "transfer": rel["transfer"],
        # post-copy: memory that arrived after the router switched, and how long the target
        # needed the source (0 / None for the other modes)
        "pages_after_switch_bytes": pc.get("pages_after_switch_bytes", 0), "postcopy_s": pc.get("postcopy_s"),
        # of the memory, what came by the source's push channel rather than by request
        "pushed_bytes": pc.get("pushed_bytes", 0),
        "kv_pool_mb": kv_pool_mb or None,
        "phase_info": _phase_info(full),
        "tokens_lost": load["tokens_lost"], "tokens_duplicated": load["tokens_duplicated"],
        "tokens_mismatched": load["tokens_mismatched"], "text_mismatched": load["text_mismatched"],
        "client_errors": load["client_errors"],
        "streams": streams, "max_tokens": max_tokens, "requests": load["requests"], "tokens": load["tokens"],
        "result": rel["result"], "client_max_gap_s": [c["max_gap_s"] for c in load["clients"]],
        "engine": engine,
    }
    if emulate_hosts:
        out.update({"emulated_hosts": emulate_hosts, "moved": f"{src} -> {dst}"})
    return out


def _phase_info(rel: dict) -> dict:
    """Where DUMP, TRANSFER and RESTORE spent their time, as the agents reported it."""
    keep = ("seconds", "timings", "bytes", "lazy_bytes", "streamed_pages_bytes", "page_server_s", "hash_tail_s",
            "criu_restore_s", "health_s", "gb_per_s", "requested", "why", "postcopy_s", "page_bytes",
            "pages_after_switch_bytes", "pushed_bytes", "pump_port", "pump_error", "image_on", "postcopy")
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
                     transfer: TransferMode = typer.Option(
                         TransferMode.SHARED, help="shared: one image store; stream: memory through a page server "
                         "on the target, checksummed; postcopy: restore first, memory on demand; auto: the best possible"),
                     kv_pool_mb: int = typer.Option(0, "--kv-pool-mb", min=0,
                                                    help="a KV pool of N MB with every page touched (0: vLLM's, "
                                                    "untouched pages left out of the image)"),
                     cluster_dir: str = typer.Option("/var/lib/relocator/bench", "--cluster-dir"),
                     engine: Engine = typer.Option(Engine(DEFAULT_ENGINE), help="the worker's engine"),
                     emulate_hosts: int = typer.Option(0, "--emulate-hosts", min=0, max=15,
                                                       help="on N emulated hosts (own network and mount "
                                                       "namespaces, nothing shared; 3 or more), not the local cluster")) -> None:
    """Blackout, phases and token check of one live relocation vs a cold start."""
    out = run_bench(streams, max_tokens, transfer, cluster_dir, engine.value, emulate_hosts, kv_pool_mb)
    if json_out:
        print_json(out)
        return
    for k, v in out.items():
        console.print(f"{k:32} {v}", highlight=False)
