"""`relocator bench snapshot`: cold start vs CRIU restore of a vLLM CPU worker."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from relocator.cli import bench_app
from relocator.cli.common import console, err, handle_errors, print_json


@bench_app.command("snapshot")
@handle_errors
def bench_snapshot(
    image_root: Optional[Path] = typer.Option(None, help="Where the temporary image goes (default: /tmp)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    kv_pool_mb: int = typer.Option(0, "--kv-pool-mb", min=0,
                                   help="A KV pool of this many MiB (0: vLLM's default share), left untouched."),
    touch_pool: bool = typer.Option(False, "--touch-pool", help="Write every page of the --kv-pool-mb pool."),
) -> None:
    """Cold start vs warm launch and restore to first token, dump time, image size vs RSS, restore vs memcpy."""
    from relocator.bench.snapshot import run
    from relocator.credentials import use_machine_key

    use_machine_key()  # a single-machine benchmark: this machine's image key unless given one
    result = asyncio.run(run(image_root, log=lambda m: err.print(f"[dim]{m}[/]"), kv_pool_mb=kv_pool_mb,
                             touch_pool=touch_pool))
    if json_out:
        print_json(result)
        return
    table = Table(title="relocator bench snapshot")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in result.items():
        table.add_row(key, str(value))
    console.print(table)
