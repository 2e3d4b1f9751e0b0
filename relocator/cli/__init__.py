"""The `relocator` command line. Each command group lives in its own module and registers here."""

from __future__ import annotations

import typer
from typer.core import TyperGroup


class RelocatorGroup(TyperGroup):
    """A wrong option value is one line like every other relocator error, with exit 2:
    `error: Invalid value for '--transfer': 'postcopy' is not one of 'shared', 'stream'.`"""

    def invoke(self, ctx):  # type: ignore[no-untyped-def]
        try:
            return super().invoke(ctx)
        except typer.BadParameter as exc:  # subcommands parse their options in here
            message = exc.format_message().replace(": Value error, ", ": ", 1)
            typer.echo(f"error: {message}", err=True)
            raise typer.Exit(2) from None


app = typer.Typer(
    name="relocator",
    cls=RelocatorGroup,
    help="Move running LLM serving workers between nodes, with their traffic.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
bench_app = typer.Typer(help="Benchmarks that print figures side by side with their baseline.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


def _register() -> None:
    # Imported for their side effect of adding commands to `app` / `bench_app`.
    import importlib

    for name in ("preflight", "model", "snapshot", "bench_snapshot", "demo", "simulate", "bench_sim", "replay", "bench_replay", "router", "cluster", "deploy", "load", "bench_relocation", "bench_splices", "bench_scheduling", "bench_fractional", "chaos", "gateway", "bench_gateway", "images", "policies", "gpus", "bench_policies", "why"):
        try:
            importlib.import_module(f"relocator.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"relocator.cli.{name}":
                raise


def main() -> None:
    _register()
    app()
