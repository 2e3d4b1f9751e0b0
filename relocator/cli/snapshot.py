"""`relocator cell ...` and `relocator snapshot ...`: cells and snapshots by hand on this node."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Optional

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from relocator.cli import app
from adapters import Engine
from relocator.cli.common import console, err, fail, handle_errors, print_json
from relocator.snapshot.snapshot import VerifyMode

cell_app = typer.Typer(help="Worker cells on this node (own PID/mount/IPC/UTS/net namespaces).", no_args_is_help=True)
snapshot_app = typer.Typer(help="Dump a cell to an image, restore an image to a new cell, inspect images.", no_args_is_help=True)


@snapshot_app.callback()
def _snapshot_keys() -> None:
    """Images made by hand are signed with this machine's key unless a cluster's is given."""
    from relocator.credentials import use_machine_key

    use_machine_key()
app.add_typer(cell_app, name="cell")
app.add_typer(snapshot_app, name="snapshot")


def _cell_dict(cell) -> dict:
    return {"id": cell.id, "endpoint": cell.endpoint, "init_pid": cell.init_pid, "netns": cell.netns,
            "engine": cell.engine, "origin": cell.origin,
            "state": "stopped" if cell.is_stopped() else ("running" if cell.is_alive() else "dead")}


def _progress_cb(progress: Progress):
    tasks: dict[str, int] = {}

    def cb(step: str, frac: float | None) -> None:
        if step not in tasks:
            for tid in tasks.values():  # finish (and stop the clock of) earlier steps
                progress.update(tid, total=100, completed=100)
            tasks[step] = progress.add_task(step, total=100 if frac is not None else None)
        if frac is not None:
            progress.update(tasks[step], completed=frac * 100)

    return cb


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=err, transient=False)


@cell_app.command("launch")
@handle_errors
def cell_launch(
    model_dir: Optional[Path] = typer.Option(None, help="HF model directory (default: the tiny model)."),
    name: str = typer.Option("tiny-llama", help="Served model name."),
    port: int = typer.Option(8000, min=1, max=65535, help="Port inside the cell's network namespace."),
    engine: Engine = typer.Option(Engine.VLLM, help="Engine adapter."),
    wait: bool = typer.Option(True, help="Wait until the engine serves."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Start a worker in a new cell."""
    from relocator.tinymodel import ensure_tiny_model
    from relocator.worker import default_spec, launch_worker, wait_ready

    if model_dir is not None and not (model_dir / "config.json").exists():
        fail(f"{model_dir} is not a model directory (no config.json)")
    spec = default_spec(model_dir or ensure_tiny_model(), name=name, port=port)
    cell = launch_worker(spec, engine=engine.value)
    info = _cell_dict(cell)
    if wait:
        with err.status(f"waiting for {engine} in cell {cell.id} at {cell.endpoint}"):
            info["ready_s"] = round(asyncio.run(wait_ready(cell)), 2)
    if json_out:
        print_json(info)
    else:
        console.print(f"cell [bold]{cell.id}[/] serving at {cell.endpoint}" + (f" after {info['ready_s']} s" if wait else ""))


@cell_app.command("list")
@handle_errors
def cell_list(json_out: bool = typer.Option(False, "--json")) -> None:
    """List the cells recorded on this node."""
    from relocator.cell.cell import list_cells

    cells = [_cell_dict(c) for c in list_cells()]
    if json_out:
        print_json({"cells": cells})
        return
    table = Table()
    for col in ("id", "state", "endpoint", "init pid", "origin"):
        table.add_column(col)
    for c in cells:
        table.add_row(c["id"], c["state"], c["endpoint"], str(c["init_pid"]), c["origin"])
    console.print(table)


@cell_app.command("kill")
@handle_errors
def cell_kill(cell_id: str) -> None:
    """Kill a cell's whole tree and remove its namespace."""
    from relocator.cell.cell import load_cell

    load_cell(cell_id).kill()
    console.print(f"cell {cell_id} killed")


@cell_app.command("resume")
@handle_errors
def cell_resume(cell_id: str) -> None:
    """Resume a cell left stopped by a dump (when its restore elsewhere failed)."""
    from relocator.cell.cell import load_cell
    from relocator.snapshot import resume_source

    cell = load_cell(cell_id)
    if not cell.is_stopped():
        fail(f"cell {cell_id} is not stopped")
    resume_source(cell)
    console.print(f"cell {cell_id} resumed at {cell.endpoint}")


