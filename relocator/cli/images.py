"""`relocator images list|rm|capture|prefetch`: a node's warm image store (docs/images.md)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from relocator.cli import app
from relocator.cli.common import console, fail, handle_errors, print_json
from relocator.warm.key import is_key

images_app = typer.Typer(help="Warm images: a node's store of ready, idle workers' images (docs/images.md).",
                         no_args_is_help=True)
app.add_typer(images_app, name="images")

_NODE = typer.Option("local", "--node", help="Whose store on this machine (emulated nodes each have one).")
_CONFIG = typer.Option(None, "--config", help="Warm images config (default configs/images.yaml).")


def _store(node: str, config: Optional[Path]):
    from relocator.warm.config import WarmConfig
    from relocator.warm.roots import open_store

    return open_store(node, WarmConfig.load(config))


@images_app.command("list")
@handle_errors
def images_list(node: str = _NODE, config: Optional[Path] = _CONFIG,
                json_out: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """The node's warm images, most recently used first, with the store's bound."""
    store = _store(node, config)
    entries = store.list()
    if json_out:
        print_json({"node": node, "root": str(store.root), "max_bytes": store.max_bytes,
                    "used_bytes": sum(e.bytes for e in entries), "images": [e.to_dict() for e in entries]})
        return
    table = Table(title=f"warm images of {node} in {store.root} (bound {store.max_bytes / 2**30:.1f} GiB)")
    for col in ("key", "engine", "model", "MiB", "last used"):
        table.add_column(col)
    for e in entries:
        table.add_row(e.key, e.engine, e.model_id, f"{e.bytes / 2**20:.0f}",
                      time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.last_used)))
    console.print(table)


@images_app.command("rm")
@handle_errors
def images_rm(key: str = typer.Argument(..., help="The image's key (from `relocator images list`)."),
              node: str = _NODE, config: Optional[Path] = _CONFIG) -> None:
    """Remove one warm image (refused while a restore reads it)."""
    if not _store(node, config).rm(key):
        fail(f"no warm image {key} on {node}")
    console.print(f"removed {key}")


@images_app.command("capture")
@handle_errors
def images_capture(cell_id: str = typer.Argument(..., help="A running cell that has not served yet."),
                   node: str = _NODE, config: Optional[Path] = _CONFIG,
                   json_out: bool = typer.Option(False, "--json")) -> None:
    """File a warm image of a ready cell (CRIU leave-running: the cell runs on)."""
    from relocator.cell.cell import load_cell
    from relocator.credentials import use_machine_key
    from relocator.warm.capture import capture

    use_machine_key()  # by hand on one machine: this machine's key unless given a cluster's
    entry, dumped = capture(load_cell(cell_id), _store(node, config))
    if json_out:
        print_json({**entry.to_dict(), "dumped": dumped})
        return
    console.print(f"{'captured' if dumped else 'already stored'}: {entry.key} ({entry.bytes / 2**20:.0f} MiB)")


@images_app.command("prefetch")
@handle_errors
def images_prefetch(target: str = typer.Argument(..., help="The node to copy images to."),
                    key: Optional[str] = typer.Option(None, help="One image (default: every image it lacks)."),
                    src: Optional[str] = typer.Option(None, "--from", help="The node to copy from (default: any "
                                                      "node that holds the image)."),
                    cluster_dir: Optional[str] = typer.Option(None, "--cluster-dir"),
                    json_out: bool = typer.Option(False, "--json")) -> None:
    """Copy warm images to a node of the running cluster now, checksummed (docs/images.md)."""
    from relocator.controller.api import connect

    if key is not None and not is_key(key):
        fail(f"not a warm image key: {key!r} (see `relocator images list`)", 2)
    out = connect(cluster_dir).prefetch_images(target, key, src)
    if json_out:
        print_json(out)
    else:
        for c in out["copied"]:
            console.print(f"copied {c['key']} from {c['from']} ({(c['bytes'] or 0) / 2**20:.0f} MiB, {c['seconds']} s)")
        for k in out["already"]:
            console.print(f"{k}: already on {target}")
        for f in out["failed"]:
            console.print(f"[red]{f['key']}: {f['error']}[/]")
    if out["failed"]:
        raise typer.Exit(1)
