"""`relocator preflight`: say exactly what is missing or too old on this machine."""

from __future__ import annotations

import typer
from rich.table import Table

from relocator.cli import app
from relocator.cli.common import console, print_json


@app.command()
def preflight(json_out: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """Check root, kernel features, CRIU >= 4.2, system tools, Python packages and, where an NVIDIA
    driver is present, the GPU path (driver, cuda-checkpoint, persistence mode, driver mounts)."""
    from relocator.preflight import run_checks

    checks = run_checks()
    ok = all(c.ok or c.warning for c in checks)
    if json_out:
        print_json({"ok": ok, "checks": [c.model_dump() for c in checks]})
    else:
        table = Table(title="relocator preflight")
        for col in ("check", "", "detail", "fix"):
            table.add_column(col)
        for c in checks:
            mark = "[green]ok[/]" if c.ok else "[yellow]WARN[/]" if c.warning else "[red]FAIL[/]"
            table.add_row(c.name, mark, c.detail, "" if c.ok else c.fix)
        console.print(table)
    raise typer.Exit(0 if ok else 1)