@snapshot_app.command("dump")
@handle_errors
def snapshot_dump(
    cell_id: str,
    image_dir: Path = typer.Argument(..., help="New directory for the image."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Checkpoint a cell into IMAGE_DIR. The cell is left stopped (resume it with `cell resume`)."""
    from relocator.cell.cell import load_cell
    from relocator.snapshot import dump

    cell = load_cell(cell_id)
    with _progress() as progress:
        image = dump(cell, image_dir, progress=_progress_cb(progress))
    info = {"image": str(image.path), "bytes": image.bytes, "files": len(image.manifest.files),
            "timings": image.manifest.timings, "source_cell": cell.id, "source_state": "stopped"}
    if json_out:
        print_json(info)
    else:
        console.print(f"image {image.path}: {image.bytes / 2**20:.0f} MiB in {len(image.manifest.files)} files, "
                      f"dump {image.manifest.timings['criu_dump_s']:.2f} s; cell {cell.id} left stopped")


@snapshot_app.command("restore")
@handle_errors
def snapshot_restore(
    image_dir: Path,
    verify: VerifyMode = typer.Option(VerifyMode.AUTO, help="full: hash every file; auto: unless this host "
                                      "hashed these unchanged files already; none: sizes only."),
    wait: bool = typer.Option(True, help="Wait until the restored engine serves."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Verify IMAGE_DIR against this host and restore it into a new cell."""
    from relocator.snapshot import ImageError, IncompatibleImage, RestoreTarget, restore
    from relocator.worker import wait_ready

    start = time.monotonic()
    try:
        with _progress() as progress:
            cell = restore(image_dir, RestoreTarget(verify=verify), progress=_progress_cb(progress))
    except ImageError as exc:
        fail(f"{exc}. Nothing was restored; the source cell is untouched (resume it with `relocator cell resume`).", 3)
    except IncompatibleImage as exc:
        if json_out:
            print_json({"error": "incompatible", "mismatches": [m.model_dump() for m in exc.mismatches]})
        fail(f"{exc}. Nothing was restored.", 4)
    info = _cell_dict(cell)
    if wait:
        asyncio.run(wait_ready(cell, timeout=120))
        info["restore_to_ready_s"] = round(time.monotonic() - start, 3)
    if json_out:
        print_json(info)
    else:
        console.print(f"restored into cell [bold]{cell.id}[/] at {cell.endpoint}"
                      + (f", serving after {info['restore_to_ready_s']} s" if wait else ""))


@snapshot_app.command("inspect")
@handle_errors
def snapshot_inspect(
    image_dir: Path,
    verify: bool = typer.Option(False, help="Also verify every file's sha256."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Show an image's manifest: fingerprint, size, timings; optionally verify it."""
    from relocator.snapshot import compatibility_report, inspect_image

    image = inspect_image(image_dir, verify=verify)
    mismatches = compatibility_report(image)
    m = image.manifest
    if json_out:
        print_json({"image": str(image.path), "bytes": image.bytes, "verified": verify,
                    "compatible_here": not mismatches, "mismatches": [x.model_dump() for x in mismatches],
                    "manifest": m.model_dump(exclude={"files"}), "files": len(m.files)})
        return
    fp = m.fingerprint
    console.print(f"[bold]{image.path}[/]: {image.bytes / 2**20:.0f} MiB, {len(m.files)} files, schema {m.schema_version}"
                  + (", checksums verified" if verify else ""))
    console.print(f"  engine  {fp.engine.engine} {fp.engine.engine_version}, model {fp.engine.model_id} "
                  f"(weights {fp.engine.weight_sha256[:12]}...), {fp.engine.dtype}, max_len {fp.engine.max_model_len}")
    console.print(f"  host    {fp.host.arch} {fp.host.cpu_model}, kernel {fp.host.kernel}, CRIU {fp.host.criu_version}, "
                  f"GPUs {fp.host.gpu.count} {fp.host.gpu.model or ''}")
    console.print("  timings " + ", ".join(f"{k} {v:.2f}" for k, v in m.timings.items()))
    if mismatches:
        console.print("  [red]not restorable here:[/] " + "; ".join(str(x) for x in mismatches))
    else:
        console.print("  [green]restorable on this host[/]")
