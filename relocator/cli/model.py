"""`relocator model`: the tiny deterministic model the reference environment serves."""

from __future__ import annotations

import typer

from relocator.cli import app
from relocator.cli.common import console, handle_errors, print_json

model_app = typer.Typer(help="The tiny random-weight Llama used on machines without a model hub.", no_args_is_help=True)
app.add_typer(model_app, name="model")


@model_app.command("generate")
@handle_errors
def generate(
    seed: int = typer.Option(0, help="Seed for weights and tokenizer corpus."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Generate (once, cached) the tiny model and print its directory and weight hash."""
    from relocator.tinymodel import TinyModelSpec, ensure_tiny_model, weight_hash

    path = ensure_tiny_model(TinyModelSpec(seed=seed))
    info = {"path": str(path), "weight_sha256": weight_hash(path), "seed": seed}
    if json_out:
        print_json(info)
    else:
        console.print(f"model at [bold]{info['path']}[/] (weights sha256 {info['weight_sha256'][:16]}...)")
